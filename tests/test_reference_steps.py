"""The SDE steps and the trained timesteps against outside truths: the reference code and the forward process.

- The references' own code, transcribed below on the same inputs: DanceGRPO's `flux_step` and
  Flow-GRPO's `sde_step_with_logprob` (with diffusers' real FlowMatchEulerDiscreteScheduler).
- An independent derivation in float64: for Gaussian data the exact velocity and score are closed-form,
  so the reverse-time SDE's mean is written down without our code, and one small step must carry the
  forward process's marginal at sigma to its marginal at sigma_next (a wrong drift breaks that).
- Which sampling steps are trained, by each reference's own formula.

Run: python -m pytest -q tests/test_reference_steps.py
"""
import math

import pytest
import torch

import grpo
from rollout import SamplingConfig, num_train_timesteps, train_slots

pytestmark = pytest.mark.timeout(60)

SIGMAS = [0.98, 0.9, 0.7, 0.5, 0.3, 0.1, 0.05]


# --- DanceGRPO: XueZeyue/DanceGRPO, fastvideo/train_grpo_flux.py, `flux_step`, commit 22b85efe5312089f07c027d5ba94db168656c9dc.
# Transcribed as it is (called there with grpo=True, sde_solver=True). Note the log-prob statement: in the
# original the line `- math.log(std_dev_t)- torch.log(...)` stands alone after the closing parenthesis, so
# Python evaluates and discards it; the returned log-prob lacks the constant -log(std) - log sqrt(2 pi).
def dance_flux_step(model_output, latents, eta, sigmas, index, prev_sample, grpo, sde_solver):
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    if sde_solver:
        score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
        log_term = -0.5 * eta**2 * score_estimate
        prev_sample_mean = prev_sample_mean + log_term * dsigma
    if grpo and prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    if grpo:
        log_prob = (
            -((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2) / (2 * (std_dev_t**2))
        )
        - math.log(std_dev_t) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))  # noqa: B018 (a no-op upstream too)
        log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
        return prev_sample, pred_original_sample, log_prob
    return prev_sample_mean, pred_original_sample


# --- Flow-GRPO: yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, `sde_step_with_logprob`
# (sde_type="sde", the default), commit 54809b5fcf4d3930d2a17fa553928704bd0b719e; used by scripts/train_flux.py.
def flow_grpo_sde_step_with_logprob(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None,
                                    generator=None):
    from diffusers.utils.torch_utils import randn_tensor

    model_output = model_output.float()
    sample = sample.float()
    if prev_sample is not None:
        prev_sample = prev_sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    prev_step_index = [step + 1 for step in step_index]
    sigma = self.sigmas[step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_prev = self.sigmas[prev_step_index].view(-1, *([1] * (len(sample.shape) - 1)))
    sigma_max = self.sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        variance_noise = randn_tensor(model_output.shape, generator=generator, device=model_output.device,
                                      dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt))**2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, prev_sample_mean, std_dev_t


def _xv(shape=(3, 16, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_dance_step_matches_dance_grpo_flux_step():
    eta = 0.3
    shift = 3.0  # DanceGRPO's schedule: sd3_time_shift(shift, linspace(1, 0, T + 1))
    t = torch.linspace(1, 0, 17)
    sigmas = shift * t / (1 + (shift - 1) * t)
    x, v = _xv()
    for index in range(16):
        s, s_next = float(sigmas[index]), float(sigmas[index + 1])
        torch.manual_seed(index)
        theirs_sample, _, theirs_logp = dance_flux_step(v, x, eta, sigmas, index, None, grpo=True, sde_solver=True)
        torch.manual_seed(index)
        noise = torch.randn_like(x)
        ours_sample, ours_logp, mean, std = grpo.dance_sde_step_with_logprob(v, x, s, s_next, eta, noise=noise)
        torch.testing.assert_close(ours_sample, theirs_sample, rtol=1e-5, atol=1e-5)  # same noise -> same mean
        # their log-prob lacks the constant (see the transcription's note): add it back, then equal
        constant = math.log(eta * math.sqrt(s - s_next)) + 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(ours_logp, theirs_logp - constant, rtol=1e-5, atol=1e-4)
        # scoring a given sample (the training path) agrees too, and ratios between two policies are equal
        v2 = v + 0.01 * torch.randn_like(v)
        _, _, theirs_2 = dance_flux_step(v2, x, eta, sigmas, index, ours_sample, grpo=True, sde_solver=True)
        _, ours_2, _, _ = grpo.dance_sde_step_with_logprob(v2, x, s, s_next, eta, prev_sample=ours_sample)
        torch.testing.assert_close(ours_2 - ours_logp, theirs_2 - theirs_logp, rtol=1e-4, atol=1e-5)


def test_flow_grpo_step_matches_flow_grpo_sde_step_with_logprob():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    x, v = _xv()
    for index, timestep in enumerate(scheduler.timesteps):
        ts = timestep.expand(x.shape[0])
        gen = torch.Generator().manual_seed(index)
        theirs = flow_grpo_sde_step_with_logprob(scheduler, v, ts, x, noise_level=0.7, generator=gen)
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(index))
        s, s_next = scheduler.sigmas[index].expand(3), scheduler.sigmas[index + 1].expand(3)
        ours = grpo.sde_step_with_logprob(v, x, s, s_next, 0.7, noise=noise)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)  # sample
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-4)  # log-prob
        torch.testing.assert_close(ours[2], theirs[2], rtol=1e-5, atol=1e-5)  # mean
        # their std_dev_t is g; ours is the step std g sqrt(-dt)
        torch.testing.assert_close(ours[3].flatten(), (theirs[3] * torch.sqrt(s - s_next).reshape(-1, 1, 1)).flatten())


