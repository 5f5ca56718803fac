"""One whole RL step of ours against Flow-GRPO's training step re-typed, on the tiny SD3 and FLUX pipelines.

Outside truth: yifan123/flow_grpo's scripts/train_sd3.py (line numbers at commit ac4c86e) and scripts/train_flux.py
(commit 74db691: the same loop without the zero-advantage mask, no CFG, the KL's mean over dims (1, 2)),
flow_grpo/stat_tracking.py PerPromptStatTracker.update and flow_grpo/ema.py EMAModuleWrapper.step, re-typed below
as they are (accelerate's gradient accumulation written out: the loss divided by the accumulation count, the
gradient clipped and the optimizer stepped on the last forward of each update), with `sde_step_with_logprob` from
tests/test_reference_steps.py (its own transcription, with diffusers' scheduler).

Both sides start from the same LoRA weights (B nonzero, so the reference, the adapters disabled, differs from the
policy and the KL term acts from the first pair) and train the same trajectories, generated once by our rollout:
3 (SD3) or 4 (FLUX) prompts x 2 samples, T = 3 (2 trained steps), per-prompt statistics with global std, beta 0.5, 2 updates of 2
sampled sub-batches each, recorded log-probs off by up to three clip ranges (a rollout's other numerics), max_grad_norm 0.05 (clipping acts), EMA every 2 updates (its trigger falls inside the
step, applied twice: one ema.step per sub-batch). One prompt's rewards are all equal: SD3's script drops its
samples (advantage 0) and re-divides the rest; FLUX's keeps them. Ours runs the real trainer side
(main.TrainerRank.train_batch with --minibatches samples, batch_rewards.BatchRewards's restate, TrainerRank.train's TSP
packs, trainer.Trainer) from the run's resolved Config. The trained weights and the EMA must equal Flow-GRPO's
(allclose in float32), and each hand-made bug of issue 39 must break that: the KL over the step variance
(--kl-scale step), the unconditional branch back-propagated (--no-detach-uncond), update 0 against its own
log-prob (--old-log-prob fresh), whole-group minibatches (--minibatches groups), the zero-advantage samples kept.

Run: python -m pytest -q tests/test_flow_grpo_step.py
"""
import contextlib
import dataclasses
import functools
import types

import pytest
import torch

from flowgrpo import batch_rewards
import config
import grpo
import models
from fragment import fragment_spec
from conftest import tiny_fragment, trainer_rank_of  # noqa: F401  (the tiny_cache fixture comes with conftest)
from rollout import SamplingConfig, generate_fragment
from test_reference_steps import flow_grpo_sde_step_with_logprob as sde_step_with_logprob
from trainer import TrainConfig, Trainer

pytestmark = pytest.mark.timeout(600)

# SD3: 3 x 2 samples, the blue pair dropped: 4 kept, 4 sub-batches of 1; FLUX (nothing dropped): 4 x 2 = 8, 4 of 2
PROMPTS = {"sd3": ["a red image", "a green image", "a blue image"],
           "flux": ["a red image", "a green image", "a blue image", "a grey image"]}
G, T, NUM_BATCHES, BETA, LR, MAX_NORM, CLIP = 2, 3, 4, 0.5, 1e-3, 0.05, 1e-4
GA = NUM_BATCHES // 2  # config/grpo.py: gradient_accumulation_steps = num_batches_per_epoch // 2


def reward(images, prompts, prompt_ids=None):
    """The mean pixel, except "blue" whose samples all score 0.5 (a prompt with no learning signal)."""
    r = images.mean(dim=(1, 2, 3))
    flat = torch.tensor(["blue" in p for p in prompts])
    r = torch.where(flat, torch.full_like(r, 0.5), r)
    return {"r": r, "total": r}


def policy_pair(model):
    """Two identical tiny policies with LoRA whose B is nonzero: ours and Flow-GRPO's copy."""
    out = []
    for _ in range(2):
        policy = models.load(model, models.tiny_pipeline_path(model), "cpu", torch.float32, max_sequence_length=16)
        torch.manual_seed(0)
        models.add_lora(policy, 4, 8, "attention")
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in policy.transformer.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        out.append(policy)
    return out


