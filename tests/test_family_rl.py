"""One full RL step of every model family, end to end: main.py's job `--model X --mode digenrl --lora` (its ranks
forked as main.py forks them: conftest.run_forked) on 2 CPU ranks with the tiny pipeline (built into the cache by
models.tiny_pipeline_path, loaded by every rank through the family's diffusers `from_pretrained`), then checks on
the step-1 checkpoint: the LoRA update is finite and nonzero, the reference policy (adapters disabled) is the
initial model and differs from the trained one, and the diffusers LoRA file reproduces the trained policy. Also:
true CFG on both sides of the CFG families (Qwen-Image, Wan), DanceGRPO on HunyuanVideo with an animated eval GIF,
and video lengths the VAE cannot represent are refused."""
import json
import os

import pytest
import torch

import models
from conftest import checkpoint_weights, read_metrics, run_forked, trainable_state

pytestmark = pytest.mark.timeout(600)

FAMILIES = ["flux", "qwenimage", "wan", "hunyuanvideo", "sd3"]
# Small but real: 2 groups of 2 (a nonzero advantage needs 2 samples per group), 3 sampling steps (2 trained),
# the families' tiny 32 px images / 5-frame videos. Rank 8, alpha 16: LoRA scale 2, so the scale is exercised.
RL_STEP = ["--mode", "digenrl", "--nproc", "2", "--lora", "--lora-rank", "8", "--lora-alpha", "16", "--steps", "1",
           "--save-every", "1", "--eval-every", "0", "--timeout-s", "60", "--prompts-per-step", "2", "--group-size", "2",
           "--num-steps", "3", "--text-len", "16", "--seed", "0", "--no-trace",
           "--updates-per-batch", "1"]  # one update: every pair on-policy (ratio 1), LoRA A untouched
PROMPTS = ["a red image", "a blue image"]


@pytest.fixture(scope="module")
def trained(tiny_cache, tmp_path_factory):
    """name -> run directory of one RL step of that family (run on first use, once per module)."""
    out, runs = tmp_path_factory.mktemp("family_rl"), {}

    def get(name):
        if name not in runs:
            models.tiny_pipeline_path(name)  # built once, before the ranks load it
            run_forked(["--model", name, *RL_STEP], out, name, tiny_cache)
            runs[name] = os.path.join(out, name)
        return runs[name]

    return get


def initial_policy(run_dir):
    """The run's policy before training, rebuilt as main.py builds it: same pipeline, seed, LoRA rank/alpha."""
    with open(os.path.join(run_dir, "config.json")) as f:
        cfg = json.load(f)
    policy = models.load(cfg["model"], models.tiny_pipeline_path(cfg["model"]), "cpu", torch.float32,
                         max_sequence_length=cfg["text_len"])
    torch.manual_seed(cfg["seed"])  # main.py seeds before add_lora: the LoRA A init is reproducible
    models.add_lora(policy, cfg["lora_rank"], cfg["lora_alpha"], cfg["lora_targets"])
    return policy


def probe_input(policy):
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])
    return x, torch.tensor([0.9, 0.5]), policy.encode_prompts(PROMPTS)


