"""The SD3.5 family (models/sd3.py) against outside truths: StableDiffusion3Pipeline's own sampling loop, Flow-GRPO's
own SD3 SDE step (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, re-typed below) on the family's real velocity
and schedule, and Flow-GRPO's SD3 LoRA target list (scripts/train_sd3.py).

Run: python -m pytest -q tests/test_sd3.py
"""
import json
import os

import pytest
import torch

import cli
import config
import grpo
import models
from flowgrpo import presets
import rewards
from fragment import fragment_spec
from models import lora
from rollout import SamplingConfig, generate_fragment

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("sd3") / "pipeline"
    models.get_family("sd3").build_tiny(str(path), seed=0)  # $DIGENRL_TINY_PRETRAIN (quick under pytest)
    return str(path)


# Flow-GRPO's own SDE step (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, re-typed once, in
# test_reference_steps.py: the file is SD3's, scripts/train_sd3.py samples and trains with it) and the Euler loop
# against a pipeline's own sampling (test_families.py).
from test_families import euler_and_pipeline  # noqa: E402
from test_reference_steps import flow_grpo_sde_step_with_logprob as flow_grpo_sd3_sde_step_with_logprob  # noqa: E402


@pytest.mark.parametrize("resolution", [32, 64])
def test_velocity_reproduces_sd3_pipelines_own_sampling(sd3_path, resolution):
    """An Euler loop over policy.velocity lands where StableDiffusion3Pipeline(output_type="latent") lands, from the
    same noise, at two resolutions and with true CFG on (4.5) and off (1.0: the pipeline then runs one branch).
    Catches: the timestep passed as sigma instead of 1000 sigma, FLUX's explicit 1 .. 1/T schedule instead of the
    pipeline's own set_timesteps(T), CFG branches swapped ([cond; uncond] read as [uncond; cond]) or rescaled,
    the pooled and sequence embeddings swapped, noise in another layout than prepare_latents'."""
    steps, prompt, seed = 4, "a red image", 0
    policy = models.load("sd3", sd3_path, height=resolution)
    landed = {}
    for guidance in (4.5, 1.0):
        policy.guidance = guidance
        x, target, schedule = euler_and_pipeline(policy, prompt, steps, seed)
        torch.testing.assert_close(policy.sigmas(steps), schedule)
        torch.testing.assert_close(x, target, rtol=1e-4, atol=1e-4)
        landed[guidance] = x
    assert float((landed[4.5] - landed[1.0]).abs().max()) > 1e-3  # CFG changes where it lands
    assert float(schedule[-2]) < 0.02 < float(schedule[-3])  # the pipeline's own schedule ends near sigma_min, not 1/T


def test_a_bf16_policy_passes_the_pipelines_float32_timesteps(sd3_path):
    """StableDiffusion3Pipeline hands the transformer scheduler.timesteps in float32 whatever the model dtype; a bf16
    policy must too (bf16 rounds t = 751.1 to 752: a different time embedding than the pipeline's and the reference's
    on GPUs, which the float32 CPU tests cannot see). Catches the timestep cast to the policy dtype."""
    policy = models.load("sd3", sd3_path, dtype=torch.bfloat16)
    sigmas = policy.sigmas(6)
    seen = []
    hook = policy.transformer.register_forward_pre_hook(lambda mod, args, kw: seen.append(kw["timestep"]),
                                                        with_kwargs=True)
    try:
        x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])
        v = policy.velocity(x, sigmas[1:3], policy.encode_prompts(["a red image", "a blue image"]))
    finally:
        hook.remove()
    assert v.dtype == torch.float32 and bool(v.isfinite().all())
    (t,) = seen
    assert t.dtype == torch.float32
    torch.testing.assert_close(t, policy.pipe.scheduler.timesteps[1:3].repeat(2), rtol=0, atol=0)  # [uncond; cond]


def _shift(s, shift=3.0):
    return shift * s / (1 + (shift - 1) * s)  # SD3's time shift (Esser et al. 2024, eq. 23)


