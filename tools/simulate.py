"""Cost model of an RL step for every placement/mechanism mode on any cluster (docs/DESIGN.md sections 5-6).

    python tools/simulate.py --costs bench_runs/quick/costs.json   # replay a bench-measured profile
    python tools/simulate.py --costs ... --rank-speed 0=0.5        # rank 0 at half speed
    python tools/simulate.py --costs ... --modes gap+tsp,gap+tsp+tag --sweep num_steps=12,24,48
    python tools/paper_scale.py                                     # the seed models on 16/32 H200s

`simulate(mode, costs, cluster, workload)` runs a small discrete-event simulation that follows the
runtime's protocol. The fragment queue is a counter of TRAJECTORIES: a rollout rank claims a contiguous
range of m = fragment_groups x G at a time (the last claim may get fewer) and streams each finished
range to the trainer, which trains each group once all its G trajectories are in, in arrival order
(GAP) or after the whole batch (naive). TSP spreads the pairs over all K trainers; without TSP whole
fragments are dealt round-robin. TAG: when nothing has arrived, the trainer leader asks
tag.assist_groups (the runtime's own predictor) how much to claim, and the K trainers generate it;
right before publishing the weights of step k + 1 it makes the same decision for step k + 1. TCSS
lets rollout ranks generate up to j fragments of the next batch with the weights they hold. A step
ends when all B groups are trained.
Issue 25's two runtime changes are Workload options of this one model (defaults: the runtime today):
  tsp_span    packs span fragments: a trainer's pairs of consecutive fragments fill the same packs and a
              pack trains once every trainer can fill it (sim_model.spanning_passes); only the step's last
              pack is padded. Off: each fragment is padded to whole packs (tsp.num_passes).
  tag_split   "group-claims": whole groups, split over the K trainers by trajectories (the runtime's TAG
              since issue 25: tag.Assistant with group_size G; tools/plan.py and bench.py simulate it);
              "groups": whole groups, split by groups (a trainer without a share idles: the runtime before
              issue 25); "trajectories": a what-if of TAG claims of any number of trajectories with
              rollout claims of m trajectories from anywhere (no runtime does that; the runtime's
              claims of part of a group, issue 25's --tag-part-groups, measured 0.1% at best and were
              removed: docs/RESULTS.md section 3b).
Colocated: every rank generates its static share of fragments, then trains it; "colocated-real"
also pays `costs.switch_s` per step (offload/reload and weight sync, see paper_scale.py).
Several steps are simulated; the report is the steady-state mean (warm-up and last step excluded).

Costs are seconds on a GPU of speed 1.0; rank r runs generation and training at cluster.speed(r).
The bound is (N T f + N T_train b) / sum(speeds) with the cheapest f and b in the tables (decode
and reward folded into f), so no simulated schedule can beat it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402  (the colocated baseline's static shares, as the runtime cuts them)
import config  # noqa: E402  (config.MODES owns the mechanism presets)
import tag  # noqa: E402  (the runtime's TAG predictor: the simulated leader decides as the real one)
from infra.tracing import union_length  # noqa: E402
from tools.sim_model import (Cluster, Costs, Workload, _Sim, bound_s, generation_s,  # noqa: E402,F401
                             pair_s, per_item, spanning_passes, train_dealt_s, train_samples_s,
                             train_tsp_s)

BENCH_MODES = ("colocated", "naive", "gap", "gap+tsp", "gap+tsp+tag", "digenrl")
REAL_COLOCATED = "colocated-real"  # simulator only: colocated plus the measured switch costs


def mechanisms(mode: str) -> tuple:
    """(placement, gap, tsp, tag, tcss) of a mode: config.MODES' presets, a '+'-joined mix of
    gap/tsp/tag/tcss (disaggregated; "async" is accepted for tcss, as main.py's --async), or
    colocated-real (colocated's mechanisms)."""
    if mode == REAL_COLOCATED:
        return config.MODES["colocated"]
    if mode in config.MODES:
        return config.MODES[mode]
    names = {"gap": "gap", "tsp": "tsp", "tag": "tag", "tcss": "use_tcss", "async": "use_tcss"}
    parts = mode.split("+")
    if any(p not in names for p in parts):
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(config.MODES)}, "
                         f"{REAL_COLOCATED}, or a '+'-joined mix of gap, tsp, tag, tcss")
    on = {names[p] for p in parts}
    return ("disaggregated",) + tuple(f in on for f in config.MECHANISM_FIELDS[1:])


