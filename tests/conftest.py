"""Shared pytest setup: make the flat project modules (rewards.py, grpo.py, ...) importable
when pytest is run as plain `pytest` from any directory, not only `python -m pytest`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests check plumbing, not pictures: they build the tiny pipelines with a few pre-training steps (a separate
# cache folder, tiny-<model>-v2-quick), and tests/test_pretrain.py builds the full demo pipeline itself. Ranks
# spawned by run_main inherit this, so they load the same pipelines.
os.environ.setdefault("DIGENRL_TINY_PRETRAIN", "quick")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for tiny pipelines per test session (built once, reused by every run)."""
    path = os.environ.get("DIGENRL_TEST_CACHE") or str(tmp_path_factory.mktemp("digenrl-cache"))
    os.environ["DIGENRL_CACHE"] = path
    return path


def run_main(args, out_dir, cache, timeout=240, check=True):
    """Run `python main.py args` as a subprocess (it spawns its own ranks); returns CompletedProcess."""
    import subprocess

    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
