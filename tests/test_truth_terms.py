"""The trainer's other trained quantities pinned to outside truths: the KL term (beta > 0) and the DanceGRPO path.

- KL: one real training step with beta > 0 against a reference that differs from the policy (a perturbed
  copy for full fine-tuning; for LoRA with nonzero B, the base transformer copied before the adapters went
  in): the gradient the optimizer sees is autograd on the plain objective written out here (test_truth's
  Flow-GRPO loss plus beta / (N T_train) times the sum over pairs of torch.distributions' Gaussian KL between
  the policy's and the reference's step distributions: --kl-scale step; times each pair's |dt|, Flow-GRPO's
  KL over g^2 instead of the step variance g^2 |dt|: --kl-scale diffusion, the default), and the logged `kl`
  is that KL's mean over the real pairs. Catches: the KL with the wrong sign (the step would push away from
  the reference), the wrong weight, a reference that is the policy itself (LoRA adapters not disabled: KL 0),
  a KL over another std (each scale against the other's), padding pairs in the metric.
- DanceGRPO: a fragment generated with `--algo dance_grpo` (constant eta, shared group noise, random
  per-sample timesteps) and trained through Trainer.accumulate in packs that mix timesteps: the trainer's
  log-probs are the rollout's (logprob_gap below 1e-5, and the PPO ratio against the recorded log-probs of the
  same weights within 1e-5 of 1), and the step's gradient is autograd on DanceGRPO's objective built from
  DanceGRPO's own `flux_step` (the transcription in test_reference_steps.py). Catches: the trainer scoring
  Dance pairs with the Flow-GRPO step, a Dance step whose score term has the wrong sign (rollout and trainer
  would agree with each other, not with DanceGRPO), a wrong eta in training.

Run: python -m pytest -q tests/test_truth_terms.py
"""
import copy
import dataclasses
import math

import pytest
import torch

import models
import tsp
from conftest import tiny_fragment
from fragment import fragment_spec
from rollout import SamplingConfig, generate_fragment
from test_reference_steps import dance_flux_step
from test_truth import NOISE_LEVEL, _stale_fragment, _step_gradient, plain_flow_grpo_loss
from trainer import TrainConfig

pytestmark = pytest.mark.timeout(120)
BETA, ETA = 0.5, 0.3


@pytest.fixture(scope="module")
def setup(tiny_cache):
    return tiny_fragment(NOISE_LEVEL)


# --- the KL term ---------------------------------------------------------------------------------------
def plain_kl(policy, reference, fragment):
    """([n pairs] KL(N(mean_theta, std^2) || N(mean_ref, std^2)) of each pair's Flow-GRPO step, averaged over the
    latent dimensions (the log-prob's convention), by torch.distributions; the reference without gradient,
    [n pairs] |dt| of each pair's step)."""
    kls, dts = [], []
    m, t_train = fragment.latents.shape[:2]
    for i in range(m):
        cond = {k: v[i:i + 1] for k, v in fragment.cond.items()}
        for j in range(t_train):
            x, sigma, sigma_next = fragment.latents[i, j][None], fragment.sigmas[i, j], fragment.sigmas_next[i, j]
            dt = sigma_next - sigma
            g = NOISE_LEVEL * torch.sqrt(sigma / (1 - (sigma_next if sigma == 1 else sigma)))

            def step_mean(v):  # Flow-GRPO's sde_step_with_logprob mean, its own algebraic form
                return x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt

            mean = step_mean(policy.velocity(x, sigma.reshape(1), cond))
            with torch.no_grad():
                ref_mean = step_mean(policy.velocity(x, sigma.reshape(1), cond, transformer=reference))
            std = g * torch.sqrt(-dt)
            kls.append(torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                                         torch.distributions.Normal(ref_mean, std)).mean())
            dts.append(-dt)
    return torch.stack(kls), torch.stack(dts)


def _lora_policy_and_base():
    """A tiny FLUX policy with LoRA whose B is nonzero (so it differs from its base), and the base transformer
    copied before the adapters went in: the reference computed without the adapters-off switch under test."""
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    base = copy.deepcopy(policy.transformer)  # before the adapters go in
    torch.manual_seed(1)
    models.add_lora(policy, 4, 8, "attention")
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return policy, base


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_kl_value_and_gradient_are_the_plain_objectives_with_a_perturbed_reference(setup, kind):
    policy, *_, fragment = setup
    if kind == "full":
        reference = copy.deepcopy(policy.transformer).requires_grad_(False)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.05 * p.std().nan_to_num(0.0) * torch.randn(p.shape, generator=gen))
        policy.reference_transformer = reference  # Trainer(beta > 0) keeps a reference already set
    else:
        policy, reference = _lora_policy_and_base()
    try:
        m, t_train = fragment.latents.shape[:2]
        total = 2 * m * t_train  # the fragment is half the batch
        params = [p for p in policy.transformer.parameters() if p.requires_grad]
        exact, dt = plain_kl(policy, reference, fragment)
        assert float(exact.detach().min()) > 0  # the reference differs at every pair: a sign or weight error shows
        policy_loss = plain_flow_grpo_loss(policy, fragment, fragment.log_probs, 0.01, total)
        packs, masks = tsp.tsp_packs(m, t_train, 0, 1, 4)  # two padding pairs, left out of the kl metric
        kls = {"step": exact, "diffusion": exact * dt}  # Flow-GRPO's: over g^2, not g^2 |dt|
        wants = {scale: torch.autograd.grad(policy_loss + BETA * kl.sum() / total, params, retain_graph=True)
                 for scale, kl in kls.items()}
        for scale, kl in kls.items():
            want = wants[scale]
            cfg = TrainConfig(lr=1e-3, clip_range=0.01, max_grad_norm=1e6, noise_level=NOISE_LEVEL, beta=BETA,
                              kl_scale=scale)
            got, metrics = _step_gradient(policy, fragment, cfg, packs, masks, total)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
            assert metrics["kl"] == pytest.approx(float(kl.detach().mean()), rel=1e-4)
        if kind == "full":
            assert policy.reference_transformer is reference  # the trainer used this reference, not a new copy
    finally:
        if kind == "full":
            policy.reference_transformer = None


