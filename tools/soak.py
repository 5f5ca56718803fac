"""soak.py: a leak check for long runs (not part of the test suite).

Runs `main.py` for --steps DigenRL steps (default 200) of the tiny FLUX model on 2 CPU ranks
(`--nproc 2 --threads 1 --eval-every 0 --save-every 10`), finds the ranks by their process names (dg<rank>-<role>), and while
it runs samples every rank's RSS, open file descriptors and threads (psutil), keyed by the step in
progress (the number of rows in <run>/metrics.jsonl). It prints, per rank, the figures at step 20
and at the last step and their growth, writes every sample to <out>/<run>.samples.jsonl, and exits 1 if
any rank's RSS grew by 10% or more, or its fds or threads grew at all (or if the run failed).

    python soak.py                          # 200 steps: ~70 s on 2 idle cores (3 min when busy)
    python soak.py --steps 400 --out runs/soak
    python soak.py --make-prompts 2000 --steps 300   # many distinct prompts: the prompt-embedding cache stays bounded
    python soak.py --prompt-file my_prompts.txt --prompts-per-step 6

A figure "at step s" is the median over the samples taken while steps s .. s+4 were in progress
(the last step: the last five steps), so that a transient allocation inside one step, or a file
open for one metrics write, is not mistaken for growth; a leak grows every step and still shows.
Samples taken after the last step (trace gathering, shutdown) are not used. --save-every 10 puts the
first checkpoint before step 20: its reward plot imports matplotlib (~25 MB) and keeps two font files
open for good; with the first checkpoint after the baseline, that one-time cost would read as growth.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 5  # steps per figure
FIRST = 20  # the first figure: after warm-up (allocator pools, lazy imports, first checkpoint-free steps)
RSS_LIMIT = 0.10  # relative RSS growth that fails the soak


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="RL steps to run (at least 30)")
    parser.add_argument("--out", default=os.path.join("runs", "soak"), help="folder for the run directory, its log and samples")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("--prompt-file", help="passed to main.py: one training prompt per line (colour reward: each "
                        "line names exactly one of red, green, blue)")
    parser.add_argument("--make-prompts", type=int, metavar="N", help="write N distinct colour-task prompts to "
                        "<out>/<run>.prompts.txt and train on them (exercises the prompt-embedding cache bound)")
    parser.add_argument("--prompts-per-step", type=int, default=3, help="passed to main.py (B)")
    parser.add_argument("--prompt-cache-size", type=int, help="passed to main.py (unset = its default)")
    args = parser.parse_args(argv)
    if args.steps < FIRST + 2 * WINDOW:
        parser.error(f"--steps must be at least {FIRST + 2 * WINDOW} (figures at step {FIRST} and at the end)")
    if args.prompt_file and args.make_prompts:
        parser.error("give --prompt-file or --make-prompts, not both")
    if args.make_prompts is not None and args.make_prompts < 1:
        parser.error(f"--make-prompts must be a positive number of prompts, got {args.make_prompts}")

    name = time.strftime("soak-%Y%m%d-%H%M%S")
    run = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), "--model", "flux", "--nproc", "2", "--threads", "1",
           "--eval-every", "0", "--save-every", "10", "--steps", str(args.steps), "--timeout-s", "120",
           "--out-dir", args.out, "--run-name", name, "--no-progress", "--prompts-per-step", str(args.prompts_per_step)]
    prompt_file = args.prompt_file
    if args.make_prompts:
        prompt_file = os.path.join(args.out, f"{name}.prompts.txt")
        with open(prompt_file, "w") as f:
            f.write("".join(line + "\n" for line in make_prompts(args.make_prompts)))
    if prompt_file:
        cmd += ["--prompt-file", os.path.abspath(prompt_file)]
    if args.prompt_cache_size is not None:
        cmd += ["--prompt-cache-size", str(args.prompt_cache_size)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    print(f"[soak] {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(os.path.join(args.out, f"{name}.log"), "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples = sample_until_exit(launcher, run, args.interval, os.path.join(args.out, f"{name}.samples.jsonl"))
    wall = time.monotonic() - start
    if launcher.returncode != 0:
        with open(os.path.join(args.out, f"{name}.log")) as f:
            print(f.read()[-3000:], file=sys.stderr)
        print(f"[soak] FAIL: main.py exited with {launcher.returncode} after {wall:.0f}s", file=sys.stderr)
        return 1
    return report(samples, args.steps, wall)


def make_prompts(n: int) -> list[str]:
    """n distinct prompts, each naming exactly one of red, green, blue (what the colour reward accepts)."""
    colors, things = ("red", "green", "blue"), ("square", "circle", "field", "wall", "sky", "car", "flower")
    return [f"a {colors[i % 3]} {things[(i // 3) % len(things)]}, variant {i}" for i in range(n)]


def steps_done(metrics_path: str) -> int:
    """Rows in metrics.jsonl = steps finished = the index of the step in progress."""
    try:
        with open(metrics_path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def find_ranks(launcher_pid: int) -> dict[str, tuple[psutil.Process, str]]:
    """The launcher's rank processes, by the names they give themselves: "rank0" -> (process, role)."""
    found = {}
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("dg") and "-" in name and name[2:].split("-")[0].isdigit():
            rank, role = name[2:].split("-", 1)
            found[f"rank{rank}"] = (child, role)
    return found


