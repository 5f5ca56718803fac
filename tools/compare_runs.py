"""Compare finished runs: reward per step and per wall-clock second, what each run learned, what it
cost, and the time each mode takes to reach a reward (over seeds).

    python main.py --mode digenrl --steps 150 --seed 1 --run-name tcss           # TCSS on (default)
    python main.py --mode digenrl --no-tcss --steps 150 --seed 1 --run-name sync
    python tools/compare_runs.py runs/tcss runs/sync --out runs/tcss_vs_sync.png --window 10

    # time to reward: repeat a label for its seeds (LABEL=DIR); the target may be a number or a
    # label (the mean final smoothed reward of that label's runs)
    python tools/compare_runs.py digenrl=runs/d0 digenrl=runs/d1 colocated=runs/c0 colocated=runs/c1 \\
        --window 10 --target-reward colocated --at-wall-s 60
    python tools/learning_bench.py      # runs the default demo per mode and seed, then this table

Wall clock per metrics row: its `wall_s` field when the run logs one, else the cumulative
step_time_s (main.py keeps evaluation and checkpointing out of step_time_s). Time to reward = the
wall clock of the first step whose trailing --window mean reward reaches the target. Writes two
PNGs: reward per step (--out) and reward per wall-clock second (*_wall.png, one line per run).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from infra.rundir import atomic_write, plot_reward_curves, smooth  # noqa: E402


def read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir!r} is not a run directory: it has no metrics.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no steps yet")
    return rows


def wall_clock(rows: list[dict]) -> list[float]:
    """Seconds since the run started at the end of each row's step."""
    if all("wall_s" in r for r in rows):
        return [float(r["wall_s"]) for r in rows]
    return list(itertools.accumulate(float(r["step_time_s"]) for r in rows))


def time_to_reward(rows: list[dict], target: float, window: int) -> float | None:
    """Wall clock of the first step whose trailing `window`-step mean reward >= target (None: never)."""
    curve = smooth([r["reward_mean"] for r in rows], window)
    return next((t for t, v in zip(wall_clock(rows), curve) if v >= target), None)


def reward_at(rows: list[dict], wall_s: float, window: int) -> float | None:
    """The trailing-mean reward at the last step ended by `wall_s` (None: no step by then)."""
    curve = smooth([r["reward_mean"] for r in rows], window)
    done = [v for t, v in zip(wall_clock(rows), curve) if t <= wall_s]
    return done[-1] if done else None


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
        "clipfrac": statistics.fmean(r.get("clipfrac", 0.0) for r in rows),
    }


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return f"{mean:.3g} +- {std:.2g} [{min(values):.3g}, {max(values):.3g}]"


def learning_table(groups: dict, target: float | None, at_wall_s: float | None, window: int) -> dict:
    """Per label (its runs = seeds): final reward, wall clock, time to `target`, reward at `at_wall_s`."""
    out = {}
    for label, runs in groups.items():
        finals = [smooth([r["reward_mean"] for r in rows], window)[-1] for rows in runs]
        entry = {"runs": len(runs), "final_reward": finals,
                 "wall_s": [wall_clock(rows)[-1] for rows in runs]}
        if target is not None:
            entry["time_to_target_s"] = [time_to_reward(rows, target, window) for rows in runs]
        if at_wall_s is not None:
            entry["reward_at_wall"] = [reward_at(rows, at_wall_s, window) for rows in runs]
        out[label] = entry
    return out


