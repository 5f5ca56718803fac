"""TAG, trainer-assisted generation: an idle trainer group generates groups itself, when that ends the step sooner.

Paper: DigenRL, "elastic trainer-assisted generation" (docs/DESIGN.md section 5). At the head of a step
the trainers have nothing to train until the first fragment arrives, and at its tail they wait for
the last one. When the trainer group has nothing to train, its leader may claim some unclaimed
groups of the *current* batch from the fragment queue (gap.py) and the group generates them with its
own current weights: exactly the current policy, so no weight sync and the groups are on-policy.
Reward, advantages and training then follow the normal path. The leader also decides once right
before it publishes new weights, for the next batch: that is the moment the rollout ranks are about
to claim everything, so a share taken then is what lets TAG act next to TCSS.

Invariant: TAG changes who generates, never what: a trajectory depends only on (seed, step, its index
in the batch), so the update with TAG on equals the update with it off (allclose in float32).
Generation runs under no_grad and never calls the optimizer or touches accumulated gradients.

The decision (`groups_to_assist`) is a makespan prediction from running estimates (generation time of
a fragment on a rollout rank and of a group on the trainer group, training time of a group) and the
groups unclaimed, in flight and waiting: it simulates the rest of the step for each share the
trainers could take (0, unit, 2 unit, ...) and takes the one that ends the step soonest. When
training is the bottleneck it declines (the trainers would only delay work about to arrive); when
generation is, it takes a share.

Departures from the paper: claims are whole groups (the unit of a fragment), not single samples;
in-flight fragments are assumed half done (ranks do not report progress).

Try it: `python main.py --placement disaggregated --gap --tsp --tag` (logs `tag_fragments` per step).
Only the standard library and torch are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import time
from collections.abc import Callable

TAG_PRODUCER = -2  # Fragment.producer of a trainer-assisted fragment


# --- the makespan predictor ---------------------------------------------------------------------
@dataclasses.dataclass
class StepState:
    """What the trainer leader knows about the rest of the current step, in groups and seconds."""

    unclaimed: int  # groups nobody has claimed yet
    in_flight: int  # groups claimed by rollout ranks, not yet announced
    waiting: int  # groups announced, not yet trained
    rollout_ranks: int
    gen_rollout_s: float  # one fragment of `fragment_groups` groups on one rollout rank
    gen_trainer_s: float  # one group on one trainer
    train_s: float  # one group on the trainer group
    fragment_groups: int = 1  # groups a rollout rank claims at a time
    trainers: int = 1  # the trainer group generates a TAG share split over its K ranks
    unit: int = 1  # TAG claims a multiple of this (K under FSDP: every trainer generates a group)


def predict_step_end(state: StepState, assist: int = 0) -> float:
    """Seconds from now until the trainer group has trained every remaining group, if it generates
    `assist` groups itself as soon as it has nothing else to do."""
    per_group = state.gen_rollout_s / max(state.fragment_groups, 1)
    free_at = [0.0] * max(state.rollout_ranks, 1)
    arrivals = [(0.0, state.waiting)] if state.waiting else []
    left, i = state.in_flight, 0
    while left > 0:  # in-flight fragments are assumed half done
        g = min(state.fragment_groups, left)
        left, r = left - g, i % len(free_at)
        free_at[r] += 0.5 * per_group * g
        arrivals.append((free_at[r], g))
        i += 1
    heapq.heapify(free_at)
    left = state.unclaimed - assist
    while left > 0:  # the queue is pull-based: each rank takes the next fragment as soon as it is free
        g = min(state.fragment_groups, left)
        left -= g
        done = heapq.heappop(free_at) + per_group * g
        heapq.heappush(free_at, done)
        arrivals.append((done, g))
    arrivals.sort()
    clock, i, tag_left = 0.0, 0, assist
    while i < len(arrivals) or tag_left:  # the leader trains what has arrived first, else generates
        if i < len(arrivals) and arrivals[i][0] <= clock:
            clock += arrivals[i][1] * state.train_s
            i += 1
        elif tag_left:
            clock += math.ceil(tag_left / max(state.trainers, 1)) * state.gen_trainer_s + tag_left * state.train_s
            tag_left = 0
        else:
            clock = arrivals[i][0]
    return clock


def groups_to_assist(state: StepState, margin_s: float = 0.0) -> int:
    """How many groups the trainer group should generate now: the share with the earliest predicted
    end, if it beats not assisting by more than `margin_s`; else 0."""
    unit = max(state.unit, 1)
    shares = range(unit, state.unclaimed - state.unclaimed % unit + 1, unit)
    if not shares:
        return 0
    best = min(shares, key=lambda n: (predict_step_end(state, n), n))
    return best if predict_step_end(state, best) + margin_s < predict_step_end(state, 0) else 0


def should_assist(state: StepState, margin_s: float = 0.0) -> bool:
    return groups_to_assist(state, margin_s) > 0


class RunningMean:
    """Exponential moving average of a duration; `value` is None before any sample."""

    def __init__(self, weight: float = 0.5):
        self.weight, self.value = weight, None

    def update(self, seconds: float) -> None:
        self.value = seconds if self.value is None else (1 - self.weight) * self.value + self.weight * seconds


def split_groups(num_groups: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous share [start, end) of `num_groups` groups that trainer `rank` of `world` generates."""
    return num_groups * rank // world, num_groups * (rank + 1) // world