MODES = {mode: mechanisms(mode) for mode in BENCH_MODES}  # what bench.py runs, in this order


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
    tag_fragments: float  # TAG claims per step
    tag_groups: float  # groups the trainer group generated per step
    stale_fragments: float  # per step


# --- the protocol ------------------------------------------------------------------------------
def simulate(mode: str, costs: Costs, cluster: Cluster, wl: Workload) -> StepReport:
    """Simulate `wl.steps` RL steps of `mode`; return the steady-state StepReport."""
    if wl.steps < wl.warmup + 4:  # a short window can catch the stale-prefetch pattern mid-cycle
        raise ValueError(f"simulate at least warmup + 4 steps, got {wl.steps}")
    placement = mechanisms(mode)[0]
    sim = _Sim()
    run = _colocated if placement == "colocated" else _disaggregated
    step_end, counts, roles = run(sim, mode, costs, cluster, wl)
    return _report(mode, sim, costs, cluster, wl, step_end, counts, roles)


def _finish(sim, ranks, costs, training_ranks):
    """Optimizer (+ gradient all-reduce when several ranks train) on `ranks`."""
    yield from sim.busy(ranks, costs.optimizer_s + (costs.allreduce_s if training_ranks > 1 else 0))


def _colocated(sim, mode, costs, cluster, wl):
    P, G = cluster.nproc, wl.group_size
    switch = costs.switch_s if mode == REAL_COLOCATED else 0.0
    barrier, step_end = defaultdict(int), {}

    def rank_loop(rank):
        speed = cluster.speed(rank)
        # the runtime's own shares and generation calls: a contiguous 1/P of every minibatch, generated
        # fragment_groups groups per call, trained per (minibatch, call) piece
        calls = grpo.generation_batches(grpo.static_claims(wl.bounds, rank, P), wl.fragment_groups)
        gen = sum(generation_s(costs, sum(c for _, c in call) * G, wl.num_steps, speed) for call in calls)
        shares = [[c for call in calls for f, c in call if lo <= f < hi] for lo, hi in wl.bounds]
        for step in range(wl.steps):
            yield from sim.busy([rank], switch + gen)
            for j, frags in enumerate(shares):  # one update per minibatch, gradients summed over ranks
                yield from sim.busy([rank], sum(train_samples_s(costs, wl, g * G, speed) for g in frags))
                barrier[step, j] += 1
                yield ("until", lambda: barrier[step, j] == P)
                yield from _finish(sim, [rank], costs, P)
            if rank == 0:
                yield from sim.busy([0], costs.step_overhead_s)
                step_end[step] = sim.now

    for rank in range(P):
        sim.spawn(rank_loop(rank))
    sim.run()
    return step_end, {"tag": 0, "tag_groups": 0, "stale": 0}, {r: "colocated" for r in range(P)}


