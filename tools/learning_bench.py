"""Learning per wall-clock second: the default demo per mode and seed, then compare_runs' table.

    python tools/learning_bench.py                               # 4 modes x 3 seeds, 200 steps each
    python tools/learning_bench.py --modes colocated,digenrl --seeds 0 --steps 20 --out /tmp/lb

Runs `python main.py <mode flags> --seed S --steps N --eval-every 0 --save-every 0` (every other
setting is the default demo's; the ranks forked from this process, tools/main_job.py) into
OUT/<mode>-s<seed>, one run at a time so runs never share the CPU, skipping runs that already
finished (--force reruns them). Then prints, per mode over its seeds, the wall-clock seconds to
reach colocated's final reward and the reward reached at the shortest run's wall clock, and writes
OUT/reward_curves.png, OUT/reward_curves_wall.png and OUT/time_to_reward.json. Timings are only
comparable on a quiet machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import compare_runs, main_job  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODE_FLAGS = {"colocated": ["--mode", "colocated"], "naive": ["--mode", "naive"],
              "digenrl": ["--mode", "digenrl"], "digenrl-sync": ["--mode", "digenrl", "--no-tcss"]}


def finished(run_dir: str, steps: int) -> bool:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return sum(1 for line in f if line.strip()) >= steps


def print_final_eval(specs: list[str]) -> None:
    """Per mode, each seed's last eval_reward (runs with -- --eval-every K > 0 evaluate at their last step)."""
    finals: dict[str, list[str]] = {}
    for spec in specs:
        mode, run_dir = spec.split("=", 1)
        rows = [r for r in compare_runs.read_rows(run_dir) if "eval_reward" in r]
        finals.setdefault(mode, []).append(f"{rows[-1]['eval_reward']:.3f}" if rows else "-")
    if any(v != "-" for values in finals.values() for v in values):
        print("| mode | final eval_reward per seed |\n|---|---|")
        for mode, values in finals.items():
            print(f"| {mode} | {' / '.join(values)} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(MODE_FLAGS),
                   help="comma-separated: " + ", ".join(MODE_FLAGS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200, help="RL steps per run (the default demo's)")
    p.add_argument("--out", default=os.path.join("runs", "learning_bench"))
    p.add_argument("--window", type=int, default=10, help="trailing mean of the reward curves")
    p.add_argument("--target", default="colocated",
                   help="a reward, or the mode whose final reward is the target")
    p.add_argument("--force", action="store_true", help="rerun runs that already finished")
    p.add_argument("extra", nargs="*", help="more main.py flags after --, e.g. -- --lr 1e-3")
    args = p.parse_args(argv)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    bad = [m for m in modes if m not in MODE_FLAGS]
    if bad:
        print(f"error: unknown mode {bad[0]!r}; known: {', '.join(MODE_FLAGS)}", file=sys.stderr)
        return 2
    specs = []
    for seed in seeds:  # seed-major: a load change on the machine hits every mode alike
        for mode in modes:
            name = f"{mode}-s{seed}"
            run_dir = os.path.join(args.out, name)
            specs.append(f"{mode}={run_dir}")
            if finished(run_dir, args.steps) and not args.force:
                print(f"[learning] {name}: done already", flush=True)
                continue
            cmd = [sys.executable, os.path.join(ROOT, "main.py"), *MODE_FLAGS[mode], "--seed", str(seed),
                   "--steps", str(args.steps), "--eval-every", "0", "--save-every", "0", "--no-progress",
                   "--threads", "1", "--run-name", name, "--out-dir", args.out, *args.extra]
            print(f"[learning] {name}: {' '.join(cmd[1:])}", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished run starts over
            os.environ["OMP_NUM_THREADS"] = "1"  # the ranks' (and their forkserver's), as every run had
            code = main_job.run(cmd[2:], stdout=os.devnull)  # `python main.py ...`, its ranks forked here
            if code != 0:
                raise subprocess.CalledProcessError(code, cmd)
    print_final_eval(specs)
    walls = [compare_runs.wall_clock(compare_runs.read_rows(s.split("=", 1)[1]))[-1] for s in specs]
    return compare_runs.main(specs + ["--out", os.path.join(args.out, "reward_curves.png"),
                                      "--window", str(args.window), "--target-reward", args.target,
                                      "--at-wall-s", f"{min(walls):.3f}",
                                      "--json", os.path.join(args.out, "time_to_reward.json")])


if __name__ == "__main__":
    raise SystemExit(main())