def test_schedule_and_latent_scaling_are_sd35_mediums(sd3_path):
    """The tiny pipeline carries SD3.5-Medium's scheduler (scheduler/scheduler_config.json: FlowMatchEulerDiscrete,
    1000 training steps, shift 3.0, no dynamic shift) and VAE latent scaling (vae/config.json: scaling_factor 1.5305,
    shift_factor 0.0609), and policy.sigmas(T) is that scheduler's sampling schedule written out: diffusers spaces
    T timesteps from sigma_max = 1 to sigma_min = shift(1/1000) and shifts them again, then appends 0.
    Catches a wrong or missing shift (the pipeline comparison cannot: it shares the scheduler)."""
    import numpy as np

    policy = models.load("sd3", sd3_path)
    sched = policy.pipe.scheduler.config
    assert type(policy.pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert (sched.num_train_timesteps, sched.shift, bool(sched.use_dynamic_shifting)) == (1000, 3.0, False)
    assert (policy.pipe.vae.config.scaling_factor, policy.pipe.vae.config.shift_factor) == (1.5305, 0.0609)
    for steps in (4, 10):
        written = np.append(_shift(np.linspace(1.0, _shift(1 / 1000), steps)), 0.0)
        torch.testing.assert_close(policy.sigmas(steps), torch.tensor(written, dtype=torch.float32), rtol=0, atol=1e-6)


def test_sde_step_on_sd3_matches_flow_grpos_sd3_sde_with_logprob(sd3_path):
    """Flow-GRPO's own SD3 step (re-typed above, driven by the pipeline's scheduler and timesteps) and
    grpo.sde_step_with_logprob agree to 1e-5 on SD3's real velocity (true CFG), at every step of the SD3 schedule,
    including sigma = 1 (where Flow-GRPO divides by 1 - sigmas[1]): the sample from the same noise, the mean, the
    log-prob, and the log-prob of a given sample (the training path). Then the rollout's recorded log-probs of an
    SD3 fragment are Flow-GRPO's log-probs of its recorded transitions. Catches any drift of the SDE mean or std
    from the reference, and a rollout that records log-probs under another schedule or timestep than SD3's."""
    policy = models.load("sd3", sd3_path)
    scheduler, level, steps = policy.pipe.scheduler, 0.7, 6
    sigmas = policy.sigmas(steps)  # also sets the scheduler's timesteps, as the pipeline does
    assert float(sigmas[0]) == 1.0
    cond = policy.encode_prompts(["a red image", "a blue image"])
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])  # [2, C, h, w]
    for index in range(steps):
        with torch.no_grad():
            v = policy.velocity(x, sigmas[index].expand(2), cond)
        timesteps = scheduler.timesteps[index].expand(2)
        theirs = flow_grpo_sd3_sde_step_with_logprob(scheduler, v, timesteps, x, level,
                                                     generator=torch.Generator().manual_seed(index))
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(index))  # what randn_tensor drew
        ours = grpo.sde_step_with_logprob(v, x, sigmas[index].expand(2), sigmas[index + 1].expand(2), level, noise=noise)
        for a, b in zip(ours[:3], theirs[:3]):  # sample, log-prob, mean
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        dt = sigmas[index] - sigmas[index + 1]
        torch.testing.assert_close(ours[3].flatten(), (theirs[3] * dt.sqrt()).flatten(), rtol=1e-5, atol=1e-7)
        given = theirs[0] + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + index))
        _, theirs_logp, _, _ = flow_grpo_sd3_sde_step_with_logprob(scheduler, v, timesteps, x, level, prev_sample=given)
        _, ours_logp, _, _ = grpo.sde_step_with_logprob(v, x, sigmas[index], sigmas[index + 1], level, prev_sample=given)
        torch.testing.assert_close(ours_logp, theirs_logp, rtol=1e-5, atol=1e-5)
        x = ours[0]

    prompts = rewards.color_prompts("train")
    spec = fragment_spec(seed=0, step=0, first_group=0, num_groups=1, num_prompts_total=len(prompts),
                         groups_per_step=1, group_size=2)
    cfg = SamplingConfig(num_steps=steps, noise_level=level)
    fragment = generate_fragment(policy, spec, prompts, cfg, rewards.build_reward("color"), version=0, producer=0)
    m, t_train = fragment.latents.shape[:2]
    policy.sigmas(steps)
    for j in range(t_train):
        latents, index = fragment.latents[:, j], fragment.timestep_index[:, j]
        with torch.no_grad():
            v = policy.velocity(latents, fragment.sigmas[:, j], fragment.cond)
        _, theirs_logp, _, _ = flow_grpo_sd3_sde_step_with_logprob(
            scheduler, v, scheduler.timesteps[index], latents, level, prev_sample=fragment.next_latents[:, j])
        torch.testing.assert_close(fragment.log_probs[:, j], theirs_logp, rtol=1e-5, atol=1e-5)


