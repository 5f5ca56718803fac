"""Rollout: what a generator is. One fragment (whole groups) -> SDE sampling, behaviour log-probs,
decode, reward, advantages (per group; flowgrpo/batch_rewards.py restates them for batch
statistics); and deterministic evaluation.

`generate_fragment` is the one generation path, used by rollout ranks, by colocated ranks and by an
idle trainer under TAG, so every producer makes the same trajectories from the same FragmentSpec.
It is `generate_trajectories` (sample, decode, score) then `with_advantages` (per group): under TAG
several trainers generate parts of one group (`part_spec`); advantages wait for the joined parts.
The rollout rank's loop (claim, generate, announce, send) is main.rollout_loop; which weights
generate and when new ones come in is async_policy.RolloutWeights (main.py plugs both in).
"""
from __future__ import annotations

import dataclasses

import torch

import grpo
from fragment import Fragment, FragmentSpec


@dataclasses.dataclass
class SamplingConfig:
    num_steps: int = 6  # T
    noise_level: float = 0.7  # Flow-GRPO's a (or DanceGRPO's eta)
    timestep_fraction: float = 0.99  # trained share of the T steps: see num_train_timesteps
    algo: str = "flow_grpo"  # or "dance_grpo"
    adv_clip: float = 5.0
    collapsed_std: float = 0.0  # the guard for collapsed groups (grpo.advantages)
    collapsed_groups: str = "drop"
    # trajectories per forward batch (and per VAE decode and reward call); 0 = a whole call at once
    batch_size: int = 0

    @staticmethod
    def of(cfg) -> "SamplingConfig":
        """From the run's config.Config."""
        return SamplingConfig(num_steps=cfg.num_steps, noise_level=cfg.noise_level,
                              timestep_fraction=cfg.timestep_fraction, algo=cfg.algo,
                              adv_clip=cfg.adv_clip, collapsed_std=cfg.collapsed_std,
                              collapsed_groups=cfg.collapsed_groups,
                              batch_size=cfg.sample_batch_size)


def step_fn(algo: str):
    return grpo.dance_sde_step_with_logprob if algo == "dance_grpo" else grpo.sde_step_with_logprob


def num_train_timesteps(cfg: SamplingConfig) -> int:
    """T_train, by each reference's own formula; a fraction that gives 0 steps is a ValueError.

    Flow-GRPO (scripts/train_flux.py): int(T * timestep_fraction); its configs use 0.99, i.e. all
    but the last step. DanceGRPO (train_grpo_flux.py): int((T - 1) * timestep_fraction), since it
    never trains the last step.
    """
    trainable = cfg.num_steps - 1 if cfg.algo == "dance_grpo" else cfg.num_steps
    t_train = int(trainable * cfg.timestep_fraction)
    if t_train < 1:
        raise ValueError(f"--timestep-fraction {cfg.timestep_fraction} with --num-steps "
                         f"{cfg.num_steps} trains no step ({cfg.algo}: int({trainable} * "
                         f"{cfg.timestep_fraction}) = 0); raise either")
    return t_train


def train_slots(cfg: SamplingConfig, noise_seed: int) -> list[int]:
    """Which sampling steps of one trajectory are trained (sorted; step 0 is the first, pure-noise
    step)."""
    t_train = num_train_timesteps(cfg)
    # a random per-sample subset of steps 0..T-2, reproducible from the seed
    if cfg.algo == "dance_grpo":
        gen = torch.Generator().manual_seed(noise_seed + 7)
        return sorted(torch.randperm(cfg.num_steps - 1, generator=gen)[:t_train].tolist())
    return list(range(t_train))  # Flow-GRPO: the first T_train (high-noise) steps, 0..T_train-1


