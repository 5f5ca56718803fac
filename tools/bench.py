"""Every placement/mechanism mode side by side, same model, seed and batch (docs/DESIGN.md section 6).

    python tools/bench.py --quick --validate            # tiny FLUX, 2 CPU ranks, 6 modes; + simulate.py
    python tools/bench.py --quick --hetero 0=0.5        # + rank 0 at half speed: measured vs predicted
    python tools/bench.py --modes naive,digenrl --nproc 4 --rollout-ranks 2 --steps 10
    python tools/bench.py --device cuda --size flux-12b  # GPU check: overhead vs the bare transformer

Each mode runs main.py's job (`python main.py ... --trace`, its ranks forked from this process: tools/main_job.py,
one import of torch and diffusers for every mode); its trace.json is parsed back into spans and its
metrics.jsonl gives the step times (step 0 is warm-up and excluded). Per mode: steps/s,
trajectories/s, trained pairs/s, busy fraction per rank (union of spans other than "wait" and the
background "send" thread, inside the measured window), bubble fraction, efficiency (work priced at
the cheapest per-op costs any mode of this run measured, over P x the window: never above 1, see
tools/bench_analysis.py) and speedups. --hetero reruns some modes with `main.py --rank-speed`
(infra/emulate.py: a benchmark-only emulation of slower ranks) and prints simulate.py's prediction
for them from THIS run's homogeneous per-op costs. Writes bench.json, costs.json (per-op costs for
simulate.py) and bench.png into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra import emulate  # noqa: E402
from tools import gpu_check, main_job, simulate  # noqa: E402
from tools.bench_analysis import (_median, analyse, cheapest_costs, efficiency,  # noqa: E402
                                  load_spans, measured_costs, mode_costs)

# Tuned on this 2-core machine (with simulate.py): fragments of 2 groups (2 fragments per step) amortise
# the ~14 ms a fragment takes to cross gloo; T_train = 9 of T = 24 balances generation and training on
# 1 rollout + 1 trainer rank with two updates per batch (2026-12-03, docs/RESULTS.md section 2: at 8
# DigenRL was rollout-bound, trainer busy 0.90; at 10 trainer-bound, 0.98, and TAG never acted).
QUICK = dict(model="flux", steps=8, num_steps=24, timestep_fraction=0.38, prompts_per_step=4,
             group_size=4, fragment_groups=2, tsp_pack=8, nproc=2, rollout_ranks=1)
HETERO_MODES = "colocated,naive,digenrl"


def mode_flags(mode: str) -> list[str]:
    placement, gap, tsp, tag, use_tcss = simulate.MODES[mode]
    if mode in ("colocated", "naive", "digenrl"):
        return ["--mode", mode]
    flags = (("--gap", gap), ("--tsp", tsp), ("--tag", tag), ("--tcss", use_tcss))
    return ["--placement", placement] + [flag for flag, on in flags if on]


def run_mode(mode: str, args, out: str, extra: tuple = ()) -> dict:
    run_dir = os.path.join(out, mode)
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start clean
    argv = [*mode_flags(mode), "--model", args.model,
            "--steps", str(args.steps), "--num-steps", str(args.num_steps),
            "--timestep-fraction", str(args.timestep_fraction),
            "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
            "--fragment-groups", str(args.fragment_groups), "--tsp-pack", str(args.tsp_pack),
            "--updates-per-batch", str(args.updates_per_batch),
            "--nproc", str(args.nproc), "--rollout-ranks", str(args.rollout_ranks),
            "--seed", str(args.seed), "--device", args.device, "--trace", "--no-progress",
            "--eval-every", "0", "--save-every", "0", "--threads", "1", "--run-name", mode,
            "--out-dir", out, *extra]
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks' (and their forkserver's), as every mode's run had
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # the job's output: its tail names a failure
        log = os.path.join(tmp, "main.log")
        code = main_job.run(argv, stdout=log, stderr=log)  # `python main.py argv`, ranks forked here
        if code != 0:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"mode {mode} failed ({code}; python main.py {' '.join(argv)}):\n"
                                   f"{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    return {"spans": load_spans(os.path.join(run_dir, "trace.json")), "metrics": metrics,
            "wall_s": time.perf_counter() - start}


def inprocess_costs(args, w: dict) -> dict:
    """Timed in one process, one thread, the other core idle: decode + reward of one fragment (the trace folds both
    into "generate"), and generating one group vs one fragment through rollout.generate_fragment. On a CPU
    a forward's fixed per-call cost dominates, so one group costs far more than half a 2-group fragment;
    the simulator needs that shape for TAG's group-sized shares. Measured in float32 (bench runs on
    CUDA would use bfloat16: then rough figures)."""
    import torch

    import config as config_lib
    import models
    import rewards
    import rollout
    from fragment import fragment_spec
    torch.set_num_threads(1)
    cfg = config_lib.Config(model=args.model)
    policy = models.load(args.model, models.tiny_pipeline_path(args.model), args.device, torch.float32)
    reward_fn = rewards.build_reward(cfg.reward, rewards.RewardOptions.of(cfg))
    m = w["m"]
    latents = torch.stack([policy.noise(torch.Generator().manual_seed(i)) for i in range(m)])
    prompts = (rewards.color_prompts("train") * m)[:m]
    sampling = rollout.SamplingConfig(args.num_steps, 0.5, args.timestep_fraction, "flow_grpo", 5.0)

    def timed(op, repeats=7) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        return _median(times[2:])

    gen_s = {}
    for groups in sorted({1, args.fragment_groups}):
        spec = fragment_spec(args.seed, 1, 0, groups, len(prompts), args.prompts_per_step, args.group_size)
        gen_s[groups * args.group_size] = timed(
            lambda: rollout.generate_fragment(policy, spec, prompts, sampling, reward_fn, 0, 0), 5)
    return {"decode_reward_s": timed(lambda: reward_fn(policy.decode(latents), prompts)), "generate_s": gen_s}


def print_table(rows: list[dict], baselines: dict) -> None:
    print(f"\n{'mode':<12} {'steps/s':>7} {'traj/s':>7} {'pairs/s':>8} {'busy per rank':<26} "
          f"{'bubble':>6} {'effic':>6} {'vs coloc':>8} {'vs naive':>8} {'tag':>4} {'stale':>5} "
          f"{'gen ms':>6} {'train ms':>8} {'recv ms':>7}")
    for r in rows:
        busy = " ".join(f"{k}={v:.2f}" for k, v in r["busy"].items())
        vs = lambda ref: f"{ref / r['step_s']:.2f}x" if ref else "-"  # noqa: E731
        print(f"{r['mode']:<12} {r['steps_per_s']:7.2f} {r['trajectories_per_s']:7.1f} "
              f"{r['pairs_per_s']:8.1f} {busy:<26} {r['bubble']:6.2f} {r['efficiency']:6.2f} "
              f"{vs(baselines.get('colocated')):>8} {vs(baselines.get('naive')):>8} "
              f"{int(r['tag_fragments']):4d} {int(r['stale_fragments']):5d} "
              f"{r['op']['generate_fragment_s'] * 1e3:6.1f} {r['op']['train_span_s'] * 1e3:8.1f} "
              f"{r['op']['recv_s'] * 1e3:7.1f}")


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
    right.set_ylabel("efficiency (cheapest-cost work / capacity)")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path)


def sim_setup(args, w: dict, rank_speed: dict | None = None):
    workload = simulate.Workload(groups=args.prompts_per_step, group_size=args.group_size,
                                 num_steps=args.num_steps, train_steps=w["train_steps"],
                                 fragment_groups=args.fragment_groups, tsp_pack=args.tsp_pack,
                                 tsp_span=True,  # the runtime's --tsp-span default
                                 tag_split="group-claims",  # the runtime's TAG: groups split by trajectories
                                 updates_per_batch=args.updates_per_batch)
    cluster = simulate.Cluster(args.nproc, args.rollout_ranks, args.device, args.device,
                               {args.device: 1.0}, dict(rank_speed or {}))
    return workload, cluster


def validate(rows: list[dict], w: dict, args) -> tuple[simulate.Costs, dict]:
    """simulate.py's step time from this run's per-op costs beside the measured one; writes costs.json."""
    # on the CPU in a process forked from the modes' forkserver, which imported diffusers and the pipeline already
    inproc = main_job.forked(inprocess_costs, args, w, model=args.model) if args.device == "cpu" \
        else inprocess_costs(args, w)
    costs = measured_costs(rows, w, inproc)
    workload, cluster = sim_setup(args, w)
    path = os.path.join(args.out, "costs.json")
    with open(path, "w") as fh:
        json.dump({"costs": costs.__dict__, "workload": workload.__dict__, "cluster": cluster.__dict__},
                  fh, indent=1)
    named = [*[(f"f@{k}", v) for k, v in sorted(costs.forward_s.items())],
             *[(f"b@{k}", v) for k, v in costs.train_s.items()],
             ("decode+reward/fragment", inproc["decode_reward_s"]), ("recv/fragment", costs.transfer_s),
             ("publish", costs.publish_s), ("optimizer", costs.optimizer_s),
             ("all-reduce (colocated)", costs.allreduce_s), ("step overhead", costs.step_overhead_s),
             ("weights in -> generating", costs.weights_latency_s)]
    print(f"\n[validate] per-op costs (median over the modes of each mode's mean; {path}):")
    print("  " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in named))
    print("  generating one group vs one fragment, one thread, nothing else running: "
          + ", ".join(f"{b} samples {s * 1e3:.1f} ms" for b, s in sorted(inproc["generate_s"].items())))
    own = {r["mode"]: mode_costs(costs, r, w, inproc) for r in rows}
    compare(rows, costs, own, workload, cluster)
    return costs, own


def compare(rows, pooled, own, workload, cluster) -> None:
    """Simulated step time per mode, from the mode's own op costs (the error column) and from the pooled ones."""
    print(f"  {'mode':<12} {'measured':>9} {'sim (own)':>9} {'error':>7} {'sim (pooled)':>12} {'error':>7}")
    for r in rows:
        sim = simulate.simulate(r["mode"], own[r["mode"]], cluster, workload)
        pool = simulate.simulate(r["mode"], pooled, cluster, workload)
        r["simulated_step_s"], r["simulation_error"] = sim.step_s, sim.step_s / r["step_s"] - 1
        r["simulated_pooled_step_s"] = pool.step_s
        print(f"  {r['mode']:<12} {r['step_s'] * 1e3:7.0f}ms {sim.step_s * 1e3:7.0f}ms "
              f"{r['simulation_error']:+7.1%} {pool.step_s * 1e3:10.0f}ms {pool.step_s / r['step_s'] - 1:+7.1%}")