def run_config(model, **overrides):
    """The run's resolved Config: Flow-GRPO's choices by default (what resolve gives sd3 / flux)."""
    fields = dict(model=model, prompts_per_step=len(PROMPTS[model]), group_size=G, num_steps=T, updates_per_batch=2,
                  per_prompt_stat_tracking=True, global_std=True, beta=BETA, lr=LR, clip_range=CLIP,
                  max_grad_norm=MAX_NORM, weight_decay=1e-4, ema=True, ema_every=2, ema_repeats=GA,
                  noise_level=policy_noise(model), lora=True, lora_rank=4, lora_alpha=8, lora_targets="attention",
                  seed=0)
    return config.resolve(config.Config(**{**fields, **overrides}), world=1)


def trajectories(policy, cfg):
    """The step's groups, one fragment each, from our rollout (the same for both sides). The recorded
    log-probs are moved by up to +-3e-4, three clip ranges, as a rollout's own numerics move them (bf16, other
    batches): on-policy pairs then have ratios off 1, which the ratio's reference decides about."""
    sampling = SamplingConfig.of(cfg)
    fragments = []
    prompts = PROMPTS[cfg.model]
    for group in range(len(prompts)):
        spec = fragment_spec(cfg.seed, 0, group, 1, len(prompts), len(prompts), G)
        fragment = generate_fragment(policy, spec, prompts, sampling, reward, version=0, producer=0)
        shift = 6e-4 * (torch.rand(fragment.log_probs.shape, generator=torch.Generator().manual_seed(group)) - 0.5)
        fragments.append(dataclasses.replace(fragment, log_probs=fragment.log_probs + shift))
    return fragments


# --- ours: the real trainer side --------------------------------------------------------------------------------
def our_step(policy, fragments, cfg):
    """One RL step through main.TrainerRank as trainer_rank builds it (one colocated rank): restated batch
    advantages, the step's sample minibatches, TSP packs, M updates and the step's optimizer step."""
    trainer = Trainer(policy, TrainConfig.of(cfg))
    batch = batch_rewards.BatchRewards(None, cfg.prompts_per_step, G, batch_rewards.run_advantages(cfg))
    books = types.SimpleNamespace(optimizer_step=lambda step: trainer.step(["r"]), update=lambda step: trainer.update())
    metrics = trainer_rank_of(cfg, trainer, books, batch).train_batch(0, list(fragments))
    return [p.detach().clone() for p in trainer.params], [s.clone() for s in trainer.ema.shadow], metrics


