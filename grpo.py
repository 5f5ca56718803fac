"""Flow-GRPO math: the SDE sampling step and its log-prob, group advantages, the clipped loss, KL;
and Flow-GRPO's several updates per batch (its minibatches: which rows each update trains).

Pure functions, float32 inside, no model and no process group. docs/DESIGN.md section 3.

    import torch, grpo
    x = torch.randn(4, 64, 16); v = torch.randn_like(x)
    nxt, logp, mean, std = grpo.sde_step_with_logprob(v, x, torch.full((4,), 0.8),
                                                      torch.full((4,), 0.6), 0.7)

Conventions (Flow-GRPO's): sigma runs from 1 (noise) to 0 (data), x_sigma = (1 - sigma) x0 + sigma
eps, the model predicts the velocity v = eps - x0, dt = sigma_next - sigma < 0. The log-prob of a
step is the Gaussian log density *averaged* over latent dimensions, so ratios are close to 1 and the
clip range is tiny (about 1e-4 for real models).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from fragment import Fragment
from gap import Announcement

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """A scalar or a [B] tensor -> float32 [B, 1, 1, ...] broadcastable against `like`."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(sample; mean, std^2) averaged over every non-batch dimension -> [B] (float32)."""
    log_density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return log_density.mean(dim=tuple(range(1, sample.ndim)))


def _sample_or_score(mean, std, noise, prev_sample):
    """Shared tail of both SDE steps: draw x_next (or take the given one) and score it."""
    if prev_sample is None:
        if noise is None:
            noise = torch.randn_like(mean)
        prev_sample = mean + std * noise.to(torch.float32)
    prev_sample = prev_sample.to(torch.float32)
    if bool((std == 0).all()):  # noise level 0: the deterministic ODE step (evaluation); no density
        return mean, torch.zeros(mean.shape[0], device=mean.device), mean, std
    return prev_sample, gaussian_log_prob(prev_sample.detach(), mean, std), mean, std


def sde_step_with_logprob(velocity, latents, sigma, sigma_next, noise_level, noise=None,
                          prev_sample=None):
    """One Flow-GRPO SDE step x_sigma -> x_sigma_next (docs/DESIGN.md section 3; Flow-GRPO eq. 9).

    velocity, latents: [B, ...]; sigma, sigma_next: floats or [B] tensors (per-sample timesteps, so
    packed pairs from different timesteps share one call); noise_level: the `a` of the paper.
    noise: optional standard normal [B, ...] (for deterministic trajectories); prev_sample: if
    given, only score it (training recomputes the log-prob of the recorded trajectory).
    Returns (prev_sample [B, ...], log_prob [B], mean [B, ...], std [B, 1, ...]), all float32.
    """
    v = velocity.to(torch.float32)
    x = latents.to(torch.float32)
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dt = s_next - s  # < 0
    g = _flow_grpo_diffusion(s, s_next, noise_level)
    # mean = x + [v + g^2/(2 sigma) (x + (1 - sigma) v)] dt   (the SDE with the same marginals as
    # the ODE)
    mean = x + (v + g**2 / (2 * s) * (x + (1 - s) * v)) * dt
    std = g * torch.sqrt(-dt)
    return _sample_or_score(mean, std, noise, prev_sample)


def _flow_grpo_diffusion(s: torch.Tensor, s_next: torch.Tensor, noise_level) -> torch.Tensor:
    """g = a sqrt(sigma / (1 - sigma)), Flow-GRPO's std_dev_t (sd3_sde_with_logprob.py line 47); at
    sigma = 1 the denominator uses the next sigma."""
    denom = 1 - torch.where(s >= 1, s_next, s)
    return noise_level * torch.sqrt(s / denom)


def diffusion_coefficient(algo: str, sigma, sigma_next, noise_level, like: torch.Tensor):
    """The SDE's diffusion coefficient g of each pair's step -> float32 [B, 1, ...] (the step's std
    is g sqrt(-dt)): Flow-GRPO's std_dev_t, or DanceGRPO's constant eta."""
    s, s_next = _per_sample(sigma, like), _per_sample(sigma_next, like)
    if algo == "dance_grpo":
        return torch.full_like(s, float(noise_level))
    return _flow_grpo_diffusion(s, s_next, noise_level)