def sample_until_exit(launcher: subprocess.Popen, run: str, interval: float, out_path: str) -> list[dict]:
    procs: dict[str, tuple[psutil.Process, str]] = {}  # "rank0" -> (process, role)
    samples = []
    with open(out_path, "w") as out:
        while launcher.poll() is None:
            if len(procs) < 2:  # each rank names its process dg<rank>-<role> (main._name_process)
                procs.update(find_ranks(launcher.pid))
            step = steps_done(os.path.join(run, "metrics.jsonl"))
            for rank, (proc, role) in procs.items():
                try:
                    with proc.oneshot():
                        row = {"t": time.time(), "step": step, "rank": rank, "role": role,
                               "rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
                               "threads": proc.num_threads()}
                except psutil.NoSuchProcess:  # the run is ending
                    continue
                samples.append(row)
                out.write(json.dumps(row) + "\n")
            time.sleep(interval)
    return samples


def figure(samples: list[dict], rank: str, first: int, key: str) -> float | None:
    values = [s[key] for s in samples if s["rank"] == rank and first <= s["step"] < first + WINDOW]
    return statistics.median(values) if values else None


def report(samples: list[dict], steps: int, wall: float) -> int:
    last = steps - WINDOW  # the window of the last five steps
    failures = []
    print(f"\n[soak] {steps} steps in {wall:.0f}s; figures: median over steps s..s+{WINDOW - 1} in progress\n")
    head = [f"steps {s}-{s + WINDOW - 1}" for s in (FIRST, last)]
    print(f"{'rank':<17}{'metric':<9}{head[0]:>14}{head[1]:>14}{'growth':>10}")
    for rank in sorted({s["rank"] for s in samples}):
        role = next(s["role"] for s in samples if s["rank"] == rank)
        for key, unit in (("rss_mb", "MB"), ("fds", ""), ("threads", "")):
            a, b = figure(samples, rank, FIRST, key), figure(samples, rank, last, key)
            if a is None or b is None:
                failures.append(f"{rank}: no samples for {key} at step {FIRST} or {steps} (sampling too slow?)")
                continue
            growth = (b - a) / a if a else 0.0
            print(f"{f'{rank} ({role})':<17}{key:<9}{a:>12.1f}{unit:<2}{b:>12.1f}{unit:<2}{growth:>+10.1%}")
            if key == "rss_mb" and growth >= RSS_LIMIT:
                failures.append(f"{rank} RSS grew {growth:+.1%} ({a:.0f} -> {b:.0f} MB), limit {RSS_LIMIT:.0%}")
            elif key != "rss_mb" and b > a:
                failures.append(f"{rank} {key} grew {a:g} -> {b:g}")
    if failures:
        print("\n[soak] FAIL: " + "; ".join(failures), file=sys.stderr)
        return 1
    print("\n[soak] OK: no growth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