def median_run(rows: list[dict]) -> dict:
    """Of repeated runs of one mode, the one with the median step time (with 2, the slower); it keeps
    `step_s_runs`, every run's step time."""
    ordered = sorted(rows, key=lambda r: r["step_s"])
    return {**ordered[len(ordered) // 2], "step_s_runs": [r["step_s"] for r in rows]}


def hetero(args, w: dict, costs: simulate.Costs, own: dict, rows: list[dict]) -> list[dict]:
    """The --hetero case: the runs with slowed ranks next to simulate.py's prediction from the homogeneous
    runs' costs (nothing of the slowed runs feeds the prediction)."""
    speeds = emulate.check_rank_speed(args.hetero, args.nproc)
    workload, cluster = sim_setup(args, w, speeds)
    print(f"\n[hetero] rank speeds {speeds} (emulated: infra/emulate.py pads each generate/train op); "
          "simulated from the homogeneous run's per-op costs (each mode's own, and pooled):")
    compare(rows, costs, {r["mode"]: own.get(r["mode"], costs) for r in rows}, workload, cluster)
    by = {r["mode"]: r for r in rows}
    if "colocated" in by and "digenrl" in by:
        ratio = lambda key: by["colocated"][key] / by["digenrl"][key]  # noqa: E731
        print(f"  DigenRL vs colocated: measured {ratio('step_s'):.2f}x, "
              f"simulated {ratio('simulated_step_s'):.2f}x")
    return rows


def run_bench(args) -> dict:
    modes = args.modes.split(",")
    for mode in modes + (args.hetero_modes.split(",") if args.hetero else []):
        if mode not in simulate.MODES:
            raise SystemExit(f"error: unknown mode {mode!r}; known: {', '.join(simulate.MODES)}")
    if args.repeat < 1:
        raise SystemExit(f"error: --repeat {args.repeat}: the number of rounds must be >= 1")
    if args.hetero:
        try:
            emulate.check_rank_speed(args.hetero, args.nproc)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    os.makedirs(args.out, exist_ok=True)
    import models  # build the tiny pipeline once, outside the timed runs
    from rollout import SamplingConfig, num_train_timesteps
    models.tiny_pipeline_path(args.model)
    t_train = num_train_timesteps(SamplingConfig(num_steps=args.num_steps,
                                                 timestep_fraction=args.timestep_fraction))
    w = {"model": args.model, "nproc": args.nproc, "rollout_ranks": args.rollout_ranks,
         "m": args.fragment_groups * args.group_size, "N": args.prompts_per_step * args.group_size,
         "T": args.num_steps, "train_steps": t_train, "tsp_pack": args.tsp_pack, "steps": args.steps}
    load = os.getloadavg()[0]
    # --hetero: each mode's slowed run right after its homogeneous one, so that a drift of this machine's
    # speed (+-10-15% over tens of seconds, measured) hits the run and its prediction alike; --repeat: rounds
    # of every mode, interleaved, and per mode the run with the median step time is reported.
    hetero_modes = args.hetero_modes.split(",") if args.hetero else []
    runs, slowed_runs = {}, {}
    for k in range(args.repeat):
        out = args.out if args.repeat == 1 else os.path.join(args.out, f"round{k}")
        for mode in modes + [m for m in hetero_modes if m not in modes]:
            if mode in modes:
                print(f"[bench] {mode}: python main.py {' '.join(mode_flags(mode))} ...", flush=True)
                runs.setdefault(mode, []).append(analyse(mode, run_mode(mode, args, out), w))
            if mode in hetero_modes:
                print(f"[bench] {mode} with --rank-speed {args.hetero} ...", flush=True)
                slowed_runs.setdefault(mode, []).append(
                    analyse(mode, run_mode(mode, args, os.path.join(out, "hetero"), ("--rank-speed", args.hetero)), w))
    rows = [median_run(runs[mode]) for mode in modes]
    slowed = [median_run(slowed_runs[mode]) for mode in hetero_modes]
    f, b, f_mode, b_mode = cheapest_costs(rows)
    bound = (w["N"] * w["T"] * f + w["N"] * t_train * b) / args.nproc
    baselines = {r["mode"]: r["step_s"] for r in rows if r["mode"] in ("colocated", "naive")}
    for r in rows:
        r["efficiency"] = efficiency(r, f, b)
        r.update({f"speedup_vs_{k}": v / r["step_s"] for k, v in baselines.items()})
    print(f"\n[bench] {args.model}, P={args.nproc} (R={args.rollout_ranks}), B={args.prompts_per_step} "
          f"G={args.group_size} T={args.num_steps} T_train={t_train}, {args.steps} steps (step 0 "
          f"excluded), fragment = {args.fragment_groups} group(s)"
          + (f"; per mode the median of {args.repeat} interleaved runs" if args.repeat > 1 else ""))
    print(f"[bench] bound (N T f + N T_train b)/P = {bound * 1e3:.0f} ms with the cheapest costs "
          f"measured: f = {f * 1e3:.3f} ms ({f_mode}), b = {b * 1e3:.3f} ms ({b_mode}); load "
          f"average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_table(rows, baselines)
    result = {"workload": w, "bound_s": bound, "f": f, "b": b, "f_mode": f_mode, "b_mode": b_mode,
              "rows": rows, "load_average": [load, os.getloadavg()[0]],
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.validate or args.hetero:
        costs, own = validate(rows, w, args)
        if args.hetero:
            result["hetero"] = {"rank_speed": args.hetero, "rows": hetero(args, w, costs, own, slowed)}
    result["repeat"] = args.repeat
    for r in rows + result.get("hetero", {}).get("rows", []):
        r.pop("wall_s", None)
    with open(os.path.join(args.out, "bench.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    plot(rows, os.path.join(args.out, "bench.png"))
    print(f"\n[bench] wrote {args.out}/bench.json and bench.png")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small CPU setting: " + json.dumps(QUICK))
    p.add_argument("--modes", default=",".join(simulate.MODES),
                   help="comma-separated subset of " + ",".join(simulate.MODES))
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
    p.add_argument("--updates-per-batch", type=int, default=2,
                   help="M: optimizer steps per batch (main.py's default, Flow-GRPO's 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every mode, interleaved; each mode reports its median run: this machine's "
                        "speed drifts, more rounds cost time and steady the table")
    p.add_argument("--out", default=os.path.join("bench_runs", time.strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--validate", action="store_true",
                   help="also print simulate.py's step time from this run's per-op costs")
    p.add_argument("--hetero", metavar="RANK=FACTOR,...",
                   help="also rerun --hetero-modes with main.py --rank-speed (emulated slow ranks) "
                        "and print simulate.py's prediction for them")
    p.add_argument("--hetero-modes", default=HETERO_MODES, help="modes of the --hetero case")
    p.add_argument("--size", choices=sorted(gpu_check.gpu_sizes()),
                   help="GPU check instead of the mode bench (flux-12b needs --device cuda)")
    if p.parse_known_args(argv)[0].quick:  # --quick sets defaults; explicit flags still win
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