# Flow-GRPO scripts/train_sd3.py (commit 74db69191de9a0a54869c9c3341ce4b54db7005f): `target_modules` and
# LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian", ...).
FLOW_GRPO_SD3_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                         "attn.to_out.0", "attn.to_q", "attn.to_v"]


def test_lora_targets_are_flow_grpos_sd3_list(sd3_path):
    """The flow_grpo preset of sd3 is Flow-GRPO's SD3 list, rank and alpha; on the tiny SD3.5 transformer it adapts
    exactly the joint-attention projections (not SD3.5's second self-attention attn2, not the feed-forwards), and
    the last block's missing text output (context_pre_only) is simply absent. Catches a preset copied from FLUX
    (feed-forwards, r 64) or an `attention` list that leaks into the published preset."""
    preset = lora.preset("sd3")
    assert list(preset.targets) == FLOW_GRPO_SD3_TARGETS
    assert (preset.rank, preset.alpha) == (32, 64.0) and "train_sd3.py" in preset.source
    policy = models.load("sd3", sd3_path)
    expected = {n for n, mod in policy.transformer.named_modules() if isinstance(mod, torch.nn.Linear)
                and any(n.endswith("." + t) for t in FLOW_GRPO_SD3_TARGETS)}
    models.add_lora(policy, 4, 8.0)  # the default: the flow_grpo preset
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A." in n}
    assert adapted == expected and "transformer_blocks.0.attn.to_q" in adapted
    assert "transformer_blocks.1.attn.to_add_out" not in adapted  # the last block is context_pre_only
    assert not any("attn2" in n or ".ff" in n for n in adapted)
    assert any("attn2" in n for n, _ in policy.transformer.named_modules())  # the MMDiT-X block is there


