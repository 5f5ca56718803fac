"""Compare finished runs: every reward curve in one PNG, and a table of what each run learned and cost.

    python main.py --mode digenrl --steps 150 --seed 1 --run-name async          # TCSS on (the default mode)
    python main.py --mode digenrl --no-async --steps 150 --seed 1 --run-name sync
    python compare_runs.py runs/async runs/sync --out runs/async_vs_sync.png --window 10

Use it to check that an optimisation leaves learning intact (TCSS trains some fragments one version
late; the curve should stay close to the synchronous one) and to see what it bought in step time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys


if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra.rundir import plot_reward_curves  # noqa: E402


def read_rows(run_dir: str) -> list[dict]:
    import json

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir!r} is not a run directory: it has no metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def summary(rows: list[dict], tail: float) -> dict:
    """Reward at the start and over the last `tail` fraction of steps, step time, staleness, TAG."""
    n = len(rows)
    last = rows[max(n - max(int(n * tail), 1), 0):]
    first = rows[:max(int(n * tail), 1)]
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    return {
        "steps": n,
        "reward_first": statistics.fmean(r["reward_mean"] for r in first),
        "reward_last": statistics.fmean(r["reward_mean"] for r in last),
        "eval_last": evals[-1] if evals else float("nan"),
        "step_time_s": statistics.median(r["step_time_s"] for r in rows[1:] or rows),
        "stale_frac": statistics.fmean(r.get("stale_frac", 0.0) for r in rows),
        "max_staleness": max(r.get("staleness_mean", 0.0) for r in rows),
        "tag_fragments": sum(r.get("tag_fragments", 0.0) for r in rows),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (label = directory name, or LABEL=DIR)")
    parser.add_argument("--out", default=None, help="PNG path (default: reward_curves.png beside the first run)")
    parser.add_argument("--window", type=int, default=1, help="moving-average window for the curves (1 = raw)")
    parser.add_argument("--tail", type=float, default=0.2, help="fraction of steps averaged for first/last reward")
    args = parser.parse_args(argv)
    if args.window < 1 or not 0 < args.tail <= 1:
        print(f"error: --window must be >= 1 (got {args.window}) and --tail in (0, 1] (got {args.tail})", file=sys.stderr)
        return 2
    paths = {}  # label -> run directory
    for spec in args.runs:
        label, _, path = spec.rpartition("=") if "=" in spec else (os.path.basename(spec.rstrip("/")), "", spec)
        paths[label] = path
    try:
        runs = {label: read_rows(path) for label, path in paths.items()}
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(os.path.dirname(next(iter(paths.values())).rstrip("/")) or ".", "reward_curves.png")
    plot_reward_curves(runs, out, eval_too=True, window=args.window, title=" vs ".join(runs))
    tail = f"{int(args.tail * 100)}%"
    w = max(16, max(len(label) for label in runs) + 2)
    print(f"{'run':<{w}}{'steps':>6}{'reward first ' + tail:>20}{'reward last ' + tail:>19}{'eval last':>11}"
          f"{'step s':>9}{'stale frac':>11}{'max stale':>10}{'tag frags':>10}")
    for label, rows in runs.items():
        s = summary(rows, args.tail)
        print(f"{label:<{w}}{s['steps']:>6}{s['reward_first']:>20.4f}{s['reward_last']:>19.4f}{s['eval_last']:>11.4f}"
              f"{s['step_time_s']:>9.3f}{s['stale_frac']:>11.3f}{s['max_staleness']:>10.2f}{s['tag_fragments']:>10.0f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
