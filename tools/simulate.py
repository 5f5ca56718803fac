"""Cost model of an RL step for every placement/mechanism mode on any cluster (DESIGN.md sections 5-6).

    python simulate.py --paper                          # four seed models, 16 and 32 H200s, every mode
    python simulate.py --costs bench_runs/quick/costs.json     # replay a bench-measured profile

`simulate(mode, costs, cluster, workload)` runs a small discrete-event simulation that follows
runtime.py's protocol: rollout ranks claim fragments from a shared counter and stream them; the
trainer trains them in arrival order (GAP) or after the whole batch (naive); TSP spreads a fragment's
packed pairs over all K trainers (padding included), without TSP fragments are dealt round-robin;
TAG asks tag.should_assist (the runtime's own predictor) whenever the trainer group would wait;
TCSS lets rollout generate up to j fragments of the next batch with the weights it holds.
Colocated: every rank generates its static share then trains it, plus a switch cost if given.
Several steps are simulated; the report is the steady-state mean (warm-up and last step excluded).

Costs are seconds on a GPU of speed 1.0; a rank of kind k runs at `cluster.speeds[k]`. The bound is
(N T f + N T_train b) / sum(speeds): f and b are the cheapest per-item costs in the tables (decode and
reward are folded into f), so no simulated schedule can beat it.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import sys
from collections import defaultdict

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tag  # noqa: E402  # the runtime's TAG predictor: the simulated trainer decides exactly as the real one

MODES = {  # name: (placement, gap, tsp, tag, async) -- the mixes bench.py runs, in this order
    "colocated": ("colocated", False, False, False, False),
    "naive": ("disaggregated", False, False, False, False),
    "gap": ("disaggregated", True, False, False, False),
    "gap+tsp": ("disaggregated", True, True, False, False),
    "gap+tsp+tag": ("disaggregated", True, True, True, False),
    "digenrl": ("disaggregated", True, True, True, True),
}


@dataclasses.dataclass
class Costs:
    """Per-op seconds on a GPU of speed 1.0."""

    forward_s: dict  # batch -> seconds per sample per denoising step (one CFG branch)
    train_s: dict  # pairs per pass -> seconds per (sample, timestep) pair, forward + backward
    decode_s: float = 0.0  # per trajectory
    reward_s: float = 0.0  # per trajectory
    transfer_s: float = 0.0  # per fragment, trainer side (receive; again as a broadcast under TSP with K > 1)
    publish_s: float = 0.0  # per version, trainer leader
    optimizer_s: float = 0.0  # per step, every training rank: clip + AdamW
    allreduce_s: float = 0.0  # per step, when more than one rank trains: gradient all-reduce + metric reduction
    step_overhead_s: float = 0.0  # per step, trainer leader: metrics, logging
    weights_latency_s: float = 0.0  # publish end -> rollout generates with the new weights (idle, not busy)
    switch_s: float = 0.0  # colocated only: offload + reload per step on every rank
    true_cfg: bool = False  # rollout runs two branches per denoising step
    name: str = ""
    provenance: str = ""


@dataclasses.dataclass
class Cluster:
    nproc: int  # P
    rollout_ranks: int = 1  # R (colocated: ranks 0..R-1 are of rollout_kind, the others of trainer_kind)
    rollout_kind: str = "h200"
    trainer_kind: str = "h200"
    speeds: dict = dataclasses.field(default_factory=lambda: {"h200": 1.0})

    def speed(self, rank: int) -> float:
        return self.speeds.get(self.rollout_kind if rank < self.rollout_ranks else self.trainer_kind, 1.0)


@dataclasses.dataclass
class Workload:
    groups: int  # B
    group_size: int  # G
    num_steps: int  # T
    train_steps: int  # T_train
    fragment_groups: int = 1
    max_stale: int | None = None  # j; None = one per rollout rank (main.py's default)
    tsp_pack: int = 4
    steps: int = 10  # simulated RL steps: the `warmup` first and the last one are not measured
    warmup: int = 2

    @property
    def m(self) -> int:
        return self.fragment_groups * self.group_size

    @property
    def fragments(self) -> int:
        return self.groups // self.fragment_groups

    @property
    def trajectories(self) -> int:
        return self.groups * self.group_size


@dataclasses.dataclass
class StepReport:
    mode: str
    rollout_ranks: int
    step_s: float
    trajectories_per_s: float
    pairs_per_s: float
    busy: dict  # role -> mean busy fraction of its ranks
    bubble: float  # 1 - mean busy fraction over all ranks
    bound_s: float
    efficiency: float
    tag_fragments: float  # per step
    stale_fragments: float  # per step


# --- per-fragment times -------------------------------------------------------------------------
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


def tsp_passes(samples: int, train_steps: int, world: int, pack: int) -> int:
    """Passes per trainer per fragment under TSP, padding included (= tsp.num_passes)."""
    return math.ceil(math.ceil(samples * train_steps / world) / pack)


def train_tsp_s(costs: Costs, wl: Workload, trainers: int, speed: float) -> float:
    return tsp_passes(wl.m, wl.train_steps, trainers, wl.tsp_pack) * wl.tsp_pack * per_item(costs.train_s, wl.tsp_pack) / speed


def train_dealt_s(costs: Costs, wl: Workload, speed: float) -> float:
    """One trainer, the per-timestep loop: T_train passes of m pairs."""
    return wl.train_steps * wl.m * per_item(costs.train_s, wl.m) / speed


def bound_s(costs: Costs, wl: Workload, cluster: Cluster) -> float:
    """(N T f + N T_train b) / P with the cheapest f and b (P counts ranks by speed)."""
    branches = 2 if costs.true_cfg else 1
    f = branches * min(costs.forward_s.values()) + (costs.decode_s + costs.reward_s) / wl.num_steps
    b = min(costs.train_s.values())
    capacity = sum(cluster.speed(r) for r in range(cluster.nproc))
    return wl.trajectories * (wl.num_steps * f + wl.train_steps * b) / capacity


# --- a tiny discrete-event engine ---------------------------------------------------------------
class _Sim:
    """Actors are generators yielding ("delay", seconds) or ("until", predicate); busy time per rank is kept."""

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


# --- the protocol -------------------------------------------------------------------------------
def simulate(mode: str, costs: Costs, cluster: Cluster, wl: Workload) -> StepReport:
    """Simulate `wl.steps` RL steps of `mode`; return the steady-state StepReport."""
    placement, gap_on, tsp_on, tag_on, async_on = MODES[mode]
    P, R, M, S = cluster.nproc, cluster.rollout_ranks, wl.fragments, wl.steps
    max_stale = R if wl.max_stale is None else wl.max_stale
    if S < wl.warmup + 4:  # a short window can catch the stale-prefetch pattern mid-cycle
        raise ValueError(f"simulate at least warmup + 4 steps, got {S}")
    sim = _Sim()
    claims, announced, stale_budget = defaultdict(int), defaultdict(list), defaultdict(int)
    assisted, barrier = defaultdict(int), defaultdict(int)
    state = {"published": -1, "tag": 0, "stale": 0}
    step_end = {}

    def claim(step):
        claims[step] += 1
        return claims[step] - 1 if claims[step] <= M else None

    def finish_step(ranks, step, is_leader, publish, training_ranks):
        yield from sim.busy(ranks, costs.optimizer_s + (costs.allreduce_s if training_ranks > 1 else 0.0))
        if is_leader:
            yield from sim.busy(ranks[:1], costs.step_overhead_s)
            step_end[step] = sim.now
            if publish:
                yield from sim.busy(ranks[:1], costs.publish_s)
                state["published"] = step + 1

    if placement == "colocated":
        def colocated(rank):
            mine = range(rank, M, P)
            speed = cluster.speed(rank)
            gen, train = generation_s(costs, wl.m, wl.num_steps, speed), train_dealt_s(costs, wl, speed)
            for step in range(S):
                yield from sim.busy([rank], costs.switch_s + len(mine) * (gen + train))
                barrier[step] += 1
                yield ("until", lambda: barrier[step] == P)
                yield from finish_step([rank], step, rank == 0, False, P)
        for rank in range(P):
            sim.spawn(colocated(rank))
        sim.run()
        return _report(mode, sim, costs, cluster, wl, step_end, state, roles={r: "colocated" for r in range(P)})

    trainers = list(range(R, P))
    K = len(trainers)
    t_speed = cluster.speed(trainers[0])

    def rollout(rank):
        gen = generation_s(costs, wl.m, wl.num_steps, cluster.speed(rank))
        held = -1

        def produce(step, index, version):
            yield from sim.busy([rank], gen)
            seq = len(announced[step])
            announced[step].append(trainers[0] if tsp_on else trainers[seq % K])
            state["stale"] += version < step

        for step in range(S):
            yield ("until", lambda: state["published"] >= step)
            if held < state["published"]:
                yield ("delay", costs.weights_latency_s)
                held = state["published"]
            while (index := claim(step)) is not None:
                yield from produce(step, index, held)
            while async_on and step + 1 < S and state["published"] < step + 1 and max_stale > 0:
                stale_budget[step + 1] += 1
                if stale_budget[step + 1] > max_stale or (index := claim(step + 1)) is None:
                    break
                yield from produce(step + 1, index, held)

    def dealt_trainer(k):
        rank, train = trainers[k], train_dealt_s(costs, wl, t_speed)
        mine = range(k, M, K)
        if k == 0:
            yield from sim.busy([rank], costs.publish_s)
            state["published"] = 0
        for step in range(S):
            for seq in mine:
                yield ("until", lambda: len(announced[step]) > seq)
                yield from sim.busy([rank], costs.transfer_s + (train if gap_on else 0.0))
            if not gap_on:
                yield from sim.busy([rank], len(mine) * train)
            barrier[step] += 1
            yield ("until", lambda: barrier[step] == K)
            yield from finish_step([rank], step, k == 0, True, K)

    share = math.ceil(wl.fragment_groups / K) * wl.group_size  # TAG: the largest share of a fragment's groups
    gen_trainer = generation_s(costs, share, wl.num_steps, t_speed) + (costs.transfer_s if K > 1 else 0.0)
    gen_rollout = generation_s(costs, wl.m, wl.num_steps, cluster.speed(0))
    train_fragment = train_tsp_s(costs, wl, K, t_speed)

    def tag_wants(step, next_seq):
        claimed, arrived = min(claims[step], M), len(announced[step])
        return tag.should_assist(tag.StepState(
            unclaimed=M - claimed, in_flight=max(claimed - arrived - assisted[step], 0), waiting=arrived - next_seq,
            rollout_ranks=R, gen_rollout_s=gen_rollout, gen_trainer_s=gen_trainer, train_s=train_fragment))

    def trainer_group():  # under TSP the K trainers move in lockstep: one actor
        yield from sim.busy(trainers[:1], costs.publish_s)
        state["published"] = 0
        for step in range(S):
            done, next_seq, held = 0, 0, 0
            while done < M:
                yield ("until", lambda: len(announced[step]) > next_seq or (tag_on and tag_wants(step, next_seq)))
                if len(announced[step]) > next_seq:  # runtime._leader_decide polls arrivals first
                    next_seq += 1
                    yield from sim.busy(trainers[:1], costs.transfer_s)
                    if K > 1:
                        yield from sim.busy(trainers, costs.transfer_s)  # broadcast to the trainer group
                else:
                    claim(step)
                    assisted[step] += 1
                    state["tag"] += 1
                    yield from sim.busy(trainers, gen_trainer)
                done += 1
                if gap_on:
                    yield from sim.busy(trainers, train_fragment)
                else:
                    held += 1
            yield from sim.busy(trainers, held * train_fragment)
            yield from finish_step(trainers, step, True, True, K)

    for rank in range(R):
        sim.spawn(rollout(rank))
    if tsp_on:
        sim.spawn(trainer_group())
    else:
        for k in range(K):
            sim.spawn(dealt_trainer(k))
    sim.run()
    roles = {r: ("rollout" if r < R else "trainer") for r in range(P)}
    return _report(mode, sim, costs, cluster, wl, step_end, state, roles)


def _union_in(intervals, lo, hi) -> float:
    total, cur_end = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, cur_end), min(end, hi)
        if end > start:
            total += end - start
            cur_end = end
    return total


def _report(mode, sim, costs, cluster, wl, step_end, state, roles) -> StepReport:
    first, last = wl.warmup - 1, wl.steps - 2  # the last step has no next batch to prefetch: excluded
    lo, hi = step_end[first], step_end[last]
    step = (hi - lo) / (last - first)
    busy = {r: _union_in(sim.intervals[r], lo, hi) / (hi - lo) for r in roles}
    by_role = {role: sum(busy[r] for r in roles if roles[r] == role) / sum(1 for r in roles if roles[r] == role)
               for role in sorted(set(roles.values()))}
    bound = bound_s(costs, wl, cluster)
    pairs = wl.trajectories * wl.train_steps
    return StepReport(mode, cluster.rollout_ranks, step, wl.trajectories / step, pairs / step, by_role,
                      1 - sum(busy.values()) / len(busy), bound, bound / step,
                      state["tag"] / wl.steps, state["stale"] / wl.steps)


def best_split(mode: str, costs: Costs, cluster: Cluster, wl: Workload) -> StepReport:
    """The fastest R (rollout ranks) for a disaggregated mode; colocated has no split."""
    if MODES[mode][0] == "colocated":
        return simulate(mode, costs, cluster, wl)
    splits = [dataclasses.replace(cluster, rollout_ranks=r) for r in range(1, cluster.nproc)]
    return min((simulate(mode, costs, c, wl) for c in splits), key=lambda rep: rep.step_s)


# --- bench-measured profiles -----------------------------------------------------------------------------------
def load_costs(path: str) -> tuple[Costs, dict]:
    """A bench-produced costs JSON -> (Costs, the whole file: it also holds the workload and cluster)."""
    with open(path) as f:
        data = json.load(f)
    costs = Costs(**data["costs"])
    costs.forward_s, costs.train_s = ({int(k): v for k, v in t.items()} for t in (costs.forward_s, costs.train_s))
    return costs, data


def format_report(rep: StepReport) -> str:
    busy = " ".join(f"{k[0]}={v:.2f}" for k, v in rep.busy.items())
    return (f"{rep.mode:<12} R={rep.rollout_ranks:<3} step {rep.step_s:8.2f}s  traj/s {rep.trajectories_per_s:6.2f}  "
            f"eff {rep.efficiency:5.2f}  bubble {rep.bubble:5.2f}  busy {busy:<14} tag/step {rep.tag_fragments:4.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper", action="store_true", help="the seed models at paper settings on 16/32 H200s")
    parser.add_argument("--costs", help="a bench-produced costs JSON (bench.py writes <bench dir>/costs.json)")
    parser.add_argument("--nproc", type=int, help="P (default: the costs file's)")
    parser.add_argument("--rollout-ranks", type=int, help="R; 0 = search the best split per mode")
    parser.add_argument("--steps", type=int, default=10, help="simulated RL steps")
    parser.add_argument("--out", help="also write the reports as JSON here")
    args = parser.parse_args(argv)
    if args.paper:
        from tools.paper_scale import print_paper  # the measured H200 profiles and the paper's settings
        results = print_paper()
    elif args.costs:
        costs, data = load_costs(args.costs)
        wl = Workload(**{**data["workload"], "steps": args.steps})
        cluster = Cluster(**{**data["cluster"], **({"nproc": args.nproc} if args.nproc else {})})
        if args.rollout_ranks is not None:
            cluster.rollout_ranks = args.rollout_ranks or 1
        print(f"# {args.costs}: P={cluster.nproc} B={wl.groups} G={wl.group_size} T={wl.num_steps} "
              f"T_train={wl.train_steps}  [{costs.provenance}]")
        reports = [best_split(m, costs, cluster, wl) if args.rollout_ranks == 0 else simulate(m, costs, cluster, wl)
                   for m in MODES]
        for rep in reports:
            print(format_report(rep))
        results = [dataclasses.asdict(r) for r in reports]
    else:
        parser.error("give --paper or --costs FILE")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
