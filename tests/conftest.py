"""Shared pytest setup: make the flat project modules (rewards.py, grpo.py, ...) importable
when pytest is run as plain `pytest` from any directory, not only `python -m pytest`."""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tests check plumbing, not pictures: they build the tiny pipelines with a few pre-training steps (a separate
# cache folder, tiny-<model>-v3-quick), and tests/test_pretrain.py builds the full demo pipeline itself. Ranks
# spawned by run_main inherit this, so they load the same pipelines.
os.environ.setdefault("DIGENRL_TINY_PRETRAIN", "quick")
# One torch thread in a test process (set before anything imports torch; its ranks and tools inherit it): the README's
# command runs two workers on two cores, and a second OpenMP thread in each only spins while the other worker
# computes. Four in-process files alone on a quiet machine: 73.6 s of CPU and 65.7 s on two threads, 60.8 s and
# 62.6 s on one (2026-12-05).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torchrun ranks without DIGENRL_JOB_SECRET derive the job store's secret from $XDG_CONFIG_HOME/digenrl/store_secret
# (infra/jobstore.py): the tests' own, not the home folder's.
os.environ.setdefault("XDG_CONFIG_HOME", os.path.join(tempfile.gettempdir(), f"digenrl-tests-{os.getuid()}"))


# --- scheduling the files over pytest-xdist's workers ------------------------------------------------------------
# The README's command (`-n 2 --dist loadfile`) runs each file on one worker, and xdist hands out files by their
# number of tests: a slow file of few tests (the rehearsal: 2 tests, 3 minutes) came last and ran alone while the
# other core idled. Handing out the slowest files first (longest processing time first) leaves only short files
# for the end, so both workers finish within about one short file of each other. The seconds are estimates for 2
# idle cores (2026-12-04, from the slowest tests of a whole run and loaded runs of single files): only their order
# counts; refine them from a `--durations=0` run. A file not listed goes after these, in xdist's own order.
SLOW_FILES_S = {  # a whole run, 2026-12-05 at f36058f (`--durations=0`, summed per file)
    "test_run_life.py": 290,
    "test_stall_matrix.py": 180,
    "test_rehearse.py": 155,
    "test_liveness.py": 120,
    "test_pretrain.py": 100,
    "test_placements.py": 85,
    "test_course.py": 85,
    "test_plan.py": 70,
    "test_multinode.py": 60,
    "test_memory.py": 60,
    "test_compat_lora.py": 50,
    "test_resume_scale.py": 45,
    "test_reliability.py": 40,
    "test_cli.py": 40,
    "test_families.py": 35,
    "test_family_rl.py": 35,
    "test_flow_grpo_recipes.py": 30,
    "test_mechanism_demos.py": 15,
    "test_comm_contract.py": 15,
    "test_untrusted.py": 15,
}


def slowest_file(files) -> str:
    """The first of `files` (xdist's scopes: paths of test files) with the most seconds in SLOW_FILES_S; files not
    listed count 0, so among them the first (xdist's order: most tests first)."""
    return max(files, key=lambda path: SLOW_FILES_S.get(os.path.basename(path), 0))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, slowest listed file first (SLOW_FILES_S); any other --dist: xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SlowestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            self.workqueue.move_to_end(slowest_file(self.workqueue), last=False)  # what the base class hands out
            super()._assign_work_unit(node)

    return SlowestFileFirst(config, log)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for tiny pipelines per test session (built once, reused by every run)."""
    path = os.environ.get("DIGENRL_TEST_CACHE") or str(tmp_path_factory.mktemp("digenrl-cache"))
    os.environ["DIGENRL_CACHE"] = path
    return path


def tiny_fragment(noise_level: float = 0.7):
    """A full-fine-tuning tiny FLUX policy and one generated fragment of 2 groups of 3 (T = 4, T_train = 3):
    (policy, sampling, reward, prompts, spec, fragment). Needs the tiny_cache fixture."""
    import torch

    import models
    import rewards
    from fragment import fragment_spec
    from rollout import SamplingConfig, generate_fragment

    torch.manual_seed(0)
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    models.enable_full_training(policy)
    sampling = SamplingConfig(num_steps=4, noise_level=noise_level)  # T_train = int(4 * 0.99) = 3
    reward = rewards.build_reward("color")
    prompts = rewards.color_prompts("train")
    spec = fragment_spec(seed=0, step=0, first_group=0, num_groups=2, num_prompts_total=3, groups_per_step=2,
                         group_size=3)
    fragment = generate_fragment(policy, spec, prompts, sampling, reward, version=0, producer=0)
    return policy, sampling, reward, prompts, spec, fragment


def trainable_state(transformer) -> dict:
    """name -> tensor of the trainable weights (LoRA only when LoRA is on), in a fixed order."""
    return {n: p for n, p in transformer.named_parameters() if p.requires_grad}


def run_main(args, out_dir, cache, timeout=240, check=True, env=None):
    """Run `python main.py args` as a subprocess (it spawns its own ranks); returns CompletedProcess."""
    import subprocess

    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), *args, "--out-dir", str(out_dir), "--no-progress", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"main.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def run_forked(args, out_dir, name, cache, scripted=False, env=None, comm_log=None, bound_s=800):
    """main.py's job for `args` as run <out_dir>/<name> (its ranks' output: <out_dir>/<name>.log), the ranks forked
    from one forkserver of this process that imported main.py and the tiny pipeline once (tests/stall_matrix.py
    run_job: cli.prepare, the run lock and infra.launch, as main.py does them): a job costs its ranks' work, not two
    fresh interpreters importing torch and diffusers. For tests of what a job computes; main.py's own command line,
    output and exit codes: run_main, as for a test that sets environment variables (the ranks have the forkserver's,
    taken when this process first started it, plus `env`). `scripted`: TAG and TCSS at scripted moments
    (tests/inject/scripted_schedule.py, imported by every rank); `comm_log`: a folder for the ranks' records of
    their torch.distributed calls (tests/inject/comm_recorder.py)."""
    import stall_matrix

    job = stall_matrix.run_job(args, out_dir, name, cache, bound_s=bound_s, env=env, comm_log=comm_log,
                               inject=("scripted_schedule",) if scripted else ())
    assert job.code == 0 and not job.killed_by_test, f"{name}: {job.code} after {job.took_s:.0f} s:\n{job.log[-4000:]}"
    return job


def read_metrics(run_dir):
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint_weights(run_dir, step):
    from infra import rundir

    return rundir.load_state(os.path.join(run_dir, "checkpoints", f"step_{step:06d}"))["weights"]  # weights_only


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


def trainer_rank_of(cfg, trainer=None, books=None, batch=None, groups=None, steps=range(1), generate=None,
                    reward_names=("r",)):
    """main.TrainerRank as trainer_rank builds it, on one process, with what a test does not need left out: no
    publisher (nothing to publish to), no TAG assistant, no queue (a test gives `fragments`: TrainerRank.fragments
    replaced), tracing off, `cfg` resolved. `books` needs optimizer_step(step) -> metrics, update(step) and end_step(step, metrics)
    (infra/bookkeeping.py's); `groups` defaults to one colocated rank."""
    import contextlib
    import types

    import comm
    import config
    import main
    import rollout
    from infra.tracing import Tracer

    groups = groups or comm.Groups(0, 1, [0], [0])
    cfg = config.resolve(cfg, world=groups.world)  # the mode's mechanisms and the presets filled in, as a run's
    r = types.SimpleNamespace(cfg=cfg, groups=groups, steps=steps, queue=None, batch=batch, generate=generate,
                              sampling=rollout.SamplingConfig.of(cfg), tracer=Tracer(0, groups.role, enabled=False),
                              pace=contextlib.nullcontext, reward_fn=types.SimpleNamespace(names=list(reward_names)),
                              job=types.SimpleNamespace(progress=None))
    publisher = types.SimpleNamespace(publish=lambda version: None, stop=lambda: None)
    return main.TrainerRank(r, trainer, books, publisher, assistant=None)