# --- the protocol ---------------------------------------------------------------------------------
class Assistant:
    """TAG's state on the trainer leader: estimates, claims not yet generated, and the decision.

    The queue is reached through callables (claim, counts) so the file stays self-contained:
      claim(step, n) -> (first_group, count) | None; claimed(step), announced_groups(step) -> int;
      rollout_gen_s() -> seconds per fragment of fragment_groups groups on a rollout rank, or None."""

    def __init__(self, groups_per_step: int, fragment_groups: int, rollout_ranks: int, trainers: int, unit: int,
                 claim: Callable, claimed: Callable, announced_groups: Callable, rollout_gen_s: Callable,
                 poll_s: float = 0.001):
        self.groups_per_step, self.fragment_groups, self.rollout_ranks = groups_per_step, fragment_groups, rollout_ranks
        self.trainers, self.unit, self.poll_s = trainers, unit, poll_s
        self.claim, self.claimed, self.announced_groups, self.rollout_gen_s = claim, claimed, announced_groups, rollout_gen_s
        self.gen_trainer, self.train = RunningMean(), RunningMean()  # seconds per group
        self.pending = collections.defaultdict(list)  # step -> [(first_group, count)] claimed, not generated
        self.taken = collections.Counter()  # step -> groups TAG claimed
        self.generated = collections.Counter()  # step -> groups TAG generated

    def state(self, step: int, groups_done: int) -> StepState | None:
        gen_rollout = self.rollout_gen_s()
        if gen_rollout is None or self.train.value is None:
            return None  # no estimates yet: the first fragments measure them
        claimed, announced = self.claimed(step), self.announced_groups(step)
        return StepState(
            unclaimed=self.groups_per_step - claimed,
            in_flight=max(claimed - announced - self.taken[step], 0),
            waiting=max(announced - (groups_done - self.generated[step]), 0),
            rollout_ranks=self.rollout_ranks, fragment_groups=self.fragment_groups, gen_rollout_s=gen_rollout,
            gen_trainer_s=self.gen_trainer.value if self.gen_trainer.value is not None
            else gen_rollout / self.fragment_groups,  # unmeasured: assume the trainer GPU generates like a rollout one
            train_s=self.train.value, trainers=self.trainers, unit=self.unit)

    def consider(self, step: int, groups_done: int) -> bool:
        """Claim the predictor's share of `step` for the trainer group; True if it claimed anything."""
        state = self.state(step, groups_done)
        n = groups_to_assist(state) if state is not None else 0
        claimed = self.claim(step, n) if n else None
        if claimed is None:
            return False
        self.pending[step].append(claimed)
        self.taken[step] += claimed[1]
        return True

    def next_command(self, step: int, poll: Callable[[int], bool], train_cmd: int, generate_cmd: int):
        """The leader's decision for tsp.lockstep_fragments: train what has arrived, else generate claimed
        groups, else claim a share if the predictor says so, else wait."""
        def next_command(next_seq: int, groups_done: int):
            while True:
                if poll(next_seq):
                    return train_cmd, next_seq, 0
                if self.pending[step] or self.consider(step, groups_done):
                    first, count = self.pending[step].pop(0)
                    return generate_cmd, first, count
                time.sleep(self.poll_s)
        return next_command

    def generated_groups(self, step: int, groups: int, seconds: float) -> None:
        self.generated[step] += groups
        self.gen_trainer.update(seconds / max(math.ceil(groups / self.trainers), 1))  # per group on one trainer

    def trained_groups(self, groups: int, seconds: float) -> None:
        self.train.update(seconds / max(groups, 1))

    def forget(self, step: int) -> None:
        for table in (self.pending, self.taken, self.generated):
            table.pop(step, None)


def assisted_generation(first_group: int, num_groups: int, trainers: int, me: int, generate: Callable,
                        share: Callable, concat: Callable):
    """Every trainer generates its contiguous share of the groups at the same time (under FSDP their
    forwards must run together), then the shares are exchanged: share(part | None, owner) returns owner's
    part on every trainer. Returns the whole fragment on every trainer."""
    lo, hi = split_groups(num_groups, trainers, me)
    mine = generate(first_group + lo, hi - lo) if hi > lo else None
    owners = [r for r in range(trainers) if split_groups(num_groups, trainers, r)[1] > split_groups(num_groups, trainers, r)[0]]
    return concat([share(mine if r == me else None, r) for r in owners])
