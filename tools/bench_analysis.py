"""bench.py's analysis: a run's trace and metrics -> step time, busy fractions, per-op costs, and
an efficiency that no run can push above 1.

The bound (README, "Efficiency"): every mode of one bench run measures its own per-op costs inside
its measured window -- f = generation seconds per (trajectory, denoising step), over the "generate"
and TAG "tag" spans (decode and reward folded in), and b = training seconds per trained pair (TSP
padding costs time but is not a pair). f_min and b_min are the smallest f and b any mode measured.
A run's efficiency is the work it did inside its window priced at f_min and b_min, over P times the
window's length:

    efficiency = (sum over generation ops of samples * T * f_min
                  + sum over train ops of pairs * b_min) / (P * window)

Each op counted took at least its price on average (this mode's own f and b are >= the minima and
are averaged over exactly these ops), ops of one rank do not overlap, and a rank is busy at most the
whole window, so efficiency <= 1 by construction. Per step, the bound (N T f_min + N T_train b_min) / P
is the all-ranks-busy step time at the cheapest costs measured; efficiency ~ bound / step time.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tsp  # noqa: E402
from infra.tracing import STEP_MARK_KIND, union_length  # noqa: E402
from tools import simulate  # noqa: E402

NOT_BUSY = ("wait", "send")  # send runs in a background thread and mostly blocks on the receiver
GENERATE_KINDS = ("generate", "tag")


def load_spans(path: str) -> list[dict]:
    """A Chrome trace written by tracing.write_chrome_trace -> span dicts (seconds)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    roles = {e["tid"]: e["args"]["name"].split("(")[-1].rstrip(")") for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = []
    for e in events:
        if e["ph"] in ("X", "i"):
            start = e["ts"] / 1e6
            spans.append({"rank": e["tid"], "role": roles.get(e["tid"], ""), "start": start,
                          "end": start + e.get("dur", 0) / 1e6, "args": e.get("args", {}),
                          "kind": e["name"] if e["ph"] == "X" else STEP_MARK_KIND})
    return spans


def _mean(values, default=0.0) -> float:
    return statistics.mean(values) if values else default  # per-op costs add up: means


def _median(values, default=0.0) -> float:
    return statistics.median(values) if values else default


def analyse(mode: str, run: dict, w: dict) -> dict:
    """Step time from metrics (steps >= 1); busy fractions, per-op costs and the work done from
    the trace inside the window [step 0's mark, the leader's last optimizer end]."""
    spans, nproc = run["spans"], w["nproc"]
    leader = min(s["rank"] for s in spans if s["kind"] == "optimizer")  # trainer rank 0
    marks = sorted((s["args"]["step"], s["start"]) for s in spans
                   if s["kind"] == STEP_MARK_KIND and s["rank"] == leader)
    lead_opt = sorted(s["end"] for s in spans if s["kind"] == "optimizer" and s["rank"] == leader)
    lo, hi = marks[0][1], lead_opt[-1]
    step_s = statistics.mean(m["step_time_s"] for m in run["metrics"] if m["step"] >= 1)
    busy = {r: union_length([(s["start"], s["end"]) for s in spans if s["rank"] == r
                             and s["kind"] not in NOT_BUSY and s["kind"] != STEP_MARK_KIND], lo, hi)
            / (hi - lo) for r in range(nproc)}
    roles = {s["rank"]: s["role"] for s in spans}
    m, k = w["m"], nproc - w["rollout_ranks"]
    spread = simulate.MODES[mode][2]  # TSP: each trainer trains 1/K of a fragment's pairs
    inside = [s for s in spans if s["start"] >= lo and s["end"] <= hi]
    gen = [s for s in inside if s["kind"] in GENERATE_KINDS]
    train = [s for s in inside if s["kind"] == "train"]
    window = {  # the work done inside the window and what it cost this mode
        "length_s": hi - lo, "nproc": nproc,
        "gen_s": sum(s["end"] - s["start"] for s in gen),
        "traj_steps": sum(s["args"].get("samples", m) * w["T"] for s in gen),
        "train_s": sum(s["end"] - s["start"] for s in train),
        "pairs": sum(s["args"].get("pairs", m * w["train_steps"] / (k if spread else 1))
                     for s in train)}
    late = [s for s in spans if s["args"].get("step", 1) >= 1 and s["start"] >= lo]
    dur = lambda kind: [s["end"] - s["start"] for s in late if s["kind"] == kind]  # noqa: E731
    mark_of = dict(marks)
    step_update_end = {}  # a step's last update (M per step): the step's end work starts after it
    for s in spans:
        if s["kind"] == "optimizer" and s["rank"] == leader:
            step = s["args"]["step"]
            step_update_end[step] = max(step_update_end.get(step, s["end"]), s["end"])
    gaps = [mark_of[step] - end for step, end in step_update_end.items() if step < w["steps"] - 1]  # metrics
    # Rollout-local (clocks differ by trace.align's skew): new weights in -> generating.
    weights_in = [s["end"] for s in spans if s["kind"] == "wait" and s["args"].get("what") == "weights"]
    starts = sorted(s["start"] for s in spans if s["kind"] == "generate")
    latency = [min((s for s in starts if s >= t), default=t) - t for t in weights_in]
    # per padded pair (simulate.py adds TSP's padding itself): the span's pair slots (TAG's group-sized
    # shares train fewer than a fragment's), or passes x pack of a whole fragment in traces without them
    whole = (tsp.num_passes(m, w["train_steps"], k, w["tsp_pack"]) * w["tsp_pack"] if spread
             else m * w["train_steps"])
    trains = [s for s in late if s["kind"] == "train"]
    slots = sum(s["args"].get("slots", whole) for s in trains)
    return {
        "mode": mode, "step_s": step_s, "steps_per_s": 1 / step_s,
        "trajectories_per_s": w["N"] / step_s, "pairs_per_s": w["N"] * w["train_steps"] / step_s,
        "busy": {f"{r}:{roles.get(r, '?')}": busy[r] for r in busy},
        "bubble": 1 - sum(busy.values()) / nproc, "wall_s": run["wall_s"], "window": window,
        "tag_fragments": sum(x.get("tag_fragments", 0) for x in run["metrics"] if x["step"] >= 1),
        "stale_fragments": sum(x.get("stale_fragments", 0) for x in run["metrics"] if x["step"] >= 1),
        "op": {"generate_fragment_s": _mean([s["end"] - s["start"] for s in late if s["kind"] == "generate"  # m samples
                                             and s["args"].get("samples", m) == m], _mean(dur("generate"))),
               "train_span_s": _mean(dur("train")),
               "f": window["gen_s"] / window["traj_steps"] if window["traj_steps"] else 0.0,
               "b": window["train_s"] / window["pairs"] if window["pairs"] else 0.0,
               "b_span": sum(s["end"] - s["start"] for s in trains) / slots if slots else 0.0,
               "recv_s": _mean(dur("recv")),
               "publish_s": _mean(dur("publish")), "optimizer_s": _mean(dur("optimizer")),
               "step_overhead_s": _mean(gaps),
               "weights_latency_s": _mean([x for x in latency if x < 1.0])},
    }


def cheapest_costs(rows: list[dict]) -> tuple[float, float, str, str]:
    """(f_min, b_min, mode of f_min, mode of b_min) over the modes of one bench run."""
    f_row = min((r for r in rows if r["op"]["f"] > 0), key=lambda r: r["op"]["f"])
    b_row = min((r for r in rows if r["op"]["b"] > 0), key=lambda r: r["op"]["b"])
    return f_row["op"]["f"], b_row["op"]["b"], f_row["mode"], b_row["mode"]


def efficiency(row: dict, f_min: float, b_min: float) -> float:
    """Cheapest-cost work inside the window over P x the window (<= 1: see the module docstring)."""
    w = row["window"]
    return (w["traj_steps"] * f_min + w["pairs"] * b_min) / (w["nproc"] * w["length_s"])


def forward_table(generate_fragment_s: float, w: dict, inproc: dict) -> dict:
    """batch -> forward seconds per (sample, step): the level from a traced generate span of m samples, the
    shape across batch sizes from bench.inprocess_costs (one group costs more per sample than m on a CPU)."""
    m, dec = w["m"], inproc["decode_reward_s"] / w["m"]  # decode + reward per sample
    per_sample = {b: max(s - b * dec, 0.0) / (b * w["T"]) for b, s in inproc["generate_s"].items()}
    level = max(generate_fragment_s - m * dec, 0.0) / (m * w["T"])
    return {b: level * v / per_sample[m] for b, v in per_sample.items()} if per_sample.get(m) else {m: level}


def measured_costs(rows: list[dict], w: dict, inproc: dict) -> simulate.Costs:
    """One set of per-op costs for simulate.py: the median over the modes of each mode's mean."""
    def pool(key, modes=None):
        return _median([r["op"][key] for r in rows if r["op"][key] > 0
                        and (modes is None or r["mode"] in modes)])

    disagg = [r["mode"] for r in rows if r["mode"] != "colocated"]
    packed = [r["mode"] for r in rows if simulate.MODES[r["mode"]][2]]  # TSP: passes of tsp_pack
    train_s = {w["m"]: pool("b_span", [r["mode"] for r in rows if r["mode"] not in packed])}
    if packed:
        train_s[w["tsp_pack"]] = pool("b_span", packed if w["tsp_pack"] != w["m"] else None)
    import time
    return simulate.Costs(
        forward_s=forward_table(pool("generate_fragment_s"), w, inproc),
        train_s={k: v for k, v in train_s.items() if v > 0}, decode_s=inproc["decode_reward_s"] / w["m"],
        transfer_s=pool("recv_s", disagg), publish_s=pool("publish_s", disagg),
        optimizer_s=pool("optimizer_s", disagg), step_overhead_s=pool("step_overhead_s"),
        # only colocated has more than one training rank here: its optimizer span holds the all-reduce
        allreduce_s=max(pool("optimizer_s", ["colocated"]) - pool("optimizer_s", disagg), 0.0),
        weights_latency_s=pool("weights_latency_s", disagg), name=f"tiny {w['model']} on CPU",
        provenance=f"measured by bench.py on this machine, {time.strftime('%Y-%m-%d %H:%M')}, "
                   "1 thread per rank")


def mode_costs(pooled: simulate.Costs, row: dict, w: dict, inproc: dict) -> simulate.Costs:
    """The pooled costs with this mode's own generation and training costs. On 2 CPU cores an op is slower
    while the other rank computes too (contention the simulator does not model), and how often that
    happens depends on the mode: each mode is simulated with the op costs it measured."""
    import dataclasses
    key = w["tsp_pack"] if simulate.MODES[row["mode"]][2] else w["m"]
    own_train = {key: row["op"]["b_span"]} if row["op"]["b_span"] > 0 else pooled.train_s
    gen = row["op"]["generate_fragment_s"]
    return dataclasses.replace(pooled, forward_s=forward_table(gen, w, inproc) if gen > 0 else pooled.forward_s,
                               train_s=own_train, name=f"{pooled.name}, {row['mode']}'s own op costs")
