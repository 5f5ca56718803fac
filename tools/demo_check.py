"""Run the default demo (`python main.py --model flux`, DigenRL on 2 CPU ranks) for several seeds and print what a
reader should see: the evaluation on held-out seeds before and after, when it first reached 0.4, and the wall time.

    python tools/demo_check.py                          # seeds 0 1 2, the cached tiny pipeline
    python tools/demo_check.py --fresh-cache --docs     # first run builds (and pre-trains) the pipeline; seed 0's
                                                        # before_after.png and reward_curve.png go to docs/
    python tools/demo_check.py --model wan --seeds 0    # a video family (GIFs)

Wall time is the whole `python main.py` process (pipeline build included when the cache is fresh). The machine
load (1-minute load average) before and after each run is printed too: timings on a shared machine are upper
bounds. Extra arguments after `--` go to main.py unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.4  # the eval reward the demo must reach (colour task, reward in [-1, 1])


def run_demo(model: str, seed: int, out_dir: str, cache: str, extra: list[str]) -> dict:
    name = f"{model}-seed{seed}"
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--model", model, "--seed", str(seed), "--out-dir", out_dir,
           "--run-name", name, "--no-progress", *extra]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [(r["step"] + 1, r["eval_reward"]) for r in rows if "eval_reward" in r]
    reached = next((step for step, value in evals if value >= TARGET), None)
    built = "[pretrain]" in proc.stdout + proc.stderr
    return {"seed": seed, "wall_s": wall, "built_pipeline": built, "steps": len(rows),
            "eval_before": rows[0].get("eval_reward_initial", float("nan")), "eval_after": evals[-1][1],
            "heldout_after": next((r["eval_reward_heldout_prompts"] for r in reversed(rows)
                                   if "eval_reward_heldout_prompts" in r), float("nan")),
            "first_step_at_target": reached, "train_s": sum(r["step_time_s"] for r in rows),
            "load_before": load_before, "load_after": os.getloadavg()[0], "run_dir": os.path.join(out_dir, name)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "demo_check"))
    parser.add_argument("--fresh-cache", action="store_true", help="build the tiny pipeline in a new cache (timed)")
    parser.add_argument("--docs", action="store_true", help="copy the first seed's figures into docs/")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    cache = tempfile.mkdtemp(prefix="digenrl-demo-cache-") if args.fresh_cache else os.environ.get(
        "DIGENRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "digenrl"))
    os.makedirs(args.out_dir, exist_ok=True)
    results = []
    for seed in args.seeds:
        shutil.rmtree(os.path.join(args.out_dir, f"{args.model}-seed{seed}"), ignore_errors=True)
        results.append(run_demo(args.model, seed, args.out_dir, cache, extra))
        r = results[-1]
        print(f"seed {seed}: eval_reward {r['eval_before']:+.3f} -> {r['eval_after']:+.3f} (held-out prompts "
              f"{r['heldout_after']:+.3f}), >= {TARGET} from step {r['first_step_at_target']}, wall {r['wall_s']:.0f} s"
              f"{' (pipeline built)' if r['built_pipeline'] else ''}", flush=True)
    print(f"\n| seed | eval before | eval after | held-out prompts after | first step >= {TARGET} | steps | "
          "wall time (s) | of which training steps (s) | load avg before/after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        wall = f"{r['wall_s']:.0f}" + (" (incl. build)" if r["built_pipeline"] else "")
        print(f"| {r['seed']} | {r['eval_before']:+.3f} | {r['eval_after']:+.3f} | {r['heldout_after']:+.3f} | "
              f"{r['first_step_at_target']} | {r['steps']} | {wall} | {r['train_s']:.0f} | "
              f"{r['load_before']:.1f} / {r['load_after']:.1f} |")
    if args.docs:
        first = results[0]["run_dir"]
        ext = "gif" if os.path.exists(os.path.join(first, "before_after.gif")) else "png"
        docs = os.path.join(ROOT, "docs")
        shutil.copy(os.path.join(first, f"before_after.{ext}"), os.path.join(docs, f"demo_{args.model}_before_after.{ext}"))
        shutil.copy(os.path.join(first, "reward_curve.png"), os.path.join(docs, f"demo_{args.model}_reward_curve.png"))
        print(f"\ncopied {first}/before_after.{ext} and reward_curve.png to docs/demo_{args.model}_*")
    if args.fresh_cache:
        shutil.rmtree(cache, ignore_errors=True)
    failed = [r["seed"] for r in results if r["first_step_at_target"] is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