def batch_sizes(m: int, batch_size: int, calls: int = 0) -> list[int]:
    """How m trajectories are cut into forward batches: ceil(m / batch_size) batches of near-equal
    size (each <= batch_size; batch_size 0: one), and at least `calls` of them (FSDP's lockstep:
    every trainer must run the same number of forward calls, whatever its share). A 0 is a padding
    batch: the caller runs one trajectory again and drops it, as a TSP padding pair."""
    n = max(1 if batch_size <= 0 else -(-m // batch_size), calls, 1)
    base, extra = divmod(m, n)
    return [base + 1] * extra + [base] * (n - extra)


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive batches of these sizes."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(end - size, end) for size, end in zip(sizes, ends)]


@torch.no_grad()
def sample_trajectories(policy, cond, init_seeds, noise_seeds, cfg: SamplingConfig,
                        keep: list[list[int]] | None = None, transformer=None, calls: int = 0):
    """SDE sampling of len(seeds) trajectories, `cfg.batch_size` per forward batch
    (batch_sizes; `calls`: at least that many forward batches, FSDP's lockstep).

    Returns final latents [m, ...] and, for each trajectory's `keep` slots, (x_t, x_t+1, logp_t)
    stacked as [m, T_train, ...]. Noise comes from per-trajectory CPU generators, so a trajectory is
    the same in any batch and on any rank: cutting the call into batches changes nothing but the
    batch the transformer sees (allclose in float32, tests/test_sampling_batches.py).
    """
    m, out = len(init_seeds), []
    for a, b in _bounds(batch_sizes(m, cfg.batch_size, calls)):
        rows = list(range(a, b)) if b > a else [0]  # padding batch: trajectory 0 again, dropped
        part = _sample_batch(policy, {k: v[rows] for k, v in cond.items()},
                             [init_seeds[i] for i in rows], [noise_seeds[i] for i in rows], cfg,
                             None if keep is None else [keep[i] for i in rows], transformer)
        if b > a:
            out.append(part)
    final = torch.cat([x for x, _ in out])  # [m, ...]
    if keep is None:
        return final, None
    kept = [torch.cat([k[i] for _, k in out]) for i in range(4)]  # x_t, x_next, logp, index
    return final, (*kept, out[0][1][4])


def _sample_batch(policy, cond, init_seeds, noise_seeds, cfg: SamplingConfig, keep, transformer):
    """One forward batch of sample_trajectories: the T steps of len(seeds) trajectories."""
    m = len(init_seeds)
    x = torch.stack([policy.noise(torch.Generator().manual_seed(s))
                     for s in init_seeds]).to(policy.device)  # [m, ...]
    generators = [torch.Generator().manual_seed(s) for s in noise_seeds]
    sigmas = policy.sigmas(cfg.num_steps).to(policy.device)  # [T + 1]
    step = step_fn(cfg.algo)
    kept_x, kept_next, kept_logp = {}, {}, {}
    wanted = set(t for slots in (keep or []) for t in slots)
    for t in range(cfg.num_steps):
        sigma = sigmas[t].expand(m)  # [m]
        v = policy.velocity(x, sigma, cond, transformer)  # [m, ...] float32
        noise = torch.stack(
            [torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)  # [m, ...]
        x_next, logp, _, _ = step(v, x, sigma, sigmas[t + 1].expand(m), cfg.noise_level,
                                  noise=noise)
        if t in wanted:
            kept_x[t], kept_next[t], kept_logp[t] = x, x_next, logp
        x = x_next
    if keep is None:
        return x, None
    timestep_index = torch.tensor(keep, dtype=torch.long)  # [m, T_train]
    # [m, T_train, ...] each
    kept = [_per_trajectory(store, keep) for store in (kept_x, kept_next, kept_logp)]
    return x, (*kept, timestep_index, sigmas.cpu())


def _per_trajectory(by_step: dict[int, torch.Tensor], keep: list[list[int]]) -> torch.Tensor:
    """[m, T_train, ...]: trajectory i's values at its own kept steps keep[i] (by_step:
    step -> [m, ...])."""
    return torch.stack([torch.stack([by_step[t][i] for t in slots])
                        for i, slots in enumerate(keep)])


def generate_fragment(policy, spec: FragmentSpec, prompts: list[str], cfg: SamplingConfig,
                      reward_fn, version: int, producer: int, transformer=None,
                      calls: int = 0) -> Fragment:
    """Generate, score and package one fragment of whole groups (see module docstring)."""
    fragment = generate_trajectories(policy, spec, prompts, cfg, reward_fn, version, producer,
                                     transformer, calls)
    return with_advantages(fragment, cfg)


def generate_trajectories(policy, spec: FragmentSpec, prompts: list[str], cfg: SamplingConfig,
                          reward_fn, version: int, producer: int, transformer=None,
                          calls: int = 0) -> Fragment:
    """Generate and score the spec's trajectories, maybe part of a group (TAG by trajectories:
    `part_spec`), `cfg.batch_size` per forward, VAE decode and reward call (a whole fragment
    decoded at once took 36 GiB for 24 FLUX images at 1024 px); `calls`: at least that many forward
    batches (FSDP's lockstep). Advantages are NaN: they need the whole group (`with_advantages`,
    once joined)."""
    prompt_text = [prompts[i] for i in spec.prompt_ids]
    cond = policy.encode_prompts(prompt_text)  # [m, ...]
    keep = [train_slots(cfg, s) for s in spec.noise_seeds]
    final, (x_t, x_next, logp, t_idx, sigmas) = sample_trajectories(
        policy, cond, spec.init_seeds, spec.noise_seeds, cfg, keep, transformer, calls)
    scores = decode_and_score(policy, final, prompt_text, cfg.batch_size, reward_fn,
                              prompt_ids=spec.prompt_ids)  # name -> [m]
    total = _host(scores["total"].to(torch.float32))
    # [m, n_rewards]
    parts = torch.stack([scores[k].to(torch.float32) for k in scores if k != "total"], dim=1)
    return Fragment(
        step=spec.step, first_group=spec.first_group, policy_version=version, producer=producer,
        group_size=spec.group_size, offset=spec.offset,
        prompt_ids=torch.tensor(spec.prompt_ids, dtype=torch.long),
        cond={k: _host(v) for k, v in cond.items()},
        latents=_host(x_t), next_latents=_host(x_next), timestep_index=t_idx,
        sigmas=sigmas[t_idx], sigmas_next=sigmas[t_idx + 1], log_probs=_host(logp),
        rewards=total, reward_parts=_host(parts), advantages=torch.full_like(total, float("nan")))


def decode_and_score(policy, final: torch.Tensor, prompts: list[str], batch_size: int, reward_fn,
                     **reward_kw) -> dict[str, torch.Tensor]:
    """Decode the final latents [m, ...] and score them `batch_size` at a time (0: all at once):
    name -> [m]. Keyword lists of m entries (prompt_ids, metadata) are cut with the images."""
    parts = []
    for a, b in _bounds(batch_sizes(final.shape[0], batch_size)):
        images = policy.decode(final[a:b])  # [b - a, 3, H, W] (video [b - a, F, 3, H, W]) in [0, 1]
        parts.append(reward_fn(images, prompts[a:b], **{k: v[a:b] for k, v in reward_kw.items()}))
        del images  # the next decode reuses its memory
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def with_advantages(fragment: Fragment, cfg: SamplingConfig) -> Fragment:
    """The fragment (whole groups) with its group advantages, from its rewards on the host: the same
    numbers whoever generated which trajectories of a group. Per group, so the fragment is
    self-contained (flowgrpo/batch_rewards.py restates batch statistics); collapsed groups
    guarded."""
    advantages = grpo.advantages(fragment.rewards, fragment.prompt_ids, fragment.group_size,
                                 collapsed_std=cfg.collapsed_std, collapsed=cfg.collapsed_groups,
                                 clip=cfg.adv_clip)  # [m]
    return dataclasses.replace(fragment, advantages=advantages)


def part_spec(spec: FragmentSpec, lo: int, hi: int) -> FragmentSpec:
    """Trajectories [lo, hi) of the spec (indices within it), each with the prompt and seeds it has
    in the whole: a part of a group is generated exactly as in one piece (fragment_spec's seeds,
    DanceGRPO's shared initial noise included). Its first_group and offset place its first
    trajectory in the batch: only the joined parts are whole groups."""
    g = spec.group_size
    return dataclasses.replace(spec, first_group=spec.first_group + lo // g, offset=lo % g,
                               prompt_ids=spec.prompt_ids[lo:hi],
                               init_seeds=spec.init_seeds[lo:hi],
                               noise_seeds=spec.noise_seeds[lo:hi])

def joined_specs(specs: list[FragmentSpec]) -> FragmentSpec:
    """Several ranges of one step as one generation call, rows in order (split back: split_rows);
    only a colocated rank's calls join ranges (Flow-GRPO samples sample.batch_size at a time
    whatever the minibatches)."""
    return dataclasses.replace(specs[0], **{k: [x for s in specs for x in getattr(s, k)]
                                            for k in ("prompt_ids", "init_seeds", "noise_seeds")})


def split_rows(fragment: Fragment, ranges: list[tuple[int, int]]) -> list[Fragment]:
    """A fragment generated for several ranges (rows in `ranges` order), cut into one per range."""
    parts, row = [], 0
    for first, count in ranges:
        rows = slice(row, row + count * fragment.group_size)
        ints = fragment.ints()
        ints[1] = first
        parts.append(Fragment.from_parts(ints, {k: v[rows] for k, v in fragment.tensors().items()}))
        row = rows.stop
    if row != fragment.num_samples:
        raise ValueError(f"ranges {ranges} hold {row} samples, the fragment {fragment.num_samples}")
    return parts



def _host(t: torch.Tensor) -> torch.Tensor:
    """Fragments travel and wait on the host."""
    return t.detach().to("cpu")


# Evaluation seeds sit far above the training ones (fragment.fragment_spec numbers them from (seed,
# step, index) upwards from 0), so evaluation never replays a trajectory the policy was trained on.
EVAL_SEED = 2**62


@torch.no_grad()
def evaluate(policy, prompts: list[str], cfg: SamplingConfig, reward_fn, seed: int = EVAL_SEED,
             seeds_per_prompt: int = 1, metadata: list[dict] | None = None):
    """Deterministic evaluation (noise level 0): every prompt from the same `seeds_per_prompt`
    initial noises (seed, seed + 1, ...). Returns (reward dict of [P S] tensors, images [P S, ...]),
    prompt-major. `metadata`: one dict per prompt (its dataset row), passed to the reward.

    Sharing the noises across prompts makes the comparison paired: a model that ignores the prompt
    draws the same image for every colour word, and the colour reward of one image summed over red,
    green and blue is exactly 0, so such a model scores 0 on the colour task up to the mean over
    seeds, not just on average."""
    samples = eval_samples(len(prompts), seeds_per_prompt, seed)
    scores, images = evaluate_samples(policy, prompts, metadata, samples, cfg, reward_fn,
                                      keep_image=lambda i: True)
    return scores, torch.stack([images[i] for i in range(len(samples))])


def eval_samples(num_prompts: int, seeds_per_prompt: int, seed: int = EVAL_SEED):
    """[(prompt index, noise seed)] of an evaluation, prompt-major: every prompt from the same
    `seeds_per_prompt` held-out noises seed, seed + 1, ..."""
    return [(p, seed + j) for p in range(num_prompts) for j in range(seeds_per_prompt)]


@torch.no_grad()
def evaluate_samples(policy, prompts: list[str], metadata: list[dict] | None,
                     samples: list[tuple[int, int]], cfg: SamplingConfig, reward_fn,
                     calls: int = 0, keep_image=lambda i: False):
    """Deterministic sampling (noise level 0) of `samples` [(prompt index, seed)], `cfg.batch_size`
    per forward, decode and reward call (`calls`: at least that many batches, FSDP's lockstep).
    Each sample is scored with its own prompt and, given `metadata` (one row per prompt), its own
    prompt's dataset row. Returns (reward dict of [n] tensors, {i: image} for keep_image(i)): the
    images of a large evaluation are never held together."""
    det = dataclasses.replace(cfg, noise_level=0.0)
    parts, images = [], {}
    if not samples and not calls:
        return {}, images
    for a, b in _bounds(batch_sizes(len(samples), cfg.batch_size, calls)):
        # a padding batch (FSDP's lockstep): one sample run, then dropped
        rows = samples[a:b] if b > a else (samples[:1] or [(0, EVAL_SEED)])
        texts = [prompts[p] for p, _ in rows]
        seeds = [s for _, s in rows]
        final, _ = sample_trajectories(policy, policy.encode_prompts(texts), seeds, seeds,
                                       dataclasses.replace(det, batch_size=0))
        if b == a:
            continue
        batch = policy.decode(final)  # [b - a, 3, H, W] (video [b - a, F, 3, H, W])
        rows_meta = None if metadata is None else [metadata[p] for p, _ in rows]
        parts.append(reward_fn(batch, texts) if rows_meta is None
                     else reward_fn(batch, texts, rows_meta))
        images.update({a + k: batch[k] for k in range(b - a) if keep_image(a + k)})
    if not parts:
        return {}, images
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}, images
