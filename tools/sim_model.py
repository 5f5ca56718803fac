"""The cost model's pieces: per-op costs, cluster, workload, per-op times, the bound, and a tiny
discrete-event engine. tools/simulate.py runs the runtime's protocol on them (see its docstring).

Costs are seconds on a GPU of speed 1.0; rank r runs generation and training at cluster.speed(r).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import os
import sys
from collections import defaultdict

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tsp  # noqa: E402


@dataclasses.dataclass
class Costs:
    """Per-op seconds on a GPU of speed 1.0."""

    forward_s: dict  # batch -> seconds per sample per denoising step (one CFG branch)
    train_s: dict  # pairs per pass -> seconds per (sample, timestep) pair, forward + backward
    decode_s: float = 0.0  # per trajectory
    reward_s: float = 0.0  # per trajectory
    transfer_s: float = 0.0  # per fragment of m trajectories, trainer side (scaled by size)
    publish_s: float = 0.0  # per version, trainer leader
    optimizer_s: float = 0.0  # per step, every training rank: clip + AdamW
    allreduce_s: float = 0.0  # per step when more than one rank trains: gradients + metrics
    step_overhead_s: float = 0.0  # per step, trainer leader: metrics, logging
    weights_latency_s: float = 0.0  # publish end -> rollout generates with the new weights
    switch_s: float = 0.0  # colocated-real only: sleep/wake, offload/reload, sync per step
    true_cfg: bool = False  # rollout runs two branches per denoising step
    name: str = ""
    provenance: str = ""


@dataclasses.dataclass
class Cluster:
    nproc: int  # P
    rollout_ranks: int = 1  # R (colocated: ranks 0..R-1 are of rollout_kind)
    rollout_kind: str = "h200"
    trainer_kind: str = "h200"
    speeds: dict = dataclasses.field(default_factory=lambda: {"h200": 1.0})
    rank_speed: dict = dataclasses.field(default_factory=dict)  # rank -> factor (--rank-speed)

    def speed(self, rank: int) -> float:
        kind = self.rollout_kind if rank < self.rollout_ranks else self.trainer_kind
        return self.speeds.get(kind, 1.0) * float(self.rank_speed.get(rank, 1.0))


@dataclasses.dataclass
class Workload:
    groups: int  # B
    group_size: int  # G
    num_steps: int  # T
    train_steps: int  # T_train
    fragment_groups: int = 1
    max_stale: int | None = None  # j in fragments; None = one per rollout rank (the default)
    tsp_pack: int = 4
    fsdp: bool = False  # TAG claims multiples of K groups (every FSDP rank runs the same forwards)
    # Issue 25's two runtime changes, as options of the one cost model (defaults = today's runtime):
    tag_split: str = "groups"  # "trajectories": TAG claims of any trajectories, unaligned rollout
    #   claims (a what-if); "groups": whole groups, split by groups; "group-claims": whole groups split
    #   by trajectories (the runtime's TAG, issue 25)
    tsp_span: bool = False  # TSP packs span the fragments of a step: padding once per step, not per fragment
    updates_per_batch: int = 1  # M (--updates-per-batch): an optimizer step after each of M group-range
    #   minibatches (grpo.minibatch_bounds); spanning packs are padded once per update
    steps: int = 10  # simulated RL steps: the `warmup` first and the last one are not measured
    warmup: int = 2

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """The M minibatches' group ranges, as grpo.minibatch_bounds cuts them."""
        cuts = [j * self.groups // self.updates_per_batch for j in range(self.updates_per_batch + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    @property
    def m(self) -> int:
        return self.fragment_groups * self.group_size

    @property
    def fragments(self) -> int:
        return math.ceil(self.groups / self.fragment_groups)

    @property
    def trajectories(self) -> int:
        return self.groups * self.group_size


# --- per-op times ------------------------------------------------------------------------------
def per_item(table: dict, batch: int) -> float:
    """Seconds per item at `batch`, piecewise-linear between measured batches, clamped at the ends."""
    points = sorted((int(k), float(v)) for k, v in table.items())
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, v0), (b1, v1) in zip(points, points[1:]):
        if batch <= b1:
            return v0 + (v1 - v0) * (batch - b0) / (b1 - b0)
    return points[-1][1]


def generation_s(costs: Costs, samples: int, num_steps: int, speed: float) -> float:
    branches = 2 if costs.true_cfg else 1
    return (samples * num_steps * branches * per_item(costs.forward_s, samples)
            + samples * (costs.decode_s + costs.reward_s)) / speed


def pair_s(costs: Costs, wl: Workload, speed: float) -> float:
    """One (sample, timestep) pair in a TSP pack of wl.tsp_pack pairs."""
    return per_item(costs.train_s, wl.tsp_pack) / speed


