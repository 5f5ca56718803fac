"""Full fine-tuning (--no-lora): fp32 master weights with a bf16 policy, and the KL reference across --resume.

Run: python -m pytest -q tests/test_full_finetune.py
"""
import pytest
import torch

import main
import models
import rewards
import tsp
from fragment import fragment_spec
from rollout import SamplingConfig, generate_fragment
from trainer import TrainConfig, Trainer

pytestmark = pytest.mark.timeout(240)


def _bf16_policy(fp32_master):
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.bfloat16)
    models.enable_full_training(policy, fp32_master=fp32_master)
    return policy


def _one_step(policy, fragment, lr):
    trainer = Trainer(policy, TrainConfig(lr=lr, noise_level=0.7))
    before = [p.detach().clone() for p in trainer.params]
    m, t_train = fragment.latents.shape[:2]
    packs = tsp.per_timestep_packs(m, t_train)
    trainer.accumulate(fragment, packs, [[1.0] * len(p) for p in packs], m * t_train)
    grads = [p.grad.detach().clone() for p in trainer.params]
    metrics = trainer.step(["color"])
    return trainer, before, grads, metrics


def test_fp32_master_weights_keep_the_lr_1e_5_update_that_a_pure_bf16_step_loses(tiny_cache):
    rollout = _bf16_policy(fp32_master=False)  # the rollout side: pure bf16, as rollout ranks run
    spec = fragment_spec(0, 0, 0, 2, 3, 2, 3)
    fragment = generate_fragment(rollout, spec, rewards.color_prompts("train"), SamplingConfig(num_steps=4),
                                 rewards.build_reward("color"), version=0, producer=0)
    pure, pure_before, pure_grads, pure_metrics = _one_step(rollout, fragment, lr=1e-5)
    master_policy = _bf16_policy(fp32_master=True)
    master, master_before, master_grads, master_metrics = _one_step(master_policy, fragment, lr=1e-5)
    assert pure.params[0].dtype == torch.bfloat16 and master.params[0].dtype == torch.float32
    # Weights with |w| >= 1/32 have a bf16 half-ulp >= 6e-5: AdamW's first step (about lr = 1e-5) cannot move them.
    big_pure = big_master = moved_pure = moved_master = 0
    for b, p, g in zip(pure_before, pure.params, pure_grads):
        big = (b.abs() >= 1 / 32) & (g != 0)
        big_pure += int(big.sum())
        moved_pure += int((p.detach() != b)[big].sum())
    for b, p, g in zip(master_before, master.params, master_grads):
        big = (b.abs() >= 1 / 32) & (g != 0)
        big_master += int(big.sum())
        moved_master += int((p.detach() != b)[big].sum())
    assert big_pure > 1000 and big_master > 1000
    assert moved_pure == 0  # pure bf16: the whole update rounded away
    assert moved_master >= 0.99 * big_master  # fp32 masters: they move (but where |grad| ~ Adam's eps)
    # The trainer's autocast forward is close to the rollout's pure-bf16 one: the log-prob gap stays small.
    assert pure_metrics["logprob_gap"] == 0.0  # same weights, same forward
    assert master_metrics["logprob_gap"] < 5e-3, master_metrics["logprob_gap"]
    # Publishing sends the masters in the rollout's dtype (main.py passes bf16 for full fine-tuning); the rollout's
    # bf16 weights are then the masters rounded to bf16 (test_a_bf16_run_publishes_fp32_masters_as_bf16 below
    # runs the real two-rank path).
    for p, w in zip(pure.params, master.iter_full_weights()):
        with torch.no_grad():
            p.copy_(w.to("cpu", torch.bfloat16))
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), w.detach().to(torch.bfloat16))


@pytest.mark.timeout(300)
def test_a_bf16_run_publishes_fp32_masters_as_bf16(tiny_cache, tmp_path):
    """DigenRL on 2 ranks, bf16, full fine-tuning: the trainer's fp32 masters reach the rollout's bf16 weights
    (the wire carries the rollout's dtype; a wrong one would not even fit the receive buffers)."""
    from conftest import read_metrics, run_forked

    run_forked(["--mode", "digenrl", "--nproc", "2", "--no-lora", "--dtype", "bfloat16", "--steps", "3",
                "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--eval-every", "0",
                "--save-every", "0", "--no-trace", "--lr", "1e-3"], tmp_path, "bf16", tiny_cache)
    rows = read_metrics(tmp_path / "bf16")
    assert len(rows) == 3 and all(r["skipped_step"] == 0 for r in rows)
    fresh = [r for r in rows if r.get("stale_frac", 0) == 0][1:]  # after an update, on-policy rows only
    assert all(r["logprob_gap"] < 5e-3 for r in fresh), [r["logprob_gap"] for r in rows]


@pytest.mark.timeout(600)
def test_kl_reference_after_resume_is_the_initial_weights_bit_for_bit(tiny_cache, tmp_path, monkeypatch):
    """A real run (main.py in this process, one colocated rank, bf16 with fp32 masters), resumed from step 2."""
    loaded = []
    real_load = models.load

    def capture(*args, **kwargs):
        loaded.append(real_load(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(models, "load", capture)
    common = ["--nproc", "1", "--mode", "colocated", "--no-lora", "--beta", "0.1", "--dtype", "bfloat16",
              "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--eval-every", "0", "--no-trace",
              "--no-progress", "--threads", "1", "--lr", "1e-2", "--out-dir", str(tmp_path)]
    assert main.main([*common, "--steps", "2", "--save-every", "2", "--run-name", "run"]) == 0
    assert main.main([*common, "--steps", "3", "--resume", str(tmp_path / "run")]) == 0
    policy = loaded[-1]
    initial = real_load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.bfloat16).transformer.state_dict()
    reference = policy.reference_transformer.state_dict()
    assert reference.keys() == initial.keys()
    for name, tensor in initial.items():
        assert reference[name].dtype == tensor.dtype and torch.equal(reference[name], tensor), name
    # and the run did move the weights (so a reference copied after the resume would differ)
    trained = policy.transformer.state_dict()
    assert any(not torch.equal(trained[n].to(t.dtype), t) for n, t in initial.items())
