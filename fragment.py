"""The fragment: a range of whole GRPO groups of one RL step, its seeds, its tensors.

It is what the mechanisms pass around, none of them importing it (each mechanism file imports only
torch): GAP's queue (gap.py) hands out ranges of groups, TSP (tsp.py) packs a fragment's (sample,
timestep) pairs, TAG (tag.py) has the trainers generate a range, TCSS (async_policy.py) checks the
weights version that generated it.

    fragment_spec(seed, step, first_group, num_groups, ...)  # what to generate: prompts, seeds
    Fragment(...)                            # what was generated: everything the trainer needs
    concat_fragments(parts)                  # consecutive ranges joined back into one

A trajectory's prompt and noise seeds depend only on (seed, step, its global index in the batch)
(`fragment_spec`), so a range yields the same trajectories whichever rank generates it and however
the batch is cut: GAP's and TAG's invariant (the update equals the full-batch one) rests on this.
The wire format that carries a Fragment between ranks is transport.py's; rollout.py fills one.
"""
from __future__ import annotations

import dataclasses

import torch


def fragment_spec(seed: int, step: int, first_group: int, num_groups: int, num_prompts_total: int,
                  groups_per_step: int, group_size: int,
                  shared_group_noise: bool = False) -> FragmentSpec:
    """Groups [first_group, first_group + num_groups) of step `step`: prompts and seeds depend only
    on (seed, step, global trajectory index), so any cut of the batch gives the same
    trajectories."""
    # The step's prompts: a seeded permutation, so every rank agrees without communication.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    order = torch.randperm(max(num_prompts_total, groups_per_step),
                           generator=gen) % num_prompts_total
    groups = order[:groups_per_step][first_group:first_group + num_groups].tolist()
    prompt_ids = [p for p in groups for _ in range(group_size)]
    base = (seed * 1_000_003 + step) * 1_000_033
    first = first_group * group_size  # global index of the fragment's first trajectory in the batch
    trajectories = range(first, first + len(prompt_ids))
    noise_seeds = [base + 2 * t + 1 for t in trajectories]
    if shared_group_noise:  # DanceGRPO: every member of a group starts from the same noise
        init_seeds = [base + 2 * (t // group_size * group_size) for t in trajectories]
    else:
        init_seeds = [base + 2 * t for t in trajectories]
    return FragmentSpec(step, first_group, prompt_ids, init_seeds, noise_seeds, group_size)


SEED_BOUND = 2**63  # derived seeds stay int64 (manual_seed overflows past 2**64 - 1)


def largest_seed(steps: int, trajectories_per_step: int) -> int:
    """The largest run seed whose derived seeds all stay below SEED_BOUND: fragment_spec's
    base + 2 t + 1 at the last step and trajectory, plus rollout.train_slots' + 7."""
    # the bound on seed * 1_000_003 + step, then on seed
    base_limit = (SEED_BOUND - 1 - 2 * trajectories_per_step - 8) // 1_000_033
    return (base_limit - steps) // 1_000_003


@dataclasses.dataclass
class FragmentSpec:
    """What to generate: groups [first_group, first_group + num_groups) of RL step `step`."""

    step: int
    first_group: int
    prompt_ids: list[int]  # one per trajectory (members of a group are contiguous)
    init_seeds: list[int]  # initial-noise seed per trajectory (shared within a group for DanceGRPO)
    noise_seeds: list[int]  # per-step noise seed per trajectory
    group_size: int
    offset: int = 0  # a part of a group (rollout.part_spec): its first trajectory's member index

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids) // self.group_size


@dataclasses.dataclass
class Fragment:
    """The wire format: everything the trainer needs to train m trajectories (whole groups)."""

    step: int
    # the fragment's groups are [first_group, first_group + num_groups) of its step
    first_group: int
    policy_version: int  # the weights version that generated every trajectory of this fragment
    producer: int  # rank that generated it (a negative value marks a trainer-assisted fragment)
    group_size: int
    prompt_ids: torch.Tensor  # [m] int64
    cond: dict[str, torch.Tensor]  # prompt embeddings, batch first [m, ...]
    latents: torch.Tensor  # [m, T_train, *latent] x at each trained timestep
    # [m, T_train, *latent] x at the following timestep (the scored sample)
    next_latents: torch.Tensor
    timestep_index: torch.Tensor  # [m, T_train] int64 position in the sampling schedule
    sigmas: torch.Tensor  # [m, T_train]
    sigmas_next: torch.Tensor  # [m, T_train]
    log_probs: torch.Tensor  # [m, T_train] behaviour log-probs recorded at rollout
    rewards: torch.Tensor  # [m] the combined reward
    reward_parts: torch.Tensor  # [m, n_rewards] each named reward (for metrics)
    advantages: torch.Tensor  # [m]
    # > 0: a part of a group (one trainer's share of a TAG claim, split by trajectories): the first
    # trajectory is member `offset` of first_group; no advantages until the shares are joined
    offset: int = 0
    # False for a later part of a fragment split at a minibatch boundary
    opens_fragment: bool = True
    # > 0: this fragment's rows in one of Flow-GRPO's sample minibatches (grpo.sample_minibatches),
    # which holds that many samples: its pairs weigh 1/(minibatch_samples T_train), and its rewards
    # are counted with its whole fragment (grpo.train_by_samples); not on the wire
    minibatch_samples: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    @property
    def first_sample(self) -> int:
        """The first trajectory's index in its step's batch."""
        return self.first_group * self.group_size + self.offset

    @property
    def is_whole(self) -> bool:
        """Whole groups (a rollout fragment, a joined TAG claim), not a part of one."""
        return self.offset == 0 and self.num_samples % self.group_size == 0

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        out.update({f"cond.{k}": v for k, v in sorted(self.cond.items())})
        return out

    def to(self, device) -> "Fragment":
        moved = Fragment.from_parts(self.ints(),
                                    {k: v.to(device) for k, v in self.tensors().items()})
        moved.opens_fragment, moved.minibatch_samples = self.opens_fragment, self.minibatch_samples
        return moved

    def ints(self) -> list[int]:
        """The header fields, in the order from_parts (and the wire format, transport.py) reads
        them."""
        return [self.step, self.first_group, self.policy_version, self.producer, self.group_size,
                self.offset]

    @staticmethod
    def from_parts(ints: list[int], tensors: dict[str, torch.Tensor]) -> "Fragment":
        cond = {k[len("cond."):]: v for k, v in tensors.items() if k.startswith("cond.")}
        plain = {k: v for k, v in tensors.items() if not k.startswith("cond.")}
        step, first_group, version, producer, group_size, offset = ints
        return Fragment(step=step, first_group=first_group, policy_version=version,
                        producer=producer, group_size=group_size, cond=cond, offset=offset,
                        **plain)


def concat_fragments(parts: list[Fragment]) -> Fragment:
    """Join sub-fragments of consecutive trajectories (in batch order) back into one fragment."""
    tensors = [p.tensors() for p in parts]
    joined = {k: torch.cat([t[k] for t in tensors]) for k in tensors[0]}
    return Fragment.from_parts(parts[0].ints(), joined)