# --- Flow-GRPO's, re-typed ----------------------------------------------------------------------------------------
class EMAModuleWrapper:
    """flow_grpo/ema.py (lines 8-56), the parts train_*.py uses."""

    def __init__(self, parameters, decay=0.9999, update_step_interval=1):
        self.ema_parameters = [p.clone().detach() for p in parameters]  # line 17
        self.decay, self.update_step_interval = decay, update_step_interval

    def get_current_decay(self, optimization_step):  # lines 33-37
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    @torch.no_grad()
    def step(self, parameters, optimization_step):  # lines 39-49
        parameters = list(parameters)
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                if parameter.requires_grad:
                    ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def per_prompt_advantages(prompts, rewards, global_std):
    """flow_grpo/stat_tracking.py PerPromptStatTracker.update, type 'grpo' (lines 11-31), on a fresh tracker
    (train_sd3.py line 780 clears it after every epoch). rewards [N, T] (train_sd3.py line 740 repeats them)."""
    import numpy as np

    prompts = np.array(prompts)
    rewards = np.array(rewards.tolist(), dtype=np.float64)
    unique = np.unique(prompts)
    advantages = np.empty_like(rewards) * 0.0
    stats = {}
    for prompt in unique:
        stats[prompt] = list(rewards[prompts == prompt])
    for prompt in unique:
        stats[prompt] = np.stack(stats[prompt])
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(stats[prompt], axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(stats[prompt], axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


def compute_log_prob(model, transformer, pipeline, sample, j, embeds, pooled_embeds, noise_level, guidance):
    """train_sd3.py compute_log_prob (lines 180-215, config.train.cfg on) / train_flux.py's (guidance embedded)."""
    if model == "sd3":
        noise_pred = transformer(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)  # line 189
        noise_pred_uncond = noise_pred_uncond.detach()  # line 190
        noise_pred = noise_pred_uncond + guidance * (noise_pred_text - noise_pred_uncond)  # lines 191-195
    else:
        latents = sample["latents"][:, j]
        guidance_vec = (torch.tensor([guidance]).expand(latents.shape[0])
                        if transformer.config.guidance_embeds else None)
        side = int(round(latents.shape[1] ** 0.5))
        noise_pred = transformer(
            hidden_states=latents,
            timestep=sample["timesteps"][:, j] / 1000,
            guidance=guidance_vec,
            pooled_projections=sample["pooled_prompt_embeds"],
            encoder_hidden_states=sample["prompt_embeds"],
            txt_ids=torch.zeros(sample["prompt_embeds"].shape[1], 3),
            img_ids=pipeline._prepare_latent_image_ids(1, side, side, "cpu", torch.float32),  # the pipeline's
            return_dict=False,
        )[0]
    return sde_step_with_logprob(  # lines 206-213
        pipeline.scheduler, noise_pred.float(), sample["timesteps"][:, j], sample["latents"][:, j].float(),
        prev_sample=sample["next_latents"][:, j].float(), noise_level=noise_level)


@contextlib.contextmanager
def disable_adapter(transformer):
    """peft's `transformer.module.disable_adapter()` (line 877) on a diffusers model with an adapter."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def their_samples(policy, fragments, prompts):
    """The fragments as train_sd3.py's `samples` dict (lines 667-682, after line 698's collation)."""
    scheduler = policy.pipe.scheduler
    policy.sigmas(T)  # the scheduler holds this schedule (pipeline_with_logprob's retrieve_timesteps)
    cat = functools.partial(torch.cat, dim=0)
    return {
        "prompts": [prompts[int(i)] for f in fragments for i in f.prompt_ids],
        "prompt_embeds": cat([f.cond["prompt_embeds"] for f in fragments]),
        "pooled_prompt_embeds": cat([f.cond["pooled_prompt_embeds"] for f in fragments]),
        "timesteps": scheduler.timesteps.repeat(sum(f.num_samples for f in fragments), 1),  # line 658
        "latents": cat([f.latents for f in fragments]),
        "next_latents": cat([f.next_latents for f in fragments]),
        "log_probs": cat([f.log_probs for f in fragments]),
        "rewards": cat([f.rewards for f in fragments]),
    }, scheduler.timesteps


def their_step(model, policy, fragments, minibatch_seed, mask_zero_advantages):
    """train_sd3.py lines 738-955 (train_flux.py: the same without lines 796-817), one epoch, one process."""
    samples, _ = their_samples(policy, fragments, PROMPTS[model])
    transformer = policy.transformer
    params = [p for p in transformer.parameters() if p.requires_grad]  # line 443
    ema = EMAModuleWrapper(params, decay=0.9, update_step_interval=2)  # line 445 (interval 2 here)
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)  # lines 465-471
    num_train_timesteps = int(T * 0.99)  # line 345
    prompts = samples.pop("prompts")
    rewards = samples.pop("rewards").unsqueeze(1).repeat(1, num_train_timesteps)  # line 740
    samples["advantages"] = torch.as_tensor(per_prompt_advantages(prompts, rewards, True))  # lines 761, 785-789
    samples["timesteps"] = samples["timesteps"][:, :num_train_timesteps]  # (only the trained steps are kept here)
    neg = {k: v for k, v in policy.negative_cond.items()} if policy.negative_cond is not None else None
    torch.manual_seed(minibatch_seed)  # the draws below are ours (grpo.minibatch_seed): the same permutation
    if mask_zero_advantages:
        mask = samples["advantages"].abs().sum(dim=1) != 0  # line 797
        num_batches = NUM_BATCHES
        true_count = mask.sum()
        if true_count % num_batches != 0:  # lines 803-808
            false_indices = torch.where(~mask)[0]
            num_to_change = num_batches - (true_count % num_batches)
            if len(false_indices) >= num_to_change:
                random_indices = torch.randperm(len(false_indices))[:num_to_change]
                mask[false_indices[random_indices]] = True
        samples = {k: v[mask] for k, v in samples.items()}  # line 817
    total_batch_size = samples["latents"].shape[0]  # line 819
    perm = torch.randperm(total_batch_size)  # line 829
    samples = {k: v[perm] for k, v in samples.items()}  # line 830
    samples_batched = {k: v.reshape(-1, total_batch_size // NUM_BATCHES, *v.shape[1:])
                       for k, v in samples.items()}  # lines 833-836
    samples_batched = [dict(zip(samples_batched, x)) for x in zip(*samples_batched.values())]  # lines 839-841
    accumulation, forwards, global_step = GA * num_train_timesteps, 0, 0  # line 360
    for i, sample in enumerate(samples_batched):
        if neg is not None:  # lines 852-859: [negative; prompt] embeddings
            b = len(sample["prompt_embeds"])
            embeds = torch.cat([neg["prompt_embeds"].expand(b, -1, -1), sample["prompt_embeds"]])
            pooled_embeds = torch.cat([neg["pooled_prompt_embeds"].expand(b, -1), sample["pooled_prompt_embeds"]])
        else:
            embeds, pooled_embeds = sample["prompt_embeds"], sample["pooled_prompt_embeds"]
        for j in range(num_train_timesteps):  # line 864
            forwards += 1
            sync = forwards % accumulation == 0  # accelerator.accumulate: sync on every GA * T-th forward
            _, log_prob, prev_sample_mean, std_dev_t = compute_log_prob(
                model, transformer, policy.pipe, sample, j, embeds, pooled_embeds, policy_noise(model),
                policy.guidance)  # line 874
            with torch.no_grad(), disable_adapter(transformer):  # lines 876-878
                _, _, prev_sample_mean_ref, _ = compute_log_prob(
                    model, transformer, policy.pipe, sample, j, embeds, pooled_embeds, policy_noise(model),
                    policy.guidance)
            advantages = torch.clamp(sample["advantages"][:, j], -5, 5)  # lines 881-885
            ratio = torch.exp(log_prob - sample["log_probs"][:, j])  # line 886
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - CLIP, 1.0 + CLIP)
            policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))  # line 893
            dims = tuple(range(1, prev_sample_mean.ndim))  # SD3 (1, 2, 3) (line 895), FLUX (1, 2)
            kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=dims, keepdim=True) \
                / (2 * std_dev_t ** 2)
            kl_loss = torch.mean(kl_loss)  # line 896
            loss = policy_loss + BETA * kl_loss  # line 897
            (loss / accumulation).backward()  # accelerator.backward(loss) divides by the accumulation steps
            if sync:  # lines 934-939 (the optimizer wrapper steps and zeroes only on a sync)
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1  # line 952
        ema.step(params, global_step)  # lines 954-955: after every sampled sub-batch
    return [p.detach().clone() for p in params], ema.ema_parameters


def policy_noise(model):
    return 0.7 if model == "sd3" else 0.9


# --- the tests ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["sd3", "flux"])
def step(request, tiny_cache):
    """(model, our policy, the Flow-GRPO copy, the trajectories, Flow-GRPO's trained weights and EMA)."""
    model = request.param
    ours, theirs = policy_pair(model)
    cfg = run_config(model)
    fragments = trajectories(ours, cfg)
    initial = [p.detach().clone() for p in ours.transformer.parameters() if p.requires_grad]
    want, want_ema = their_step(model, theirs, fragments, grpo.minibatch_seed(cfg.seed, 0),
                                mask_zero_advantages=model == "sd3")
    return model, ours, fragments, initial, want, want_ema


def _restore(policy, initial):
    with torch.no_grad():
        for p, v in zip([p for p in policy.transformer.parameters() if p.requires_grad], initial):
            p.copy_(v)


def _close(got, want) -> bool:
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got, want))