def train_tsp_s(costs: Costs, wl: Workload, samples: int, trainers: int, speed: float) -> float:
    """One trainer's time for a fragment of `samples` under TSP, padded to whole packs on its own
    (tsp.num_passes: every trainer runs as many passes)."""
    return tsp.num_passes(samples, wl.train_steps, trainers, wl.tsp_pack) * wl.tsp_pack * pair_s(costs, wl, speed)


spanning_passes = tsp.spanning_passes  # one cost model, two users: the runtime's PackStream and this


def train_samples_s(costs: Costs, wl: Workload, samples: int, speed: float) -> float:
    """One trainer, the per-timestep loop over a fragment of `samples`: T_train passes of that many pairs."""
    return wl.train_steps * samples * per_item(costs.train_s, samples) / speed


def train_dealt_s(costs: Costs, wl: Workload, speed: float) -> float:
    """A whole fragment of m samples (train_samples_s)."""
    return train_samples_s(costs, wl, wl.m, speed)


def bound_s(costs: Costs, wl: Workload, cluster: Cluster) -> float:
    """(N T f + N T_train b) / P with the cheapest f and b (P counts ranks by speed)."""
    branches = 2 if costs.true_cfg else 1
    f = branches * min(costs.forward_s.values()) + (costs.decode_s + costs.reward_s) / wl.num_steps
    b = min(costs.train_s.values())
    capacity = sum(cluster.speed(r) for r in range(cluster.nproc))
    return wl.trajectories * (wl.num_steps * f + wl.train_steps * b) / capacity


def disaggregated_floor_s(costs: Costs, wl: Workload, cluster: Cluster, packs=(1, 2, 4, 8)) -> float:
    """The shortest steady-state step ANY disaggregated schedule of this model can reach with R =
    cluster.rollout_ranks: the K lockstep trainers train every pair (each update padded to whole TSP
    passes: ceil(pairs_j / (K p)) passes of p) and pay the per-step costs (optimizer and all-reduce
    per update, publish, step end); generation is split between the rollout ranks and TAG on the
    trainers in any fractional amount (TCSS lets the rollout ranks run across step boundaries), at
    the cheapest per-trajectory cost; transfers are free. A relaxation: no simulated schedule beats
    it (tests/test_simulate.py), so a floor above a baseline's step means no DigenRL schedule can
    win there."""
    R, P = cluster.rollout_ranks, cluster.nproc
    K, t_speed = P - R, cluster.speed(R)
    rollout_speed = sum(cluster.speed(r) for r in range(R))
    branches = 2 if costs.true_cfg else 1
    traj = (wl.num_steps * branches * min(costs.forward_s.values()) + costs.decode_s + costs.reward_s)
    best = math.inf
    for p in packs:
        passes = sum(math.ceil((hi - lo) * wl.group_size * wl.train_steps / (K * p)) for lo, hi in wl.bounds)
        train = (passes * p * per_item(costs.train_s, p) / t_speed + costs.publish_s + costs.step_overhead_s
                 + wl.updates_per_batch * (costs.optimizer_s + (costs.allreduce_s if K > 1 else 0.0)))
        # x trajectories on the trainers: rollout (N - x) traj / speed = train + x traj / (K t_speed)
        n = wl.trajectories
        x = (n * traj / rollout_speed - train) / (traj / rollout_speed + traj / (K * t_speed))
        x = min(max(x, 0.0), n)
        best = min(best, max((n - x) * traj / rollout_speed, train + x * traj / (K * t_speed)))
    return best


# --- a tiny discrete-event engine ---------------------------------------------------------------
class _Sim:
    """Actors are generators yielding ("delay", s) or ("until", predicate); busy time is kept."""

    def __init__(self):
        self.now, self._timed, self._blocked, self._order = 0.0, [], [], 0
        self.intervals = defaultdict(list)  # rank -> [(start, end)]

    def spawn(self, actor) -> None:
        self._advance(actor)

    def _advance(self, actor) -> None:
        request = next(actor, None)
        if request is None:
            return
        kind, value = request
        if kind == "delay":
            heapq.heappush(self._timed, (self.now + value, self._order, actor))
            self._order += 1
        else:
            self._blocked.append((value, actor))

    def run(self) -> None:
        while True:
            progressed = True
            while progressed:
                progressed = False
                for entry in list(self._blocked):
                    if entry[0]():
                        self._blocked.remove(entry)
                        self._advance(entry[1])
                        progressed = True
            if not self._timed:
                if self._blocked:
                    raise RuntimeError("simulation deadlocked: every actor waits")
                return
            self.now, _, actor = heapq.heappop(self._timed)
            self._advance(actor)

    def busy(self, ranks, seconds: float):
        start = self.now
        yield ("delay", max(seconds, 0.0))
        for r in ranks:
            self.intervals[r].append((start, self.now))
