"""Every placement/mechanism mode side by side, same model, seed and batch (DESIGN.md section 6).

    python bench.py --quick --validate        # tiny FLUX, 2 CPU ranks, 6 modes, < 5 min; + simulate.py's prediction
    python bench.py --modes naive,digenrl --nproc 4 --rollout-ranks 2 --steps 10
    python bench.py --device cuda --size flux-12b   # GPU check (gpu_check.py): our overhead vs the bare transformer

Each mode runs as `python main.py ... --trace`; its trace.json is parsed back into spans and its
metrics.jsonl gives the step times (step 0 is warm-up and excluded). Per mode: steps/s, trajectories/s,
trained pairs/s, busy fraction per rank (union of spans other than "wait" and the background "send"
thread, inside the measured window), bubble fraction, efficiency = (N T f + N T_train b) / P over the
mean step time, and speedups. f (generate span per trajectory per denoising step; decode and reward
folded in) and b (train span per trained pair) come from the reference mode's trace (naive, else the
first mode run). Writes bench.json, costs.json (per-op costs for simulate.py) and bench.png into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time


if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra.tracing import STEP_MARK_KIND  # noqa: E402
from tools import gpu_check, simulate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tuned on this 2-core machine (with simulate.py): fragments of 2 groups (M = 2) amortise the ~14 ms a fragment
# takes to cross gloo; T_train = 8 of T = 24 balances generation and training on 1 rollout + 1 trainer rank.
QUICK = dict(model="flux", steps=8, num_steps=24, timestep_fraction=0.35, prompts_per_step=4, group_size=4,
             fragment_groups=2, tsp_pack=8, nproc=2, rollout_ranks=1)
NOT_BUSY = ("wait", "send")  # send runs in a background thread and mostly blocks on the receiver


def mode_flags(mode: str) -> list[str]:
    placement, gap, tsp, tag, use_async = simulate.MODES[mode]
    if mode in ("colocated", "naive", "digenrl"):
        return ["--mode", mode]
    flags = (("--gap", gap), ("--tsp", tsp), ("--tag", tag), ("--async", use_async))
    return ["--placement", placement] + [flag for flag, on in flags if on]


def run_mode(mode: str, args) -> dict:
    run_dir = os.path.join(args.out, mode)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start clean
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), *mode_flags(mode), "--model", args.model, "--steps", str(args.steps),
           "--num-steps", str(args.num_steps), "--timestep-fraction", str(args.timestep_fraction),
           "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
           "--fragment-groups", str(args.fragment_groups), "--tsp-pack", str(args.tsp_pack), "--nproc", str(args.nproc),
           "--rollout-ranks", str(args.rollout_ranks),
           "--seed", str(args.seed), "--device", args.device, "--trace", "--no-progress", "--eval-every", "0",
           "--save-every", "0", "--threads", "1", "--run-name", mode, "--out-dir", args.out]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return {"spans": load_spans(os.path.join(run_dir, "trace.json")), "metrics": metrics, "wall_s": time.perf_counter() - start}


def load_spans(path: str) -> list[dict]:
    """A Chrome trace written by trace.write_chrome_trace -> the span dicts trace.summarize takes (seconds)."""
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


def _union(intervals) -> float:
    total, cur = 0.0, -float("inf")
    for s, e in sorted(intervals):
        s = max(s, cur)
        if e > s:
            total, cur = total + e - s, e
    return total


def _median(values, default=0.0) -> float:
    return statistics.median(values) if values else default


def _mean(values, default=0.0) -> float:
    return statistics.mean(values) if values else default  # per-op costs add up: means, not medians


def analyse(mode: str, run: dict, w: dict) -> dict:
    """Step time from metrics (steps >= 1); busy fractions and per-op costs from the trace in the window."""
    spans, nproc = run["spans"], w["nproc"]
    leader = min(s["rank"] for s in spans if s["kind"] == "optimizer")  # trainer rank 0 (colocated: rank 0)
    marks = sorted((s["args"]["step"], s["start"]) for s in spans if s["kind"] == STEP_MARK_KIND and s["rank"] == leader)
    lead_opt = sorted(s["end"] for s in spans if s["kind"] == "optimizer" and s["rank"] == leader)
    lo, hi = marks[0][1], lead_opt[-1]  # after step 0 (warm-up) .. the last optimizer step (before the checkpoint)
    step_s = statistics.mean(m["step_time_s"] for m in run["metrics"] if m["step"] >= 1)
    busy = {r: _union([(max(s["start"], lo), min(s["end"], hi)) for s in spans if s["rank"] == r
                       and s["kind"] not in NOT_BUSY and s["kind"] != STEP_MARK_KIND]) / (hi - lo) for r in range(nproc)}
    roles = {s["rank"]: s["role"] for s in spans}
    late = [s for s in spans if s["args"].get("step", 1) >= 1 and s["start"] >= lo]
    dur = lambda kind: [s["end"] - s["start"] for s in late if s["kind"] == kind]  # noqa: E731
    m, k = w["m"], nproc - w["rollout_ranks"]
    spread = simulate.MODES[mode][2]  # TSP: each trainer trains 1/K of a fragment's pairs
    pairs_per_span = m * w["train_steps"] / (k if spread else 1)
    mark_of = dict(marks)
    gaps = [mark_of[s["args"]["step"]] - s["end"] for s in spans if s["kind"] == "optimizer" and s["rank"] == leader
            and s["args"]["step"] < w["steps"] - 1]  # leader: optimizer end -> step mark (metrics, logging)
    # Rollout-local (ranks' clocks differ by the skew of trace.align's barrier): new weights in -> generating.
    weights_in = [s["end"] for s in spans if s["kind"] == "wait" and s["args"].get("what") == "weights"]
    starts = sorted(s["start"] for s in spans if s["kind"] == "generate")
    latency = [min((s for s in starts if s >= t), default=t) - t for t in weights_in]
    return {
        "mode": mode, "step_s": step_s, "steps_per_s": 1 / step_s, "trajectories_per_s": w["N"] / step_s,
        "pairs_per_s": w["N"] * w["train_steps"] / step_s, "busy": {f"{r}:{roles.get(r, '?')}": busy[r] for r in busy},
        "bubble": 1 - sum(busy.values()) / nproc, "wall_s": run["wall_s"],
        "tag_fragments": sum(x.get("tag_fragments", 0) for x in run["metrics"] if x["step"] >= 1),
        "stale_fragments": sum(x.get("stale_fragments", 0) for x in run["metrics"] if x["step"] >= 1),
        "op": {"generate_fragment_s": _mean(dur("generate")), "train_span_s": _mean(dur("train")),
               "f": _mean(dur("generate")) / (m * w["T"]), "b": _mean(dur("train")) / pairs_per_span,
               "recv_s": _mean(dur("recv")), "publish_s": _mean(dur("publish")), "optimizer_s": _mean(dur("optimizer")),
               "step_overhead_s": _mean(gaps), "weights_latency_s": _mean([x for x in latency if x < 1.0])},
    }


def decode_reward_s(args, samples: int) -> float:
    """Decode + reward of one fragment, timed here with one thread (the trace folds both into "generate").

    Measured in float32 (bench runs on CUDA would use bfloat16: then a rough figure)."""
    import torch

    import config as config_lib
    import models
    import rewards
    torch.set_num_threads(1)
    cfg = config_lib.Config(model=args.model)
    policy = models.load(args.model, models.tiny_pipeline_path(args.model), args.device, torch.float32)
    reward_fn = rewards.build_reward(cfg.reward, config_lib.reward_options(cfg))
    latents = torch.stack([policy.noise(torch.Generator().manual_seed(i)) for i in range(samples)])
    prompts = (rewards.color_prompts("train") * samples)[:samples]
    times = []
    for _ in range(7):
        start = time.perf_counter()
        reward_fn(policy.decode(latents), prompts)
        times.append(time.perf_counter() - start)
    return _median(times[2:])


def measured_costs(rows: list[dict], w: dict, dec_rew: float) -> simulate.Costs:
    """One set of per-op costs for every mode: the median over the modes run of each mode's mean."""
    pool = lambda key, modes=None: _median([r["op"][key] for r in rows if r["op"][key] > 0  # noqa: E731
                                            and (modes is None or r["mode"] in modes)])
    disagg = [r["mode"] for r in rows if r["mode"] != "colocated"]
    packed = [r["mode"] for r in rows if simulate.MODES[r["mode"]][2]]  # TSP: passes of tsp_pack pairs, else of m
    train_s = {w["m"]: pool("b", [r["mode"] for r in rows if r["mode"] not in packed])}
    train_s.update({w["tsp_pack"]: pool("b", packed if w["tsp_pack"] != w["m"] else None)} if packed else {})
    gen = pool("generate_fragment_s")
    return simulate.Costs(
        forward_s={w["m"]: max(gen - dec_rew, 0.0) / (w["m"] * w["T"])}, train_s={k: v for k, v in train_s.items() if v > 0},
        decode_s=dec_rew / w["m"], transfer_s=pool("recv_s", disagg), publish_s=pool("publish_s", disagg),
        optimizer_s=pool("optimizer_s", disagg), step_overhead_s=pool("step_overhead_s"),
        # only colocated has more than one training rank here: its optimizer span holds the gradient all-reduce
        allreduce_s=max(pool("optimizer_s", ["colocated"]) - pool("optimizer_s", disagg), 0.0),
        weights_latency_s=pool("weights_latency_s", disagg), name=f"tiny {w['model']} on CPU",
        provenance=f"measured by bench.py on this machine, {time.strftime('%Y-%m-%d %H:%M')}, 1 thread per rank")