def dance_sde_step_with_logprob(velocity, latents, sigma, sigma_next, eta, noise=None,
                                prev_sample=None):
    """DanceGRPO's SDE step (DanceGRPO `flux_step`, grpo=True, sde_solver=True): diffusion g = eta
    constant.

    The reverse-time SDE with the same marginals as the flow ODE dx = v dsigma, run from sigma to
    sigma_next (dsigma = sigma_next - sigma < 0), is dx = [v - g^2/2 score] dsigma + g dw, so
        mean = x + v dsigma - (eta^2 / 2) score dsigma,   std = eta sqrt(sigma - sigma_next),
    with the score of x_sigma = (1 - sigma) x0 + sigma eps estimated from x0_hat = x - sigma v:
        score = -(x - (1 - sigma) x0_hat) / sigma^2.
    (The score term moves the mean *towards* the data: with dsigma < 0 it adds +eta^2/2 score
    |dsigma|.)
    Same signature and returns as `sde_step_with_logprob`. The log-prob is the full Gaussian
    density; DanceGRPO's code drops the constant -log(std) - log sqrt(2 pi) (it does not change
    ratios).
    """
    v = velocity.to(torch.float32)
    x = latents.to(torch.float32)
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)
    dsigma = s_next - s  # < 0
    x0_hat = x - s * v
    score = -(x - (1 - s) * x0_hat) / s**2
    mean = x + (v - 0.5 * eta**2 * score) * dsigma
    std = eta * torch.sqrt(-dsigma)
    return _sample_or_score(mean, std, noise, prev_sample)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, clip: float = 5.0,
                     std_floor: float = 0.0) -> torch.Tensor:
    """A_i = (r_i - mean_group) / (max(std_group, std_floor) + eps), clipped to +-clip
    (docs/DESIGN.md section 3).

    rewards: [N] with the members of a group contiguous (N = groups * group_size). Per-group std is
    a documented departure from Flow-GRPO's default global std: it keeps a fragment self-contained.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} is not a whole number of groups "
                         f"of {group_size}")
    r = rewards.to(torch.float32).reshape(-1, group_size)  # [groups, G]
    std = r.std(dim=1, unbiased=False, keepdim=True).clamp(min=std_floor)  # floor 0: the std itself
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + eps)
    return adv.clamp(-clip, clip).reshape(-1)  # [N]


def policy_loss(log_prob, old_log_prob, advantages, clip_range, weights=None):
    """PPO-clipped loss over pairs: max(-A r, -A clip(r, 1-e, 1+e)), r = exp(logp - logp_old).

    All inputs [n]. With `weights` [n] the loss is sum(w * per_pair) (the trainer passes
    1/(N T_train) so accumulation over fragments reproduces the batch mean); without, the mean.
    A pair of weight 0 is padding (TSP): it adds nothing to the loss and is left out of the stats.
    Returns (loss, stats) where stats are detached floats-as-tensors over the real pairs.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_pair = torch.maximum(unclipped, clipped)  # [n]
    loss = per_pair.mean() if weights is None else (per_pair * weights).sum()
    with torch.no_grad():
        real = (torch.ones_like(ratio, dtype=torch.bool) if weights is None
                else weights.to(ratio.device) != 0)  # [n]
        count = real.sum().clamp(min=1)
        mean = lambda t: (t * real).sum() / count  # noqa: E731  (mean over the real pairs)
        stats = {
            "approx_kl": mean(0.5 * log_ratio.detach() ** 2),
            "clipfrac": mean(((ratio.detach() - 1.0).abs() > clip_range).float()),
            "ratio_mean": mean(ratio.detach()),
            "ratio_min": torch.where(real, ratio.detach(), torch.inf).min(),
            "ratio_max": torch.where(real, ratio.detach(), -torch.inf).max(),
        }
    return loss, stats