# --- DanceGRPO ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dance(setup):
    """A DanceGRPO fragment of 2 groups of 3: T = 5, T_train = int(4 * 0.5) = 2 random steps per sample."""
    policy, _, reward, prompts, *_ = setup
    sampling = SamplingConfig(num_steps=5, noise_level=ETA, timestep_fraction=0.5, algo="dance_grpo")
    spec = fragment_spec(seed=0, step=0, first_group=0, num_groups=2, num_prompts_total=3, groups_per_step=2,
                         group_size=3, shared_group_noise=True)
    fragment = generate_fragment(policy, spec, prompts, sampling, reward, version=0, producer=0)
    assert len({tuple(s) for s in fragment.timestep_index.tolist()}) > 1  # samples train different steps
    return policy, fragment


def plain_dance_grpo_loss(policy, fragment, old_log_probs, clip_range, total_pairs):
    """DanceGRPO's clipped objective one pair at a time, its log-prob from DanceGRPO's own flux_step (grpo=True,
    sde_solver=True); that code drops the constant -log(std) - log sqrt(2 pi), added back here so that ratios
    against recorded log-probs mean the same (it changes no gradient). old_log_probs None = on-policy."""
    loss = 0.0
    m, t_train = fragment.latents.shape[:2]
    for i in range(m):
        cond = {k: v[i:i + 1] for k, v in fragment.cond.items()}
        for j in range(t_train):
            x, x_next = fragment.latents[i, j][None], fragment.next_latents[i, j][None]
            sigma, sigma_next = float(fragment.sigmas[i, j]), float(fragment.sigmas_next[i, j])
            v = policy.velocity(x, fragment.sigmas[i, j].reshape(1), cond)
            _, _, logp = dance_flux_step(v, x, ETA, [sigma, sigma_next], 0, x_next, grpo=True, sde_solver=True)
            logp = logp[0] - math.log(ETA * math.sqrt(sigma - sigma_next)) - 0.5 * math.log(2 * math.pi)
            ratio = torch.exp(logp - (logp.detach() if old_log_probs is None else old_log_probs[i, j]))
            a = fragment.advantages[i]
            loss = loss + torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    return loss / total_pairs


def test_dance_grpo_trainer_scores_the_rollouts_log_probs(dance):
    policy, fragment = dance
    m, t_train = fragment.latents.shape[:2]
    packs, masks = tsp.tsp_packs(m, t_train, 0, 1, 4)  # packs of 4 mix timesteps and samples
    cfg = TrainConfig(clip_range=0.01, noise_level=ETA, algo="dance_grpo", max_grad_norm=1e6)
    _, fresh = _step_gradient(policy, fragment, cfg, packs, masks, m * t_train)
    assert fresh["logprob_gap"] < 1e-5, fresh["logprob_gap"]
    # The same fragment as a stale one (same weights): the ratio is now against the recorded log-probs.
    stale = dataclasses.replace(fragment, policy_version=-1)
    _, metrics = _step_gradient(policy, stale, cfg, packs, masks, m * t_train)
    assert metrics["logprob_gap"] < 1e-5, metrics["logprob_gap"]
    assert abs(metrics["ratio_min_stale"] - 1) < 1e-5 and abs(metrics["ratio_max_stale"] - 1) < 1e-5, metrics


@pytest.mark.parametrize("stale", [False, True])
def test_dance_grpo_step_gradient_is_autograd_on_dance_grpos_objective(dance, stale):
    policy, fragment = dance
    fragment = _stale_fragment(fragment) if stale else fragment
    m, t_train = fragment.latents.shape[:2]
    params = [p for p in policy.transformer.parameters() if p.requires_grad]
    old = fragment.log_probs if stale else None
    want = torch.autograd.grad(plain_dance_grpo_loss(policy, fragment, old, 0.01, m * t_train), params)
    packs, masks = tsp.tsp_packs(m, t_train, 0, 1, 4)
    cfg = TrainConfig(lr=1e-3, clip_range=0.01, max_grad_norm=1e6, noise_level=ETA, algo="dance_grpo")
    got, metrics = _step_gradient(policy, fragment, cfg, packs, masks, m * t_train)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
    if stale:
        assert 0 < metrics["clipfrac"] < 1  # the clipped branch is exercised