def _disaggregated(sim, mode, costs, cluster, wl):
    _, gap_on, tsp_on, tag_on, tcss_on = mechanisms(mode)
    P, R, B, G, S = cluster.nproc, cluster.rollout_ranks, wl.groups, wl.group_size, wl.steps
    N, m = B * G, wl.m  # trajectories per step, per fragment
    unit = 1 if wl.tag_split == "trajectories" else G  # TAG's claim unit, in trajectories
    trainers = list(range(R, P))
    K, leader = len(trainers), trainers[0]
    t_speed = cluster.speed(leader)
    max_stale = R if wl.max_stale is None else wl.max_stale
    claimed, stale_claims, tag_claimed = defaultdict(int), defaultdict(int), defaultdict(int)
    announced = defaultdict(list)  # step -> [(first, end trajectory, destination rank)] in order
    state = {"published": -1}
    counts = {"tag": 0, "tag_groups": 0, "stale": 0}
    step_end = {}

    def claim(step, n):
        """The store counter, in trajectories: the contiguous range [lo, hi) of up to n of them."""
        lo = claimed[step]
        claimed[step] = min(lo + max(n, 0), N)
        return lo, claimed[step]

    def rollout_claim(step):
        """A rollout rank's claim: m trajectories."""
        return claim(step, m)

    def transfer_s(trajectories):
        return costs.transfer_s * trajectories / m

    def rollout(rank):
        speed, held = cluster.speed(rank), -1

        def produce(step, lo, hi, version):
            yield from sim.busy([rank], generation_s(costs, hi - lo, wl.num_steps, speed))
            seq = len(announced[step])
            announced[step].append((lo, hi, leader if tsp_on else trainers[seq % K]))
            counts["stale"] += version < step

        for step in range(S):
            yield ("until", lambda: state["published"] >= step)
            if held < state["published"]:
                yield ("delay", costs.weights_latency_s)
                held = state["published"]
            while (got := rollout_claim(step))[1] > got[0]:
                yield from produce(step, *got, held)
            while tcss_on and step + 1 < S and state["published"] < step + 1:
                stale_claims[step + 1] += 1  # TCSS: the budget j counts fragments
                if stale_claims[step + 1] > max_stale:
                    break
                if (got := rollout_claim(step + 1))[1] == got[0]:
                    break
                yield from produce(step + 1, *got, held)

    # The predictor's inputs, as the runtime estimates them, in units of `unit` trajectories.
    gen_rollout = R / sum(1 / generation_s(costs, m, wl.num_steps, cluster.speed(r))
                          for r in range(R))  # per fragment: the ranks' harmonic mean
    gen_unit = generation_s(costs, G, wl.num_steps, t_speed) * unit / G + (transfer_s(unit) if K > 1 else 0)
    if wl.tsp_span:
        train_unit = unit * wl.train_steps / K * pair_s(costs, wl, t_speed)
    else:
        train_unit = train_tsp_s(costs, wl, m, K, t_speed) * unit / m
    decisions = {}

    def tag_wants(step, next_seq, boundary=False):
        """tag.assist_groups' claim, in trajectories."""
        key = (step, claimed[step], len(announced[step]), next_seq, boundary)
        u = unit
        if key not in decisions:
            arrived = sum(hi - lo for lo, hi, _ in announced[step])
            decisions[key] = u * tag.assist_groups(tag.StepState(
                unclaimed=(N - claimed[step]) // u,
                waiting=sum(hi - lo for lo, hi, _ in announced[step][next_seq:]) // u,
                in_flight=max(claimed[step] - arrived - tag_claimed[step], 0) // u, rollout_ranks=R,
                gen_rollout_s=gen_rollout, gen_trainer_s=gen_unit * u / unit, train_s=train_unit * u / unit,
                fragment_groups=m // u, trainers=K,
                quantum=K if wl.fsdp and wl.tag_split in ("groups", "trajectories") else 1,
                group_size=G if u == G and wl.tag_split != "groups" else 0,  # the runtime's split cost
                rollout_start_s=(costs.publish_s + costs.weights_latency_s) if boundary else 0.0,
                trainer_start_s=costs.publish_s if boundary else 0.0))
        return decisions[key]

    def tag_claim(step, n):
        lo, hi = claim(step, n)
        tag_claimed[step] += hi - lo
        counts["tag"] += hi > lo
        counts["tag_groups"] += (hi - lo) / G
        return lo, hi

    def publish(version):
        yield from sim.busy([leader], costs.publish_s)
        state["published"] = version

    def tag_shares(lo, hi):
        """Each trainer's trajectories of a TAG claim: split by trajectories, or by whole groups."""
        if wl.tag_split != "groups":
            return [tag.split_groups(hi - lo, K, r) for r in range(K)]
        return [(a * G, b * G) for a, b in (tag.split_groups((hi - lo) // G, K, r) for r in range(K))]

    bounds = wl.bounds  # M minibatches: an update after each (grpo.train_in_minibatches)

    def minibatch_of(group):
        return next(j for j, (lo, hi) in enumerate(bounds) if lo <= group < hi)

    def trainer_group():  # under TSP the K trainers move in lockstep: one actor
        yield from publish(0)
        pending = {}  # step -> the range TAG claimed at the boundary, not generated yet
        for step in range(S):
            have = bytearray(N)  # trajectories in the trainer group (a group trains once all G are)
            trained, next_seq, current = 0, 0, 0
            own = pending.pop(step, (0, 0))
            span = {"pairs": 0, "passes": 0}  # the current minibatch's spanning packs (PackStream)
            covered, held = [0] * len(bounds), [[] for _ in bounds]  # groups in; parts not trained yet

            def train(groups):  # newly complete groups of the current minibatch, trained now (GAP)
                if not wl.tsp_span:  # each arrival padded to whole packs
                    return train_tsp_s(costs, wl, groups * G, K, t_speed)
                span["pairs"] += groups * G * wl.train_steps
                now = spanning_passes(span["pairs"], K, wl.tsp_pack, last=False)
                done, span["passes"] = now - span["passes"], now
                return done * wl.tsp_pack * pair_s(costs, wl, t_speed)

            def close(j):  # minibatch j is in: what it still needs, its update
                tail = 0.0 if gap_on else sum(train_tsp_s(costs, wl, g * G, K, t_speed) for g in held[j])
                if wl.tsp_span:  # the minibatch's last pack, padded (or every pack, without GAP)
                    pairs = (bounds[j][1] - bounds[j][0]) * G * wl.train_steps
                    tail = (spanning_passes(pairs, K, wl.tsp_pack, last=True) - span["passes"]) \
                        * wl.tsp_pack * pair_s(costs, wl, t_speed)
                span["pairs"] = span["passes"] = 0
                yield from sim.busy(trainers, tail)
                yield from _finish(sim, trainers, costs, K)

            while trained < B:
                yield ("until", lambda: len(announced[step]) > next_seq or own[1] > own[0]
                       or (tag_on and tag_wants(step, next_seq) > 0))
                if len(announced[step]) > next_seq:  # the leader polls arrivals first
                    lo, hi, _ = announced[step][next_seq]
                    next_seq += 1
                    yield from sim.busy([leader], transfer_s(hi - lo))
                    if K > 1:
                        yield from sim.busy(trainers, transfer_s(hi - lo))  # broadcast to the group
                elif own[1] > own[0]:  # generate the claimed trajectories, split over the K trainers
                    (lo, hi), own = own, (0, 0)
                    shares = tag_shares(lo, hi)
                    working = [t for t, (a, b) in zip(trainers, shares) if b > a]
                    share = max(b - a for a, b in shares)
                    yield from sim.busy(working, generation_s(costs, share, wl.num_steps, t_speed))
                    if K > 1:
                        yield from sim.busy(trainers, transfer_s(hi - lo))  # shares to the group
                else:
                    own = tag_claim(step, tag_wants(step, next_seq))
                    continue
                have[lo:hi] = b"\x01" * (hi - lo)
                complete = [g for g in range(lo // G, -(-hi // G)) if all(have[g * G:(g + 1) * G])]
                trained += len(complete)
                now = 0.0
                for j in sorted({minibatch_of(g) for g in complete}):
                    count = sum(minibatch_of(g) == j for g in complete)
                    covered[j] += count
                    if gap_on and j == current:
                        now += train(count)
                    else:
                        held[j].append(count)  # a later minibatch's part waits for the update
                yield from sim.busy(trainers, now)
                while gap_on and current < len(bounds) - 1 and covered[current] == bounds[current][1] - bounds[current][0]:
                    yield from close(current)
                    current += 1
                    if gap_on:
                        yield from sim.busy(trainers, sum(train(g) for g in held[current]))
            while current < len(bounds) - 1:  # every group is in: the remaining updates
                yield from close(current)
                current += 1
                if gap_on:
                    yield from sim.busy(trainers, sum(train(g) for g in held[current]))
            yield from close(current)
            yield from sim.busy([leader], costs.step_overhead_s)
            step_end[step] = sim.now
            if tag_on and step + 1 < S:  # before the rollout ranks grab the rest of step + 1
                pending[step + 1] = tag_claim(step + 1, tag_wants(step + 1, 0, boundary=True))
            yield from publish(step + 1)

    def dealt_trainer(k):
        rank = trainers[k]
        if k == 0:
            yield from publish(0)
        # the fragments dealt to this trainer (arrival k, k + K, ...), by the minibatch of their first
        # group: the queue hands out groups in order, so arrival s is about fragment s
        mine = [[s for s in range(k, wl.fragments, K) if minibatch_of(s * wl.fragment_groups) == j]
                for j in range(len(bounds))]
        for step in range(S):
            held = [0.0] * len(bounds)  # without GAP: per minibatch, trained once the whole batch is in
            for j, seqs in enumerate(mine):  # minibatch j's fragments, then update j
                arriving = seqs if gap_on else [s for part in mine for s in part] if j == 0 else []
                for seq in arriving:
                    yield ("until", lambda: len(announced[step]) > seq)
                    lo, hi, _ = announced[step][seq]
                    work = train_dealt_s(costs, wl, t_speed) * (hi - lo) / m
                    yield from sim.busy([rank], transfer_s(hi - lo) + (work if gap_on else 0.0))
                    held[minibatch_of(lo // G)] += 0.0 if gap_on else work
                yield from sim.busy([rank], held[j])
                barrier[step, j] += 1
                yield ("until", lambda: barrier[step, j] == K)
                yield from _finish(sim, [rank], costs, K)
            if k == 0:
                yield from sim.busy([rank], costs.step_overhead_s)
                step_end[step] = sim.now
                yield from publish(step + 1)

    barrier = defaultdict(int)
    for rank in range(R):
        sim.spawn(rollout(rank))
    if tsp_on:
        sim.spawn(trainer_group())
    else:
        for k in range(K):
            sim.spawn(dealt_trainer(k))
    sim.run()
    return step_end, counts, {r: ("rollout" if r < R else "trainer") for r in range(P)}


def _report(mode, sim, costs, cluster, wl, step_end, counts, roles) -> StepReport:
    first, last = wl.warmup - 1, wl.steps - 2  # the last step has no next batch: excluded
    lo, hi = step_end[first], step_end[last]
    step = (hi - lo) / (last - first)
    busy = {r: union_length(sim.intervals[r], lo, hi) / (hi - lo) for r in roles}
    by_role = {role: sum(busy[r] for r in roles if roles[r] == role)
               / sum(1 for r in roles if roles[r] == role) for role in sorted(set(roles.values()))}
    bound = bound_s(costs, wl, cluster)
    pairs = wl.trajectories * wl.train_steps
    per_step = {k: v / wl.steps for k, v in counts.items()}
    return StepReport(mode, cluster.rollout_ranks, step, wl.trajectories / step, pairs / step,
                      by_role, 1 - sum(busy.values()) / len(busy), bound, bound / step,
                      per_step["tag"], per_step["tag_groups"], per_step["stale"])


def best_split(mode: str, costs: Costs, cluster: Cluster, wl: Workload) -> StepReport:
    """The fastest R (rollout ranks) for a disaggregated mode; colocated has no split."""
    if mechanisms(mode)[0] == "colocated":
        return simulate(mode, costs, cluster, wl)
    splits = [dataclasses.replace(cluster, rollout_ranks=r) for r in range(1, cluster.nproc)]
    return min((simulate(mode, costs, c, wl) for c in splits), key=lambda rep: rep.step_s)


# --- bench-measured profiles -------------------------------------------------------------------
def load_costs(path: str) -> tuple[Costs, dict]:
    """A bench-produced costs JSON -> (Costs, the whole file: it also holds workload and cluster)."""
    with open(path) as f:
        data = json.load(f)
    costs = Costs(**data["costs"])
    costs.forward_s, costs.train_s = ({int(k): v for k, v in t.items()}
                                      for t in (costs.forward_s, costs.train_s))
    legacy = {"tsp_stream": "tsp_span"}  # costs files written before issue 25 name the option so
    data["workload"] = {legacy.get(k, k): v for k, v in data.get("workload", {}).items()}
    return costs, data


def format_report(rep: StepReport) -> str:
    busy = " ".join(f"{k[0]}={v:.2f}" for k, v in rep.busy.items())
    return (f"{rep.mode:<14} R={rep.rollout_ranks:<3} step {rep.step_s:8.2f}s  "
            f"traj/s {rep.trajectories_per_s:6.2f}  eff {rep.efficiency:5.2f}  "
            f"bubble {rep.bubble:5.2f}  busy {busy:<14} tag groups/step {rep.tag_groups:4.1f}")


SWEEP_FIELDS = ("num_steps", "train_steps", "groups", "group_size", "fragment_groups", "tsp_pack",
                "max_stale")


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    """'num_steps=12,24,48' -> ("num_steps", [12, 24, 48]): one Workload field and its values."""
    field, sep, values = spec.partition("=")
    if not sep or field not in SWEEP_FIELDS:
        raise ValueError(f"--sweep {spec!r}: expected FIELD=V1,V2,... with FIELD one of "
                         f"{', '.join(SWEEP_FIELDS)}")
    try:
        numbers = [int(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"--sweep {spec!r}: the values must be integers, got {values!r}") from None
    lowest = 0 if field == "max_stale" else 1  # j = 0: no fragment generated ahead
    if min(numbers) < lowest:
        raise ValueError(f"--sweep {spec!r}: the values must be >= {lowest}")
    return field, numbers


def gen_train_ratio(costs: Costs, cluster: Cluster, wl: Workload) -> float:
    """Gen / Tr of one step (DESIGN.md section 5): the batch's generation spread over the R rollout
    ranks over its training under TSP on the K trainers (padding included), at the ranks' speeds."""
    R, K = cluster.rollout_ranks, cluster.nproc - cluster.rollout_ranks
    gen = wl.fragments * generation_s(costs, wl.m, wl.num_steps, 1.0) / sum(map(cluster.speed, range(R)))
    return gen / (wl.fragments * train_tsp_s(costs, wl, wl.m, K, cluster.speed(R)))


def parse_rank_speed(spec: str | None) -> dict:
    from infra.emulate import parse_rank_speed as parse
    return parse(spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", required=True,
                        help="a bench-produced costs JSON (bench.py writes <bench dir>/costs.json)")
    parser.add_argument("--nproc", type=int, help="P (default: the costs file's)")
    parser.add_argument("--rollout-ranks", type=int, help="R; 0 = search the best split per mode")
    parser.add_argument("--rank-speed", help="RANK=FACTOR,... e.g. 0=0.5 (as main.py --rank-speed)")
    parser.add_argument("--steps", type=int, default=10, help="simulated RL steps")
    parser.add_argument("--modes", help="comma-separated modes (default: " + ",".join(MODES) + "); a "
                        "'+'-joined mix of gap/tsp/tag/tcss is a mode too")
    parser.add_argument("--sweep", metavar="FIELD=V1,V2,...",
                        help="simulate once per value of one workload field (" + ", ".join(SWEEP_FIELDS)
                        + "), e.g. num_steps=12,24,48: where a mechanism starts to pay")
    parser.add_argument("--out", help="also write the reports as JSON here")
    args = parser.parse_args(argv)
    modes = args.modes.split(",") if args.modes else list(MODES)
    try:
        for mode in modes:
            mechanisms(mode)
        field, values = parse_sweep(args.sweep) if args.sweep else (None, [None])
    except ValueError as exc:
        parser.error(str(exc))
    costs, data = load_costs(args.costs)
    wl = Workload(**{**data["workload"], "steps": args.steps})
    cluster = Cluster(**{**data["cluster"], **({"nproc": args.nproc} if args.nproc else {})})
    if args.rollout_ranks is not None:
        cluster.rollout_ranks = args.rollout_ranks or 1
    cluster.rank_speed = parse_rank_speed(args.rank_speed)
    print(f"# {args.costs}: P={cluster.nproc} B={wl.groups} G={wl.group_size} T={wl.num_steps} "
          f"T_train={wl.train_steps} rank speeds {cluster.rank_speed or 'all 1'}  "
          f"[{costs.provenance}]")
    run = best_split if args.rollout_ranks == 0 else simulate
    rows = []
    for value in values:
        w = dataclasses.replace(wl, **{field: value}) if field else wl
        if field:
            print(f"## {field}={value}  Gen/Tr {gen_train_ratio(costs, cluster, w):.2f}")
        for mode in modes:
            rep = run(mode, costs, cluster, w)
            print(format_report(rep))
            rows.append({**({field: value} if field else {}), **dataclasses.asdict(rep)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