def print_table(rows: list[dict], baselines: dict) -> None:
    print(f"\n{'mode':<12} {'steps/s':>7} {'traj/s':>7} {'pairs/s':>8} {'busy per rank':<26} {'bubble':>6} {'effic':>6} "
          f"{'vs coloc':>8} {'vs naive':>8} {'tag':>4} {'stale':>5} {'gen ms':>6} {'train ms':>8} {'recv ms':>7}")
    for r in rows:
        busy = " ".join(f"{k}={v:.2f}" for k, v in r["busy"].items())
        vs = lambda ref: f"{ref / r['step_s']:.2f}x" if ref else "-"  # noqa: E731
        print(f"{r['mode']:<12} {r['steps_per_s']:7.2f} {r['trajectories_per_s']:7.1f} {r['pairs_per_s']:8.1f} {busy:<26} "
              f"{r['bubble']:6.2f} {r['efficiency']:6.2f} {vs(baselines.get('colocated')):>8} {vs(baselines.get('naive')):>8} "
              f"{int(r['tag_fragments']):4d} {int(r['stale_fragments']):5d} {r['op']['generate_fragment_s'] * 1e3:6.1f} "
              f"{r['op']['train_span_s'] * 1e3:8.1f} {r['op']['recv_s'] * 1e3:7.1f}")


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names = [r["mode"] for r in rows]
    left.bar(names, [r["trajectories_per_s"] for r in rows], color="#1f77b4")
    left.set_ylabel("trajectories / s")
    right.bar(names, [r["efficiency"] for r in rows], color="#2ca02c")
    right.bar(names, [r["bubble"] for r in rows], color="#d9d9d9", width=0.4, label="bubble fraction")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_ylabel("efficiency vs the bound")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path)