# --- the independent derivation: Gaussian data x0 ~ N(mu, s0^2) per dimension, x_sigma = (1 - sigma) x0 + sigma eps.
def _exact_fields(x, sigma, mu, s0):
    """Closed-form E[v | x_sigma = x] (v = eps - x0) and the marginal score at x, float64."""
    var = (1 - sigma) ** 2 * s0**2 + sigma**2  # Var x_sigma
    cov = sigma - (1 - sigma) * s0**2  # Cov(v, x_sigma)
    centred = x - (1 - sigma) * mu
    return -mu + cov / var * centred, -centred / var, var


def _diffusion(step, sigma, sigma_next, level):
    if step is grpo.dance_sde_step_with_logprob:
        return level  # DanceGRPO: g = eta
    return level * math.sqrt(sigma / (1 - (sigma_next if sigma >= 1 else sigma)))  # Flow-GRPO: g = a sqrt(s/(1-s))


@pytest.mark.parametrize("step, level", [(grpo.dance_sde_step_with_logprob, 0.3), (grpo.sde_step_with_logprob, 0.7)])
@pytest.mark.parametrize("sigma", SIGMAS)
def test_step_mean_is_the_reverse_sde_mean_derived_in_float64(step, level, sigma):
    """Reverse-time SDE with the flow's marginals (sigma decreasing): dx = [v - g^2/2 score] dsigma + g dw."""
    g = torch.Generator().manual_seed(1)
    mu, s0 = torch.randn(64, generator=g, dtype=torch.float64), 0.2 + torch.rand(64, generator=g, dtype=torch.float64)
    sigma_next = sigma - 0.04
    x = (1 - sigma) * mu + torch.randn(4, 64, generator=g, dtype=torch.float64) * ((1 - sigma) ** 2 * s0**2 + sigma**2).sqrt()
    v, score, _ = _exact_fields(x, sigma, mu, s0)
    gg = _diffusion(step, sigma, sigma_next, level)
    dsigma = sigma_next - sigma
    mean = x + (v - gg**2 / 2 * score) * dsigma  # [4, 64] float64
    std = gg * math.sqrt(-dsigma)
    sample = mean + std * torch.randn(mean.shape, generator=g, dtype=torch.float64)
    _, logp, ours_mean, ours_std = step(v.float(), x.float(), sigma, sigma_next, level, prev_sample=sample.float())
    torch.testing.assert_close(ours_mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_std.double().flatten(), torch.full((4,), std, dtype=torch.float64), rtol=1e-6, atol=0)
    expected = torch.distributions.Normal(mean, std).log_prob(sample.float().double()).mean(dim=1)
    torch.testing.assert_close(logp.double(), expected, rtol=1e-4, atol=2e-3)


