"""grpo.py: the SDE step's log-prob is the Gaussian it samples from; advantages; the clipped loss."""
import math

import pytest
import torch

import grpo

pytestmark = pytest.mark.timeout(60)


def _inputs(b=4, shape=(16, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *shape, generator=g)
    v = torch.randn(b, *shape, generator=g)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.2])[:b]
    sigma_next = torch.tensor([0.9, 0.6, 0.3, 0.0])[:b]
    return x, v, sigma, sigma_next


@pytest.mark.parametrize("step", [grpo.sde_step_with_logprob, grpo.dance_sde_step_with_logprob])
def test_log_prob_is_the_gaussian_density_it_samples_from(step):
    x, v, s, s_next = _inputs()
    sample, logp, mean, std = step(v, x, s, s_next, 0.7)
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(sample).mean(dim=(1, 2))
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    # scoring the recorded sample reproduces the log-prob it was sampled with
    _, rescored, _, _ = step(v, x, s, s_next, 0.7, prev_sample=sample)
    torch.testing.assert_close(rescored, logp, rtol=0, atol=0)


@pytest.mark.parametrize("step", [grpo.sde_step_with_logprob, grpo.dance_sde_step_with_logprob])
def test_samples_have_the_stated_mean_and_std(step):
    x, v, _, _ = _inputs(b=1, shape=(200_000,))
    sample, _, mean, std = step(v, x, torch.tensor([0.8]), torch.tensor([0.6]), 0.7)
    z = (sample - mean) / std
    assert abs(float(z.mean())) < 0.01
    assert abs(float(z.std()) - 1.0) < 0.01


def test_flow_grpo_step_matches_the_formula_and_per_sample_sigmas():
    x, v, s, s_next = _inputs()
    noise = torch.randn_like(x)
    batched, logp, _, _ = grpo.sde_step_with_logprob(v, x, s, s_next, 0.7, noise=noise)
    for i in range(4):  # one sample at a time with scalar sigmas gives the same result
        single, lp, _, _ = grpo.sde_step_with_logprob(v[i:i + 1], x[i:i + 1], float(s[i]), float(s_next[i]), 0.7,
                                                      noise=noise[i:i + 1])
        torch.testing.assert_close(single[0], batched[i])
        torch.testing.assert_close(lp[0], logp[i])
    # hand formula for sample 1 (sigma 0.8 -> 0.6)
    sg, sn = 0.8, 0.6
    g = 0.7 * math.sqrt(sg / (1 - sg))
    dt = sn - sg
    mean = x[1] + (v[1] + g**2 / (2 * sg) * (x[1] + (1 - sg) * v[1])) * dt
    torch.testing.assert_close(batched[1], mean + g * math.sqrt(-dt) * noise[1])


def test_noise_level_zero_is_the_deterministic_ode_step():
    x, v, s, s_next = _inputs()
    out, logp, _, _ = grpo.sde_step_with_logprob(v, x, s, s_next, 0.0)
    torch.testing.assert_close(out, x + v * (s_next - s).reshape(-1, 1, 1))
    assert torch.all(logp == 0)


def test_group_advantages_zero_mean_unit_std_per_group():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0, 0.0, 1.0, 0.0, 1.0])
    a = grpo.group_advantages(r, 4)
    groups = a.reshape(3, 4)
    torch.testing.assert_close(groups.mean(1), torch.zeros(3), atol=1e-6, rtol=0)
    assert torch.all(groups[1] == 0)  # a zero-std group has no signal
    assert abs(float(groups[0].std(unbiased=False)) - 1) < 1e-3
    assert float(grpo.group_advantages(torch.tensor([0.0, 0.0, 0.0, 100.0]), 4, clip=1.0).max()) == 1.0
    with pytest.raises(ValueError, match="whole number of groups"):
        grpo.group_advantages(torch.ones(5), 4)


def test_on_policy_ratio_is_one_and_gradient_is_minus_advantage_times_grad_logp():
    theta = torch.randn(6, requires_grad=True)
    adv = torch.randn(6)
    logp = torch.sin(theta) * 2  # any differentiable log-prob
    loss, stats = grpo.policy_loss(logp, logp.detach(), adv, clip_range=1e-4)
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_min"]) == 1.0 and float(stats["clipfrac"]) == 0
    (grad,) = torch.autograd.grad(loss, theta)
    expected = -(adv * 2 * torch.cos(theta.detach())) / 6
    torch.testing.assert_close(grad, expected)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    logp = torch.tensor([0.5, -0.5], requires_grad=True)
    old = torch.zeros(2)
    adv = torch.tensor([1.0, -1.0])  # ratio > 1+e with A > 0, ratio < 1-e with A < 0: both clipped
    loss, stats = grpo.policy_loss(logp, old, adv, clip_range=0.1)
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert float(stats["clipfrac"]) == 1.0
    weights = torch.tensor([0.25, 0.75])
    wl, _ = grpo.policy_loss(logp.detach(), old, adv, 0.1, weights)
    per_pair = torch.maximum(-adv * torch.exp(logp.detach()), -adv * torch.exp(logp.detach()).clamp(0.9, 1.1))
    torch.testing.assert_close(wl, (per_pair * weights).sum())


def test_kl_loss_is_the_closed_form_gaussian_kl():
    m = torch.randn(3, 5, 4)
    ref = torch.randn(3, 5, 4)
    std = torch.tensor([0.5, 1.0, 2.0]).reshape(3, 1, 1)
    p = torch.distributions.Normal(m, std.expand_as(m))
    q = torch.distributions.Normal(ref, std.expand_as(ref))
    expected = torch.distributions.kl_divergence(p, q).mean(dim=(1, 2))
    torch.testing.assert_close(grpo.kl_loss(m, ref, std), expected)