def test_pretrained_sd35_layout_selects_the_family_and_its_preset(sd3_path, tmp_path, monkeypatch):
    """A directory in stabilityai/stable-diffusion-3.5-medium's layout (model_index.json naming
    StableDiffusion3Pipeline, three text encoders) is recognised as sd3 without --model and runs with Flow-GRPO's
    SD3 recipe (config/grpo.py pickscore_sd3) at SD3.5's native 1024 px; without T5 it is refused naming the folder."""
    with open(os.path.join(sd3_path, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert {"text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer_3"} <= set(index)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config.resolve(config.parse_args(["--pretrained", sd3_path]))
    assert cfg.model == "sd3" and cfg.lora and (cfg.lora_rank, cfg.lora_alpha) == (32, 64.0)
    assert (cfg.resolution, cfg.group_size, cfg.num_steps, cfg.guidance, cfg.noise_level) == (1024, 24, 10, 4.5, 0.7)
    assert "Flow-GRPO sd3" in presets.describe(cfg) and "pickscore_sd3" in presets.describe(cfg)
    import shutil

    broken = tmp_path / "no_t5"
    shutil.copytree(sd3_path, broken)
    shutil.rmtree(broken / "text_encoder_3")
    with pytest.raises(FileNotFoundError, match="'text_encoder_3'"):
        models.load("sd3", str(broken))


def test_no_train_cfg_scores_the_conditional_branch_alone(sd3_path):
    """Flow-GRPO's train.cfg = False: the training forward is the conditional branch alone, i.e. the pipeline's
    velocity with CFG off (guidance 1: do_classifier_free_guidance is False), while sampling keeps CFG. With
    --no-train-cfg the trainer's pair loss scores recorded pairs under that velocity: its log-prob is the
    SDE log-prob of the conditional-only velocity, and differs from the CFG one. Catches the flag not reaching
    the trainer, or cfg=False still running the unconditional branch."""
    policy = models.load("sd3", sd3_path)
    policy.guidance = 4.5
    sigmas = policy.sigmas(4)
    cond = policy.encode_prompts(["a red image", "a blue image"])
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])  # [2, C, h, w]
    with torch.no_grad():
        guided = policy.velocity(x, sigmas[1].expand(2), cond)
        alone = policy.velocity(x, sigmas[1].expand(2), cond, cfg=False)
        policy.guidance = 1.0  # the pipeline without CFG: the conditional branch
        plain = policy.velocity(x, sigmas[1].expand(2), cond)
        policy.guidance = 4.5
    torch.testing.assert_close(alone, plain, rtol=0, atol=0)
    assert (alone - guided).abs().max() > 1e-3

    from tsp import gather_pairs
    from trainer import Trainer, TrainConfig
    prompts = rewards.color_prompts("train")
    spec = fragment_spec(seed=0, step=0, first_group=0, num_groups=1, num_prompts_total=len(prompts),
                         groups_per_step=1, group_size=2)
    fragment = generate_fragment(policy, spec, prompts, SamplingConfig(num_steps=4, noise_level=0.7),
                                 rewards.build_reward("color"), version=0, producer=0)
    batch = gather_pairs(fragment, [(0, 1), (1, 2)])
    policy.transformer.requires_grad_(True)  # full fine-tuning, as the tiny runs train
    weights = torch.full((2,), 0.5)
    for train_cfg, guidance in ((True, 4.5), (False, 1.0)):
        cfg = config.resolve(config.parse_args(["--model", "sd3", "--noise-level", "0.7"] +
                                               ([] if train_cfg else ["--no-train-cfg"])))
        trainer = Trainer(policy, TrainConfig.of(cfg))
        assert trainer.cfg.train_cfg is train_cfg
        _, _, logp = trainer.pair_loss(batch, weights, recorded=True)
        policy.guidance = guidance
        with torch.no_grad():
            v = policy.velocity(batch["latents"], batch["sigma"], batch["cond"])
        policy.guidance = 4.5
        _, expected, _, _ = grpo.sde_step_with_logprob(v, batch["latents"], batch["sigma"], batch["sigma_next"], 0.7,
                                                       prev_sample=batch["next_latents"])
        torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
        if train_cfg:  # CFG in training too: the recorded log-probs are reproduced (ratio 1 on-policy)
            torch.testing.assert_close(logp, batch["old_log_prob"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model", ["flux", "hunyuanvideo"])
def test_no_train_cfg_is_refused_for_guidance_distilled_families(model, tiny_cache):
    """FLUX and HunyuanVideo embed guidance (one branch): --no-train-cfg has nothing to drop and is refused before
    any rank starts, naming the flag and the families it applies to."""
    cfg = config.resolve(config.parse_args(["--model", model, "--no-train-cfg"]))
    with pytest.raises(ValueError, match="--no-train-cfg: .*guidance-distilled.*sd3, qwenimage and wan"):
        cli.validate(cfg, 2)


def test_fp16_autocast_is_flow_grpos_sd3_precision(sd3_path):
    """Catches SD3 under --algo flow_grpo on CUDA running bf16 where Flow-GRPO runs float32 weights with fp16
    autocast (config/base.py line 21 mixed_precision "fp16"; scripts/train_sd3.py lines 401-415 keep the VAE and the
    transformer float32, the text encoders fp16), and the mode leaking to other families, algorithms or the CPU."""
    from infra import runtime

    def cfg(**kw):
        return config.Config(**{"model": "sd3", "algo": "flow_grpo", "dtype": "auto", **kw})
    assert runtime.fp16_autocast(cfg(), use_cuda=True)
    assert not runtime.fp16_autocast(cfg(), use_cuda=False)  # the CPU keeps float32
    assert not runtime.fp16_autocast(cfg(model="flux"), use_cuda=True)  # FLUX: bf16, as its recipe
    assert not runtime.fp16_autocast(cfg(algo="dance_grpo"), use_cuda=True)
    assert not runtime.fp16_autocast(cfg(dtype="bfloat16"), use_cuda=True)
    assert runtime.fp16_autocast(cfg(model="flux", dtype="fp16-autocast"), use_cuda=False)
    policy = models.load("sd3", sd3_path, "cpu", torch.float32, max_sequence_length=16)
    x = policy.noise(torch.Generator().manual_seed(0))[None]
    exact = policy.velocity(x, torch.full((1,), 0.7), policy.encode_prompts(["a red image"]))
    models.compute_in_fp16(policy)
    assert policy.pipe.text_encoder.dtype == policy.pipe.text_encoder_3.dtype == torch.float16
    assert policy.transformer.dtype == policy.pipe.vae.dtype == torch.float32
    seen = []
    hook = policy.transformer.register_forward_hook(lambda m, a, out: seen.append(torch.get_autocast_dtype("cpu")
                                                                                   if torch.is_autocast_enabled("cpu")
                                                                                   else None))
    half = policy.velocity(x, torch.full((1,), 0.7), policy.encode_prompts(["a red image"]))
    hook.remove()
    assert seen == [torch.float16] and half.dtype == torch.float32
    torch.testing.assert_close(half, exact, rtol=0.05, atol=0.05)  # fp16's rounding, not another model
    assert not torch.equal(half, exact)