@pytest.mark.parametrize("step, level", [(grpo.dance_sde_step_with_logprob, 0.3), (grpo.sde_step_with_logprob, 0.7)])
@pytest.mark.parametrize("sigma", SIGMAS)
def test_one_small_step_carries_the_marginal_at_sigma_to_the_marginal_at_sigma_next(step, level, sigma):
    """From x ~ p_sigma, the step's output must be ~ p_sigma_next up to O(dsigma^2): the defining property."""
    mu, s0 = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([0.3, 0.8, 1.5])
    dsigma = -2e-4
    sigma_next = sigma + dsigma
    # The step is affine in x for these exact fields: read its slope and offset off x = 0 and x = 1.
    means = []
    for at in (0.0, 1.0):
        x = torch.full((1, 3), at, dtype=torch.float64)
        v, _, _ = _exact_fields(x, sigma, mu.double(), s0.double())
        _, _, mean, std = step(v.float(), x.float(), sigma, sigma_next, level, prev_sample=x.float())
        means.append(mean.double()[0])
    slope, offset = means[1] - means[0], means[0]
    m, var = (1 - sigma) * mu.double(), (1 - sigma) ** 2 * s0.double() ** 2 + sigma**2
    out_mean, out_var = slope * m + offset, slope**2 * var + float(std.flatten()[0]) ** 2
    want_mean, want_var = (1 - sigma_next) * mu.double(), (1 - sigma_next) ** 2 * s0.double() ** 2 + sigma_next**2
    # The score term's sign, wrong, misses the variance by 2 g^2 |dsigma| (the drift and the noise then both
    # widen); right, the drift's -g^2 |dsigma| cancels the noise's +g^2 |dsigma| and only O(dsigma^2) is left.
    g2 = _diffusion(step, sigma, sigma_next, level) ** 2
    tolerance = 0.25 * g2 * abs(dsigma)  # 8x below the wrong sign's miss
    assert torch.all((out_mean - want_mean).abs() < tolerance), (out_mean - want_mean, tolerance)
    assert torch.all((out_var - want_var).abs() < tolerance), (out_var - want_var, tolerance)


# --- which sampling steps are trained ------------------------------------------------------------------
def flow_grpo_train_timesteps(num_steps, timestep_fraction):
    """yifan123/flow_grpo scripts/train_flux.py (commit 74db69191de9a0a54869c9c3341ce4b54db7005f): slot j of
    `latents[:, j]` is the latent before sampling step j, and the loop trains these j."""
    num_train_timesteps = int(num_steps * timestep_fraction)
    return [step_index for step_index in range(num_train_timesteps)]


def dance_grpo_trainable_and_count(sampling_steps, timestep_fraction):
    """XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py (commit 22b85efe...): `timesteps[:, :-1]` drops the last
    step, a per-sample randperm of the rest is taken, and the first int(len * fraction) of it are trained."""
    trainable = list(range(sampling_steps))[:-1]
    return trainable, int(len(trainable) * timestep_fraction)


@pytest.mark.parametrize("fraction", [0.99, 1.0, 0.6, 0.5, 0.35])
def test_flow_grpo_trains_the_steps_flow_grpo_trains(fraction):
    for num_steps in range(2, 17):
        cfg = SamplingConfig(num_steps=num_steps, timestep_fraction=fraction)
        want = flow_grpo_train_timesteps(num_steps, fraction)
        if not want:
            with pytest.raises(ValueError, match="trains no step"):
                num_train_timesteps(cfg)
            continue
        assert num_train_timesteps(cfg) == len(want)
        assert all(train_slots(cfg, seed) == want for seed in range(5)), (num_steps, fraction)


@pytest.mark.parametrize("fraction", [0.6, 1.0, 0.99])
def test_dance_grpo_trains_a_random_subset_of_all_but_the_last_step(fraction):
    for num_steps in (4, 6, 16):
        cfg = SamplingConfig(num_steps=num_steps, timestep_fraction=fraction, algo="dance_grpo")
        trainable, count = dance_grpo_trainable_and_count(num_steps, fraction)
        assert num_train_timesteps(cfg) == count
        seen = torch.zeros(num_steps)
        for seed in range(400):
            slots = train_slots(cfg, seed)
            assert len(slots) == count and slots == sorted(set(slots)) and set(slots) <= set(trainable)
            seen[slots] += 1
        # every trainable step is drawn about count / (T - 1) of the time (uniform subsets), the last never
        share = seen[:-1] / 400
        assert torch.all((share - count / len(trainable)).abs() < 0.1), share
        assert seen[-1] == 0


def test_config_defaults_are_each_references_fraction():
    import cli
    import config

    flow = config.resolve(config.parse_args([]))
    dance = config.resolve(config.parse_args(["--algo", "dance_grpo"]))
    assert (flow.timestep_fraction, dance.timestep_fraction) == (0.99, 0.6)
    assert num_train_timesteps(SamplingConfig(num_steps=6, timestep_fraction=flow.timestep_fraction)) == 5
    with pytest.raises(ValueError, match="trains no step"):
        cli.validate(config.resolve(config.parse_args(["--num-steps", "2", "--timestep-fraction", "0.4"])), 2)
