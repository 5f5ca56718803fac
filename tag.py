"""TAG, trainer-assisted generation: an idle trainer group generates fragments itself, when that ends the step sooner.

Paper: DigenRL, "elastic trainer-assisted generation" (DESIGN.md section 5). At the head of a step the
trainers have nothing to train until the first fragment arrives. When the trainer group is idle, its
leader may claim the next unclaimed fragment of the *current* batch from the fragment queue and the
group generates it with its own current weights: exactly the current policy, so no weight sync and
the fragment is on-policy. Reward, advantages and training then follow the normal path.

Invariant: TAG changes who generates, never what: a fragment's trajectories depend only on its
(seed, step, index), so the update with TAG on equals the update with it off (allclose in float32).
Generation runs under no_grad and never calls the optimizer or touches accumulated gradients.

The decision is a makespan prediction from running estimates (per-fragment generation time on a
rollout rank and on the trainer group, per-fragment training time, fragments unclaimed, in flight
and waiting): it simulates the rest of the step with and without one more TAG fragment and assists
only when the predicted end is earlier. When training is the bottleneck it declines (the trainer
would only delay work that is about to arrive); when generation is, it accepts.

Departures from the paper: in-flight fragments are assumed half done (ranks do not report progress).

Try it: `python main.py --placement disaggregated --gap --tsp --tag` (logs `tag_fragments` per step).
Only torch is imported: this file can be copied into another codebase as it is.
"""
from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass
class StepState:
    """What the trainer leader knows about the rest of the current step, in fragments and seconds."""

    unclaimed: int  # fragments nobody has claimed yet
    in_flight: int  # claimed by rollout ranks, not yet announced
    waiting: int  # announced, not yet trained
    rollout_ranks: int
    gen_rollout_s: float  # one fragment on one rollout rank
    gen_trainer_s: float  # one fragment on the trainer group
    train_s: float  # one fragment on the trainer group


def predict_step_end(state: StepState, assist_now: bool) -> float:
    """Seconds from now until the trainer group has trained every remaining fragment."""
    # Rollout side: in-flight fragments arrive about half a generation from now, then each rank
    # takes the next unclaimed fragment as soon as it is free (the queue is pull-based).
    free_at = [0.0] * max(state.rollout_ranks, 1)
    arrivals = [0.0] * state.waiting
    for i in range(state.in_flight):
        free_at[i % len(free_at)] = max(free_at[i % len(free_at)], 0.5 * state.gen_rollout_s)
    arrivals += sorted(free_at)[: state.in_flight]
    heapq.heapify(free_at)
    unclaimed = state.unclaimed - (1 if assist_now else 0)
    for _ in range(max(unclaimed, 0)):
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + state.gen_rollout_s)
        arrivals.append(start + state.gen_rollout_s)
    # Trainer side: optionally generate one fragment first, then train everything in arrival order.
    clock = 0.0
    if assist_now:
        clock = state.gen_trainer_s
        arrivals.append(clock)
    for arrival in sorted(arrivals):
        clock = max(clock, arrival) + state.train_s
    return clock


def should_assist(state: StepState, margin_s: float = 0.0) -> bool:
    """Assist only if a fragment is left to claim and the predicted end is earlier by more than `margin_s`."""
    if state.unclaimed <= 0:
        return False
    return predict_step_end(state, True) + margin_s < predict_step_end(state, False)


class RunningMean:
    """Exponential moving average of a duration; `value` falls back to `default` before any sample."""

    def __init__(self, default: float, weight: float = 0.5):
        self.default, self.weight, self.value_ = default, weight, None

    def update(self, seconds: float) -> None:
        self.value_ = seconds if self.value_ is None else (1 - self.weight) * self.value_ + self.weight * seconds

    @property
    def value(self) -> float:
        return self.default if self.value_ is None else self.value_


def split_groups(num_groups: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous share [start, end) of a fragment's groups that trainer `rank` of `world` generates."""
    return num_groups * rank // world, num_groups * (rank + 1) // world
