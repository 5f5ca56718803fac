"""The colocated baseline (Flow-GRPO / veRL-Omni style): every rank generates its share of the
batch, then every rank trains it, one update per minibatch, gradients summed over all ranks.

    python main.py --mode colocated --nproc 2

No queue and no pipeline. A rank's share is static: a contiguous 1/P of every minibatch
(grpo.minibatch_bounds), so every rank trains in every update, as each Flow-GRPO GPU splits its
own samples into the M minibatches. It is generated `fragment_groups` groups per call (Flow-GRPO's
sample.batch_size); a call may join pieces of two minibatches, and its rows are cut back into one
fragment per range (`split_rows`). Training is the trainer rank's step (trainer.TrainerSide): the
other
ranks' ranges come in as announcements, so every rank sees the same minibatch boundaries and the
update is the full-batch one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gap import Announcement, Fragment, FragmentSpec
from trainer import TrainerSide

Ranges = list[tuple[int, int]]  # (first_group, num_groups) ranges of one step


def static_claims(bounds: Ranges, rank: int, world: int, step: int) -> Ranges:
    """A rank's fixed share of a step: a contiguous 1/world of every minibatch (`bounds`), so
    every rank trains in every update. One range per minibatch, empty ones left out."""
    starts = [[lo + (hi - lo) * r // world for r in (rank, rank + 1)] for lo, hi in bounds]
    return [(start, end - start) for start, end in starts if end > start]


def generation_batches(ranges: Ranges, fragment_groups: int) -> list[Ranges]:
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


def joined_specs(specs: list[FragmentSpec]) -> FragmentSpec:
    """Several ranges of one step as one generation call, rows in order (split back: split_rows)."""
    return dataclasses.replace(specs[0], **{k: [x for s in specs for x in getattr(s, k)]
                                            for k in ("prompt_ids", "init_seeds", "noise_seeds")})


def split_rows(fragment: Fragment, ranges: Ranges) -> list[Fragment]:
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


def loop(side: TrainerSide, steps: range, claims: Callable[[int, int, int], Ranges], rank: int,
         world: int, generate: Callable[[int, Ranges, int], list[Fragment]],
         fragment_groups: int) -> None:
    """A colocated rank: per step, generate its share (claims(rank, world, step)) fragment_groups
    groups per call (`generate` returns one fragment per range of its call), then train it, one
    update per minibatch; the other ranks' shares only mark their groups as in."""
    for step in steps:
        fragments = [f for ranges in generation_batches(claims(rank, world, step), fragment_groups)
                     for f in generate(step, ranges, side.version())]
        others = [Announcement(-1, first, count, -1) for other in range(world) if other != rank
                  for first, count in claims(other, world, step)]
        side.end_step(step, side.train_step(step, [*fragments, *others]))