def plot_wall(groups: dict, path: str, window: int, target: float | None) -> None:
    """Reward (trailing mean) per wall-clock second: one colour per label, one line per run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    styles = ["-", "--", ":", "-."]
    for i, (label, runs) in enumerate(groups.items()):
        for j, rows in enumerate(runs):
            ax.plot(wall_clock(rows), smooth([r["reward_mean"] for r in rows], window),
                    styles[j % len(styles)], color=f"C{i}", label=label if j == 0 else None)
    if target is not None:
        ax.axhline(target, color="black", linewidth=0.8, label=f"target {target:.3f}")
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel("reward" if window == 1 else f"reward ({window}-step mean)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (label = directory name, or LABEL=DIR; "
                                                "repeat a LABEL for its seeds)")
    parser.add_argument("--out", default=None, help="PNG path (default: reward_curves.png beside the first run)")
    parser.add_argument("--window", type=int, default=1, help="moving-average window for the curves (1 = raw)")
    parser.add_argument("--tail", type=float, default=0.2, help="fraction of steps averaged for first/last reward")
    parser.add_argument("--target-reward",
                        help="a reward, or a LABEL: the mean final smoothed reward of its runs")
    parser.add_argument("--at-wall-s", type=float,
                        help="report each run's smoothed reward at this wall clock")
    parser.add_argument("--json", help="also write the learning table here")
    args = parser.parse_args(argv)
    if args.window < 1 or not 0 < args.tail <= 1:
        print(f"error: --window must be >= 1 (got {args.window}) and --tail in (0, 1] (got {args.tail})",
              file=sys.stderr)
        return 2
    groups, runs = {}, []  # label -> [rows per run]; (label, path, rows) in argument order
    try:
        for spec in args.runs:
            label, _, path = spec.rpartition("=") if "=" in spec else (os.path.basename(spec.rstrip("/")), "", spec)
            runs.append((label, path, read_rows(path)))
            groups.setdefault(label, []).append(runs[-1][2])
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = args.target_reward
    if target is not None:
        try:
            target = float(target)
        except ValueError:
            if target not in groups:
                print(f"error: --target-reward {target!r} is neither a number nor one of the labels "
                      f"{', '.join(groups)}", file=sys.stderr)
                return 2
            target = statistics.fmean(smooth([r["reward_mean"] for r in rows], args.window)[-1]
                                      for rows in groups[target])
    out = args.out or os.path.join(os.path.dirname(runs[0][1].rstrip("/")) or ".", "reward_curves.png")
    named = {(label if len(groups[label]) == 1 else f"{label}/{os.path.basename(path.rstrip('/'))}"):
             rows for label, path, rows in runs}
    plot_reward_curves(named, out, eval_too=True, window=args.window, title=" vs ".join(groups))
    wall_png = os.path.splitext(out)[0] + "_wall.png"
    plot_wall(groups, wall_png, args.window, target)
    tail = f"{int(args.tail * 100)}%"
    w = max(16, max(len(label) for label in named) + 2)
    print(f"{'run':<{w}}{'steps':>6}{'reward first ' + tail:>20}{'reward last ' + tail:>19}{'eval last':>11}"
          f"{'step s':>9}{'stale frac':>11}{'max stale':>10}{'tag frags':>10}{'clipfrac':>9}")
    for label, rows in named.items():
        s = summary(rows, args.tail)
        print(f"{label:<{w}}{s['steps']:>6}{s['reward_first']:>20.4f}{s['reward_last']:>19.4f}{s['eval_last']:>11.4f}"
              f"{s['step_time_s']:>9.3f}{s['stale_frac']:>11.3f}{s['max_staleness']:>10.2f}"
              f"{s['tag_fragments']:>10.0f}{s['clipfrac']:>9.4f}")
    table = learning_table(groups, target, args.at_wall_s, args.window)
    print(f"\nper label over its runs (mean +- std [min, max]); rewards are {args.window}-step "
          "trailing means")
    for label, e in table.items():
        line = (f"  {label:<{w}} runs {e['runs']}  final reward {_spread(e['final_reward'])}  "
                f"wall {_spread(e['wall_s'])} s")
        if target is not None:
            reached = [t for t in e["time_to_target_s"] if t is not None]
            line += (f"  | to reward {target:.4f}: {len(reached)}/{e['runs']} reached, "
                     f"{_spread(reached)} s")
        if args.at_wall_s is not None:
            rewards = [r for r in e["reward_at_wall"] if r is not None]
            line += f"  | reward at {args.at_wall_s:g} s: {_spread(rewards)}"
        print(line)
    if args.json:
        def write(p):
            with open(p, "w") as f:
                json.dump({"target_reward": target, "at_wall_s": args.at_wall_s, "window": args.window,
                           "labels": table}, f, indent=1)
        atomic_write(args.json, write)
    print(f"wrote {out} and {wall_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