KL_SCALES = ("diffusion", "step")


def kl_loss(mean: torch.Tensor, ref_mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """((m - m_ref)^2 averaged over dims) / (2 scale^2) per pair -> [B] (config.kl_scale).

    scale = the step std g sqrt(-dt) ("step"): the exact KL(N(m, s^2) || N(m_ref, s^2)) per
    dimension, averaged over dims like the log-prob. scale = g, the diffusion coefficient without
    sqrt(-dt) ("diffusion"): Flow-GRPO's kl_loss (scripts/train_sd3.py line 895, and train_flux.py:
    `.mean(dims) / (2 * std_dev_t ** 2)` with std_dev_t = g), 1/|dt| times smaller.
    """
    dims = tuple(range(1, mean.ndim))
    per_pair = scale.reshape(scale.shape[0], -1)[:, 0]  # [B]
    return ((mean - ref_mean) ** 2).mean(dim=dims) / (2 * per_pair**2)


# --- Flow-GRPO's advantage options (flow_grpo/stat_tracking.py PerPromptStatTracker,
# scripts/train_sd3.py) ----------------------------------------------------------------------------
# Pure functions over one batch's rewards. They need the whole batch's rewards (a prompt's groups
# may sit in several fragments, and global_std pools every sample), so under GAP a fragment's
# advantages are final only once the batch's last reward is in: batch_rewards.BatchRewards gathers
# them across ranks and restates the fragments' advantages.
def _prompt_index(prompt_keys, n: int) -> torch.Tensor:
    """Prompt keys (a [N] integer tensor of prompt ids, or N hashable keys such as prompt strings)
    -> [N] long index of each sample's prompt, 0 .. P-1 in order of first appearance."""
    if isinstance(prompt_keys, torch.Tensor):
        keys = prompt_keys.reshape(-1).tolist()
    else:
        keys = list(prompt_keys)
    if len(keys) != n:
        raise ValueError(f"{len(keys)} prompt keys for {n} rewards: give one prompt (id or text) "
                         "per sample")
    first = {}
    return torch.tensor([first.setdefault(k, len(first)) for k in keys], dtype=torch.long)


def _prompt_stats(rewards: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and population std (ddof 0) of the rewards of its prompt over the whole
    batch, float64 [N]."""
    p = int(index.max()) + 1
    # [P]
    count = torch.zeros(p, dtype=torch.float64).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(p, dtype=torch.float64).index_add_(0, index, rewards) / count  # [P]
    centred = rewards - mean[index]  # [N]
    var = torch.zeros(p, dtype=torch.float64).index_add_(0, index, centred**2) / count  # [P]
    return mean[index], var.sqrt()[index]


def batch_advantages(rewards: torch.Tensor, prompt_keys=None, global_std: bool = False,
                     per_prompt: bool = True, eps: float = 1e-4, std_floor: float = 0.0,
                     clip: float | None = 5.0) -> torch.Tensor:
    """Flow-GRPO's advantages over a whole batch -> float32 [N] (docs/DESIGN.md section 3).

    per_prompt (config.per_prompt_stat_tracking): A_i = (r_i - mean_p) / (std + eps), mean_p over
    *every* sample of prompt p in the batch (several groups of the same prompt pool together, as
    PerPromptStatTracker.update does, cleared after each batch), std = that prompt's population std,
    or with global_std (config.sample.global_std, on in Flow-GRPO's SD3 recipes) the std of all N
    rewards. Without per_prompt: (r - mean_all) / (std_all + eps) (train_sd3.py's else-branch).
    std_floor (ours, 0 = Flow-GRPO's): the std is at least this, so a group whose reward spread has
    collapsed to noise (std 0.007 on rewards of scale 1) is not blown up to unit advantages.
    clip: Flow-GRPO clamps to +-train.adv_clip_max (5) in its training loop; None leaves them
    unclipped.
    Statistics in float64, as Flow-GRPO's numpy code computes them.
    rewards: [N]; prompt_keys: [N] prompt ids or N prompt texts (needed when per_prompt).
    """
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: expected a non-empty [N] "
                         "tensor")
    if std_floor < 0 or eps < 0:
        raise ValueError(f"std_floor {std_floor} and eps {eps} must be >= 0")
    r = rewards.detach().to("cpu", torch.float64)
    if per_prompt:
        if prompt_keys is None:
            raise ValueError("per-prompt advantages need the prompt of every sample (prompt_keys)")
        mean, std = _prompt_stats(r, _prompt_index(prompt_keys, r.numel()))
    else:
        mean = r.mean().expand_as(r)
    if global_std or not per_prompt:
        std = r.std(unbiased=False).expand_as(r)  # np.std: ddof 0
    adv = (r - mean) / (std.clamp(min=std_floor) + eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv.to(torch.float32)


def collapsed_prompts(rewards: torch.Tensor, prompt_keys, min_std: float = 0.0) -> torch.Tensor:
    """[N] bool: True for samples whose prompt's rewards over the batch have population
    std <= min_std (groups with no learning signal; train them and normalised noise drives the
    update). Flow-GRPO (train_sd3.py) drops samples whose advantages are all exactly zero, i.e.
    prompts whose rewards are all equal: min_std = 0. Drop the True samples from training (their
    weight 0) to guard with a threshold; the metric of the fraction is their mean."""
    if min_std < 0:
        raise ValueError(f"min_std {min_std} must be >= 0")
    r = rewards.detach().to("cpu", torch.float64).reshape(-1)
    _, std = _prompt_stats(r, _prompt_index(prompt_keys, r.numel()))
    return std <= min_std


COLLAPSED_ACTIONS = ("drop", "floor")


def advantages(rewards: torch.Tensor, prompt_keys, group_size: int, per_prompt: bool | None = None,
               global_std: bool = False, collapsed_std: float = 0.0, collapsed: str = "drop",
               clip: float = 5.0) -> torch.Tensor:
    """The run's advantages -> float32 [N] (config.py: per_prompt_stat_tracking, global_std,
    collapsed_std, collapsed_groups, adv_clip); rewards [N] are whole groups, members contiguous.

    per_prompt None: per group (group_advantages; a fragment is self-contained). True / False:
    Flow-GRPO's over the whole batch (batch_advantages: per prompt, or one mean and std).
    The guard for collapsed groups (a group, or with per_prompt a prompt, whose rewards' population
    std is <= collapsed_std): "drop" sets their advantages to 0, so the policy gradient ignores them
    (at collapsed_std 0 this is Flow-GRPO's train_sd3.py, which drops the samples whose advantages
    are all zero: prompts whose rewards are all equal); "floor" divides by max(std, collapsed_std)
    instead, keeping their advantages at the scale of their spread."""
    if collapsed not in COLLAPSED_ACTIONS:
        raise ValueError(f"collapsed {collapsed!r} is not one of {', '.join(COLLAPSED_ACTIONS)}")
    floor = collapsed_std if collapsed == "floor" else 0.0
    if per_prompt is None:
        adv = group_advantages(rewards, group_size, clip=clip, std_floor=floor)
        keys = torch.arange(rewards.numel()) // group_size  # the statistics' unit: the group
    else:
        adv = batch_advantages(rewards, prompt_keys, global_std=global_std, per_prompt=per_prompt,
                               std_floor=floor, clip=clip)
        keys = prompt_keys if per_prompt else torch.zeros(rewards.numel(), dtype=torch.long)
    if collapsed == "drop":
        adv = torch.where(collapsed_prompts(rewards, keys, min_std=collapsed_std), 0.0, adv)
    return adv


# === Flow-GRPO's several updates per batch (M minibatches, an optimizer update after each) =======
# The schedules over a step's fragments (fragment.Fragment): which rows each update trains, in what
# order; the trainer rank's loop (main.TrainerRank.train_batch) calls them.
# --- several updates per batch: minibatches of whole groups, fixed before the batch is generated --
def minibatch_bounds(groups_per_step: int, updates: int) -> list[tuple[int, int]]:
    """Update j of a step trains groups [lo_j, hi_j): M contiguous ranges of the batch's groups,
    sizes within one group of each other (lo_j = j B // M). The step's prompts are a seeded
    permutation (fragment_spec), so a range is a random subset of prompts."""
    if not 1 <= updates <= groups_per_step:
        raise ValueError(f"--updates-per-batch {updates} must be between 1 and the "
                         f"{groups_per_step} groups of a step (a minibatch is whole groups)")
    cuts = [j * groups_per_step // updates for j in range(updates + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def minibatch_pairs(bounds: list[tuple[int, int]], group_size: int, num_train_timesteps: int,
                    fragment: Fragment) -> int:
    """N_j T_train: the pairs of the minibatch `fragment` (a part of one) lies in; each update's
    loss is its minibatch's mean, as Flow-GRPO's (with M = 1, the batch's N T_train)."""
    if fragment.minibatch_samples:  # rows of a sample minibatch (train_by_samples)
        return fragment.minibatch_samples * num_train_timesteps
    lo, hi = next(b for b in bounds if b[0] <= fragment.first_group < b[1])
    return (hi - lo) * group_size * num_train_timesteps


# --- Flow-GRPO's minibatches: the step's samples permuted, zero advantages dropped ----------------
def minibatch_seed(seed: int, step: int) -> int:
    """The generator seed of a step's sample minibatches: every trainer draws the same ones."""
    return (seed * 1_000_003 + step) * 1_000_033 + 999_983


def sample_minibatches(total: int, updates: int, seed: int,
                       keep: torch.Tensor | None = None) -> list[list[int]]:
    """Flow-GRPO's minibatches (scripts/train_sd3.py lines 796-840) of a step's `total` samples:
    M = `updates` lists of sample indices (in the batch), from a torch.Generator seeded `seed`.
    keep [total] bool (train_sd3.py's mask: advantage != 0; None = every sample): as it does,
    if the kept count is not a multiple of M, M - count % M dropped samples chosen at random are put
    back (when there are that many; its unit is num_batches_per_epoch per GPU, here M for the
    batch); then the kept samples are permuted and cut into M consecutive parts (sizes within one
    when M does not divide them, where its reshape would fail)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(total, dtype=torch.bool) if keep is None else keep.clone().bool()
    kept = int(mask.sum())
    if kept % updates:  # lines 801-808: make the count divisible
        false_indices = torch.where(~mask)[0]
        num_to_change = updates - kept % updates
        if len(false_indices) >= num_to_change:
            chosen = torch.randperm(len(false_indices), generator=gen)[:num_to_change]
            mask[false_indices[chosen]] = True
    indices = torch.where(mask)[0]  # line 817: samples[mask], in batch order
    perm = torch.randperm(len(indices), generator=gen)  # line 829
    order = indices[perm].tolist()
    cuts = [j * len(order) // updates for j in range(updates + 1)]  # lines 833-836
    return [order[cuts[j]:cuts[j + 1]] for j in range(updates)]


def rows_in(fragment: Fragment, members: dict[int, int], j: int, size: int) -> Fragment | None:
    """The rows of `fragment` whose batch index `members` puts in minibatch j (of `size` samples),
    as a fragment marked with its minibatch's size (minibatch_samples); None when it has none."""
    start = fragment.first_sample
    rows = [r for r in range(fragment.num_samples) if members.get(start + r) == j]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long)
    part = Fragment.from_parts(fragment.ints(),
                               {k: v[index.to(v.device)] for k, v in fragment.tensors().items()})
    part.opens_fragment, part.minibatch_samples = False, size
    return part


def train_by_samples(fragments: list[Fragment], minibatches: list[list[int]],
                     train: Callable[[Fragment], None], update: Callable[[int], object],
                     count: Callable[[Fragment], None]) -> None:
    """Train a step's fragments (all of this rank's, in hand) in Flow-GRPO's sample minibatches
    (sample_minibatches, the same on every trainer): each whole fragment counted once, then for each
    minibatch j the rows of every fragment in it, and an update after each but the last (the
    caller's optimizer step ends the RL step). A dropped sample is in no minibatch: never
    trained."""
    members = {i: j for j, indices in enumerate(minibatches) for i in indices}
    for fragment in fragments:
        count(fragment)
    for j, indices in enumerate(minibatches):
        for fragment in fragments:
            part = rows_in(fragment, members, j, len(indices))
            if part is not None:
                train(part)
        if j < len(minibatches) - 1:
            update(j)


def groups_of(fragment: Fragment, lo: int, hi: int) -> Fragment:
    """The part of `fragment` in groups [lo, hi) of its step (the fragment itself when wholly
    inside)."""
    first, g = fragment.first_group, fragment.group_size
    a, b = max(lo, first), min(hi, first + fragment.num_groups)
    if (a, b) == (first, first + fragment.num_groups):
        return fragment
    rows = slice((a - first) * g, (b - first) * g)  # samples of the groups, batch first
    ints = fragment.ints()
    ints[1] = a
    part = Fragment.from_parts(ints, {k: v[rows] for k, v in fragment.tensors().items()})
    part.opens_fragment = fragment.opens_fragment and a == first  # a fragment is counted once
    return part


def train_in_minibatches(items: Iterable[Fragment | Announcement], bounds: list[tuple[int, int]],
                         train: Callable[[Fragment], None],
                         update: Callable[[int], object]) -> None:
    """Train a step's fragments in M minibatches with one update after each but the last (the
    caller's optimizer step ends the RL step). A part of minibatch j is trained as it arrives once
    updates 0..j-1 are done, else held; update j runs once every group of minibatch j is in. `items`
    are this rank's fragments and, for the groups it does not train itself, their ranges (an
    Announcement): every rank then sees the same boundaries, and the update is the full-batch
    computation's whatever the arrival order. Deadlock-free with point-to-point sends: each producer
    claims, and sends, in group order."""
    held: list[list[Fragment]] = [[] for _ in bounds]
    covered, current = [0] * len(bounds), 0
    for item in items:
        first = item.first_group
        for j, (lo, hi) in enumerate(bounds):
            overlap = min(hi, first + item.num_groups) - max(lo, first)
            if overlap <= 0:
                continue
            if j < current:
                raise AssertionError(f"groups of minibatch {j} arrived after its update")
            covered[j] += overlap
            if isinstance(item, Fragment):
                part = groups_of(item, lo, hi)
                train(part) if j == current else held[j].append(part)
        while (current < len(bounds) - 1
                and covered[current] == bounds[current][1] - bounds[current][0]):
            update(current)
            current += 1
            for part in held[current]:
                train(part)
    if current != len(bounds) - 1 or covered[-1] != bounds[-1][1] - bounds[-1][0]:
        raise AssertionError(f"a step ended with groups missing: covered {covered} of {bounds}")


# --- the colocated baseline's static shares -----------------------------------------------------
def static_claims(bounds: list[tuple[int, int]], rank: int, world: int) -> list[tuple[int, int]]:
    """A colocated rank's fixed share of a step: a contiguous 1/world of every minibatch
    (`bounds`), so every rank trains in every update, as each Flow-GRPO GPU splits its own samples
    into the M minibatches. One (first_group, num_groups) range per minibatch, empty ones left
    out."""
    starts = [[lo + (hi - lo) * r // world for r in (rank, rank + 1)] for lo, hi in bounds]
    return [(start, end - start) for start, end in starts if end > start]


def generation_batches(ranges: list[tuple[int, int]], fragment_groups: int
                       ) -> list[list[tuple[int, int]]]:
    """A rank's ranges cut into generation calls of fragment_groups groups (the last maybe fewer),
    in order: a call may join pieces of several minibatches, as Flow-GRPO samples
    sample.batch_size at a time whatever the minibatches."""
    batches, room = [[]], fragment_groups
    for first, count in ranges:
        while count:
            if room == 0:
                batches.append([])
                room = fragment_groups
            take = min(room, count)
            batches[-1].append((first, take))
            first, count, room = first + take, count - take, room - take
    return [b for b in batches if b]