def validate(rows: list[dict], w: dict, args) -> None:
    """simulate.py's step time from this run's per-op costs next to the measured one; writes costs.json."""
    dec_rew = decode_reward_s(args, w["m"])
    costs = measured_costs(rows, w, dec_rew)
    workload = simulate.Workload(groups=args.prompts_per_step, group_size=args.group_size, num_steps=args.num_steps,
                                 train_steps=w["train_steps"], fragment_groups=args.fragment_groups, tsp_pack=args.tsp_pack)
    cluster = simulate.Cluster(args.nproc, args.rollout_ranks, args.device, args.device, {args.device: 1.0})
    path = os.path.join(args.out, "costs.json")
    with open(path, "w") as fh:
        json.dump({"costs": costs.__dict__, "workload": workload.__dict__, "cluster": cluster.__dict__}, fh, indent=1)
    named = [("f", costs.forward_s[w["m"]]), *[(f"b@{k}", v) for k, v in costs.train_s.items()],
             ("decode+reward/fragment", dec_rew), ("recv/fragment", costs.transfer_s), ("publish", costs.publish_s),
             ("optimizer", costs.optimizer_s), ("all-reduce (colocated)", costs.allreduce_s),
             ("step overhead", costs.step_overhead_s), ("weights in -> generating", costs.weights_latency_s)]
    print(f"\n[validate] per-op costs (median over the modes of each mode's mean; {path}):")
    print("  " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in named))
    print(f"  {'mode':<12} {'measured':>9} {'simulated':>9} {'error':>7}")
    for r in rows:
        sim = simulate.simulate(r["mode"], costs, cluster, workload)
        r["simulated_step_s"], r["simulation_error"] = sim.step_s, sim.step_s / r["step_s"] - 1
        print(f"  {r['mode']:<12} {r['step_s'] * 1e3:7.0f}ms {sim.step_s * 1e3:7.0f}ms {r['simulation_error']:+7.1%}")


