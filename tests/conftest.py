"""Shared pytest setup: make the flat project modules (rewards.py, grpo.py, ...) importable
when pytest is run as plain `pytest` from any directory, not only `python -m pytest`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for tiny pipelines per test session (built once, reused by every run)."""
    path = os.environ.get("DIGENRL_TEST_CACHE") or str(tmp_path_factory.mktemp("digenrl-cache"))
    os.environ["DIGENRL_CACHE"] = path
    return path


def run_main(args, out_dir, cache, timeout=240, check=True, env=None):
    """Run `python main.py args` as a subprocess (it spawns its own ranks); returns CompletedProcess."""
    import subprocess

    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), *args, "--out-dir", str(out_dir), "--no-progress", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"main.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(run_dir):
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint_weights(run_dir, step):
    import torch

    state = torch.load(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "state.pt"), map_location="cpu",
                       weights_only=False)
    return state["weights"]


def rank_pids(launcher_pid: int, nproc: int, timeout_s: float = 120.0) -> dict[int, tuple[int, str]]:
    """{rank: (pid, role)} of the ranks a `main.py` launcher spawned: each rank names its process
    `dg<rank>-<role>` (main._name_process), which ps/psutil read back."""
    import re
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        try:
            for child in psutil.Process(launcher_pid).children(recursive=True):
                try:
                    match = re.fullmatch(r"dg(\d+)-(\w+)", child.name())
                except psutil.NoSuchProcess:
                    continue
                if match:
                    found[int(match.group(1))] = (child.pid, match.group(2))
        except psutil.NoSuchProcess:
            raise AssertionError(f"launcher {launcher_pid} is gone") from None
        if len(found) == nproc:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"found ranks {sorted(found)} of {nproc} after {timeout_s} s")
        time.sleep(0.05)