def test_one_rl_step_equals_flow_grpos_training_step(step):
    """Catches any departure of the default training step from Flow-GRPO's on SD3 (CFG, detached unconditional
    branch, zero-advantage drop) and FLUX: the KL's scale, the ratio's reference, the minibatches, the
    accumulation's weights, the clipping, AdamW, the EMA's stepping."""
    model, policy, fragments, initial, want, want_ema = step
    cfg = run_config(model)
    assert (cfg.kl_scale, cfg.old_log_prob, cfg.minibatches) == ("diffusion", "rollout", "samples")
    assert (cfg.detach_uncond, cfg.drop_zero_advantage) == ((True, True) if model == "sd3" else (False, False))
    got, got_ema, metrics = our_step(policy, fragments, cfg)
    _restore(policy, initial)
    moved = max(float((a - b).abs().max()) for a, b in zip(want, initial))
    assert moved > 1e-4  # the step moved the weights: equality below is not between two unchanged models
    assert 0 < metrics["clipfrac"] < 1 and metrics["kl"] > 0 and metrics["updates"] == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    for a, b in zip(got_ema, want_ema):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert not _close(got_ema, initial)  # the EMA's trigger fell inside the step


BUGS = {  # issue 39's departures, each a hand-made bug against Flow-GRPO's step, on the model it applies to
    "sd3: KL over the step variance": dict(kl_scale="step"),
    "sd3: CFG's unconditional branch back-propagated": dict(detach_uncond=False),
    "sd3: zero-advantage samples kept": dict(drop_zero_advantage=False),
    "flux: KL over the step variance": dict(kl_scale="step"),
    "flux: update 0 against its own log-prob": dict(old_log_prob="fresh"),
    "flux: minibatches of whole groups": dict(minibatches="groups"),
    "flux: the EMA applied once per trigger": dict(ema_repeats=1),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_departure_breaks_the_equality(step, bug):
    """The equality above is not a tautology: each departure issue 39 lists, run through the same path, gives
    other weights (or another EMA). The CFG and zero-advantage ones exist on SD3 only (FLUX has no CFG, and
    Flow-GRPO's FLUX script keeps zero advantages); the others run on FLUX, the cheaper model."""
    model, policy, fragments, initial, want, want_ema = step
    if not bug.startswith(model):
        pytest.skip(f"checked on {bug.split(':')[0]}")
    got, got_ema, _ = our_step(policy, fragments, run_config(model, **BUGS[bug]))
    _restore(policy, initial)
    assert not (_close(got, want) and _close(got_ema, want_ema)), bug


@pytest.mark.parametrize("kept", [8, 5, 2, 0])
def test_sample_minibatches_are_flow_grpos_mask_padding_and_permutation(kept):
    """grpo.sample_minibatches against train_sd3.py lines 797-836 re-typed (one GPU, num_batches_per_epoch = M = 2,
    so its unit and ours agree), from the same seed: the kept samples, the dropped ones put back at random to make
    the count divisible (5 kept of 8: one put back), the permutation and the cut. Catches a pad to the wrong
    multiple, a put-back sample chosen otherwise, a cut that is not consecutive."""
    total, updates, seed = 8, 2, grpo.minibatch_seed(3, 7)
    advantages = torch.zeros(total, 2)
    advantages[torch.tensor([1, 2, 4, 6, 7, 0, 3, 5][:kept], dtype=torch.long)] = 1.0
    torch.manual_seed(seed)
    mask = advantages.abs().sum(dim=1) != 0  # line 797
    true_count = mask.sum()
    if true_count % updates != 0:  # lines 803-808
        false_indices = torch.where(~mask)[0]
        num_to_change = updates - (true_count % updates)
        if len(false_indices) >= num_to_change:
            mask[false_indices[torch.randperm(len(false_indices))[:num_to_change]]] = True
    index = torch.arange(total)[mask]  # line 817
    index = index[torch.randperm(len(index))]  # lines 829-830
    want = index.reshape(-1, len(index) // updates).tolist() if len(index) else [[], []]  # lines 833-836
    assert grpo.sample_minibatches(total, updates, seed, advantages[:, 0] != 0) == want
    if kept == 5:
        assert sum(len(m) for m in want) == 6  # one dropped sample put back