@pytest.mark.parametrize("name", FAMILIES)
def test_one_rl_step_trains_the_lora(name, trained):
    run_dir = trained(name)
    (row,) = read_metrics(run_dir)
    assert row["skipped_step"] == 0 and row["pairs"] == 2 * 2 * 2 and row["trajectories"] == 4
    assert all(torch.isfinite(torch.tensor(row[k])) for k in ("loss", "grad_norm", "reward_mean"))
    assert row["grad_norm"] > 0 and row["collapsed_group_frac"] < 1  # there was a learning signal
    # The trainer's velocity (true CFG included) reproduces the rollout's log-probs: on-policy ratios, taken against
    # the rollout's recorded log-probs (Flow-GRPO's), are 1 to float32 rounding.
    assert row["logprob_gap"] < 1e-5 and abs(row["ratio_min"] - 1) < 1e-5 and abs(row["ratio_max"] - 1) < 1e-5

    policy = initial_policy(run_dir)
    x, sigma, cond = probe_input(policy)
    initial = {k: v.detach().clone() for k, v in trainable_state(policy.transformer).items()}
    weights = checkpoint_weights(run_dir, 1)
    assert weights.keys() == initial.keys() and all("lora" in k for k in weights)
    assert all(bool(w.isfinite().all()) for w in weights.values())
    lora_b = [k for k in weights if "lora_B" in k]
    assert lora_b and all(not initial[k].any() for k in lora_b)  # B starts at zero
    changed = [k for k in lora_b if not torch.equal(weights[k], initial[k])]
    # Every B on a path to the output moved. Exempt: the text stream of the last joint block (its text output is
    # discarded, e.g. Qwen-Image's one block), so add_*_proj / to_add_out and the text MLP (Flow-GRPO's Qwen-Image
    # targets include txt_mlp) may legitimately get no gradient.
    text_stream = ("add_", "txt_mlp")
    assert changed and all(k in changed for k in lora_b if not any(s in k for s in text_stream)), \
        sorted(set(lora_b) - set(changed))
    for k in weights:  # B = 0 at step 1 makes A's gradient exactly 0, and Adam's first step from 0 is 0
        if "lora_A" in k:
            assert torch.equal(weights[k], initial[k]), f"{k}: the rebuilt init differs from the run's"

    with torch.no_grad():
        v_initial = policy.velocity(x, sigma, cond)
        for n, p in policy.transformer.named_parameters():
            if n in weights:
                p.copy_(weights[n])
        v_trained = policy.velocity(x, sigma, cond)
        with policy.reference() as ref:
            v_ref = policy.velocity(x, sigma, cond, transformer=ref)
    assert bool(v_trained.isfinite().all())
    torch.testing.assert_close(v_ref, v_initial, rtol=0, atol=1e-6)  # the reference is the initial policy
    assert float((v_trained - v_ref).abs().max()) > 1e-4  # and the trained one differs from it

    # The checkpoint's diffusers LoRA file gives the same policy through the pipeline's own loader.
    fresh = models.load(name, models.tiny_pipeline_path(name), "cpu", torch.float32,
                        max_sequence_length=policy.max_sequence_length)
    fresh.pipe.load_lora_weights(os.path.join(run_dir, "checkpoints", "step_000001"))
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), v_trained, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FAMILIES)
def test_rollout_and_training_batches_carry_true_cfg(name, tiny_cache):
    """Qwen-Image, Wan and SD3: the rollout's and the trainer's transformer calls both hold cond and "" uncond rows
    with the same guidance; FLUX and HunyuanVideo (guidance-distilled): one branch only."""
    import rewards
    import tsp
    from fragment import fragment_spec
    from rollout import SamplingConfig, generate_fragment
    from trainer import TrainConfig, Trainer

    policy = models.load(name, models.tiny_pipeline_path(name), "cpu", torch.float32, max_sequence_length=16)
    models.add_lora(policy, 4, 8)
    calls = []

    def record(module, args, kwargs):
        calls.append((kwargs["hidden_states"].shape[0], kwargs["encoder_hidden_states"].detach(), torch.is_grad_enabled()))

    hook = policy.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        prompts = rewards.color_prompts("train")
        spec = fragment_spec(0, 0, 0, 1, len(prompts), 1, 2)
        fragment = generate_fragment(policy, spec, prompts, SamplingConfig(num_steps=2), rewards.build_reward("color"), 0, 0)
        trainer = Trainer(policy, TrainConfig())
        packs = tsp.per_timestep_packs(*fragment.latents.shape[:2])
        trainer.accumulate(fragment, packs, [[1.0] * len(p) for p in packs], total_pairs=2)
    finally:
        hook.remove()
    rollout, training = [c for c in calls if not c[2]], [c for c in calls if c[2]]
    assert len(rollout) == 2 and len(training) == len(packs)
    branches = 2 if policy.family.uses_true_cfg else 1
    assert all(b == branches * 2 for b, _, _ in rollout)  # m = 2 samples
    assert all(b == branches * len(p) for (b, _, _), p in zip(training, packs))
    if branches == 2:  # one half of the batch is the "" prompt's encoding: the second, the first for SD3 (its
        negative = policy.negative_cond["prompt_embeds"]  # pipeline's own [uncond; cond] order)
        for b, embeds, _ in calls:
            half = embeds[:b // 2] if name == "sd3" else embeds[b // 2:]
            torch.testing.assert_close(half, negative.expand(b // 2, -1, -1))
        assert policy.guidance > 1  # true CFG is on by default (4.0 Qwen-Image, 5.0 Wan, 4.5 SD3)


def test_dance_grpo_hunyuanvideo_two_steps_with_an_animated_eval(tiny_cache, tmp_path):
    from PIL import Image, ImageChops, ImageSequence

    models.tiny_pipeline_path("hunyuanvideo")
    run_forked(["--model", "hunyuanvideo", "--algo", "dance_grpo", "--nproc", "2", "--steps", "2", "--eval-every", "2",
                "--save-every", "0", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3",
                "--timeout-s", "60", "--no-trace", "--updates-per-batch", "1"],
               tmp_path, "dance", tiny_cache)  # one update a step: no pair scored after an update
    rows = read_metrics(tmp_path / "dance")
    assert len(rows) == 2 and all(r["skipped_step"] == 0 for r in rows)
    assert all(r["pairs"] == 2 * 2 * 1 for r in rows)  # DanceGRPO's default: int((T - 1) * 0.6) = 1 of T = 3 steps
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"], r["reward_mean"]])).all() for r in rows)
    # The trainers score DanceGRPO's step, with its eta, as the rollout did: step 0 (nothing can be stale yet) has
    # no log-prob gap. Catches main.py handing the trainer another algo or noise level than the rollout's.
    assert rows[0]["stale_fragments"] == 0 and rows[0]["logprob_gap"] < 1e-5, rows[0]
    with Image.open(tmp_path / "dance" / "eval" / "step_000002.gif") as gif:
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    assert len(frames) == models.get_family("hunyuanvideo").tiny_frames
    assert any(ImageChops.difference(a, b).getbbox() for a, b in zip(frames, frames[1:]))  # frames differ


def test_video_lengths_the_vae_cannot_represent_are_refused(tiny_cache):
    import cli

    with pytest.raises(ValueError, match="--frames 4 is not valid for wan"):
        cli.prepare(["--model", "wan", "--frames", "4"])
    cli.prepare(["--model", "wan", "--frames", "9"])
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        models.load("hunyuanvideo", models.tiny_pipeline_path("hunyuanvideo"), frames=6)