def run_bench(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in simulate.MODES:
            raise SystemExit(f"error: unknown mode {mode!r}; known: {', '.join(simulate.MODES)}")
    import models  # build the tiny pipeline once, outside the timed runs
    from rollout import SamplingConfig, num_train_timesteps
    models.tiny_pipeline_path(args.model)
    t_train = num_train_timesteps(SamplingConfig(num_steps=args.num_steps, timestep_fraction=args.timestep_fraction))
    w = {"model": args.model, "nproc": args.nproc, "rollout_ranks": args.rollout_ranks,
         "m": args.fragment_groups * args.group_size, "N": args.prompts_per_step * args.group_size, "T": args.num_steps,
         "train_steps": t_train, "tsp_pack": args.tsp_pack, "steps": args.steps}
    load = os.getloadavg()[0]
    rows = []
    for mode in modes:
        print(f"[bench] {mode}: python main.py {' '.join(mode_flags(mode))} ...", flush=True)
        rows.append(analyse(mode, run_mode(mode, args), w))
    ref = next((r for r in rows if r["mode"] == "naive"), rows[0])
    f, b = ref["op"]["f"], ref["op"]["b"]
    bound = (w["N"] * w["T"] * f + w["N"] * t_train * b) / args.nproc
    baselines = {r["mode"]: r["step_s"] for r in rows if r["mode"] in ("colocated", "naive")}
    for r in rows:
        r["efficiency"] = bound / r["step_s"]
        r.update({f"speedup_vs_{k}": v / r["step_s"] for k, v in baselines.items()})
    print(f"\n[bench] {args.model}, P={args.nproc} (R={args.rollout_ranks}), B={args.prompts_per_step} G={args.group_size} "
          f"T={args.num_steps} T_train={t_train}, {args.steps} steps (step 0 excluded), "
          f"fragment = {args.fragment_groups} group(s)")
    print(f"[bench] bound (N T f + N T_train b)/P = {bound * 1e3:.0f} ms with f = {f * 1e3:.2f} ms, b = {b * 1e3:.2f} ms "
          f"(reference mode: {ref['mode']}); load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_table(rows, baselines)
    result = {"workload": w, "bound_s": bound, "f": f, "b": b, "reference_mode": ref["mode"], "rows": rows,
              "load_average": [load, os.getloadavg()[0]], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.validate:
        validate(rows, w, args)
    for r in rows:
        r.pop("wall_s", None)
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    plot(rows, os.path.join(args.out, "bench.png"))
    print(f"\n[bench] wrote {args.out}/bench.json and bench.png")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small CPU setting: " + json.dumps(QUICK))
    p.add_argument("--modes", default=",".join(simulate.MODES), help="comma-separated subset of " + ",".join(simulate.MODES))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rollout-ranks", type=int, default=1)
    p.add_argument("--model", default="flux")
    p.add_argument("--steps", type=int, default=8, help="RL steps per mode (step 0 is warm-up)")
    p.add_argument("--num-steps", type=int, default=8, help="T: sampling steps")
    p.add_argument("--timestep-fraction", type=float, default=0.75)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--fragment-groups", type=int, default=1)
    p.add_argument("--tsp-pack", type=int, default=4, help="pairs per forward under TSP (main.py --tsp-pack)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("bench_runs", time.strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--validate", action="store_true", help="also print simulate.py's step time from this run's per-op costs")
    p.add_argument("--size", choices=sorted(gpu_check.gpu_sizes()),
                   help="GPU check instead of the mode bench (flux-12b needs --device cuda; tiny runs anywhere)")
    if p.parse_known_args(argv)[0].quick:  # --quick sets defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if args.size:
        return gpu_check.gpu_check(args.size, args.device, args.out)
    start = time.perf_counter()
    run_bench(args)
    print(f"[bench] total wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
