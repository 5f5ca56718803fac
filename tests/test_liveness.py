"""Liveness instead of deadlines (comm.py, infra/liveness.py, infra/progress.py): steps longer than --timeout-s
complete in every mode, while a rank killed (SIGKILL), frozen (SIGSTOP) or stuck in a collective with its
heartbeat alive ends the whole job within --timeout-s + 30 s with a message naming the rank and its role (and,
when stuck, what it was inside), self-spawned and under torchrun. Plus the NCCL decision."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import comm
from conftest import ROOT, rank_pids, read_metrics

pytestmark = pytest.mark.timeout(400)


def test_nccl_is_chosen_when_every_compute_rank_has_a_gpu_of_its_own():
    """Catches the compute plane silently falling back to gloo with CUDA tensors (issue 22 item 5): the old rule
    compared LOCAL_WORLD_SIZE with device_count(), which is 1 in every process under SLURM --gpus-per-task=1."""
    ident = comm.device_identity
    one_node = [ident(None, "a", None, i) for i in range(8)]  # torchrun --nproc_per_node 8: cuda:local_rank
    two_nodes = one_node + [ident(None, "b", None, i) for i in range(8)]
    one_visible_each = [ident(None, "a", str(i), 0) for i in range(8)]  # every process sees its GPU as cuda:0
    by_uuid = [ident(f"GPU-{i:04d}", "a", "0", 0) for i in range(8)]
    for layout in (one_node, two_nodes, one_visible_each, by_uuid):
        backend, why = comm.choose_backend(True, layout)
        assert backend == "nccl" and f"each of the {len(layout)}" in why, (layout, why)
    assert len(set(one_visible_each)) == 8 and len(set(two_nodes)) == 16
    shared = [ident(None, "a", None, 0)] * 3  # three ranks on one GPU: NCCL refuses
    assert comm.choose_backend(True, shared)[0] == "gloo" and "share 1 GPU" in comm.choose_backend(True, shared)[1]
    assert comm.choose_backend(True, [ident(None, "a", "0,1", 1), ident(None, "a", "1", 0)])[0] == "gloo"  # same GPU 1
    assert comm.choose_backend(False, []) == ("gloo", "no CUDA device")
    assert comm.choose_backend(True, shared, requested="nccl")[0] == "nccl"
    with pytest.raises(ValueError, match="--backend nccl needs CUDA"):
        comm.choose_backend(False, [], requested="nccl")
    with pytest.raises(ValueError, match="'mpi' is not one of"):
        comm.choose_backend(True, one_node, requested="mpi")


# Slow on a fragment (3-4 images), at once on the dry call that checks a custom reward (2 probe images) before the run.
SLOW_REWARD = ("import time\n\ndef slow(images, prompts):\n    if len(images) > 2:\n        time.sleep({s})\n"
               "    return images.mean(dim=(1, 2, 3))\n")
SLOW_S, TIMEOUT_S = 10, 4  # one reward call per step takes 2.5 x --timeout-s
MODES = {  # one fragment per generating rank per step
    "colocated": ["--mode", "colocated", "--nproc", "2", "--prompts-per-step", "2", "--group-size", "3"],
    "naive": ["--mode", "naive", "--nproc", "2", "--prompts-per-step", "2", "--fragment-groups", "2"],
    "digenrl": ["--mode", "digenrl", "--nproc", "2", "--prompts-per-step", "2", "--fragment-groups", "2"],
    "fsdp": ["--mode", "digenrl", "--fsdp", "--nproc", "3", "--prompts-per-step", "2", "--fragment-groups", "2"],
}
LONG_STEP = ["--steps", "1", "--group-size", "2", "--num-steps", "2", "--eval-every", "0", "--save-every", "0",
             "--no-trace", "--timeout-s", str(TIMEOUT_S)]
HOOKS = os.path.join(ROOT, "tests", "inject")  # sitecustomize.py -> liveness_faults.py, env-activated


def _popen(args, out, cache, log_name, launcher=(sys.executable, "main.py"), env=None):
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    log = open(out / log_name, "w")
    return subprocess.Popen([*launcher, *args, "--out-dir", str(out), "--no-progress", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _hooked(**variables) -> dict:
    return {"PYTHONPATH": os.pathsep.join([HOOKS, ROOT, os.environ.get("PYTHONPATH", "")]), **variables}


@pytest.mark.parametrize("mode", list(MODES))
def test_steps_longer_than_the_timeout_complete_in_every_mode(mode, tiny_cache, tmp_path):
    """Catches liveness that bounds a step instead of a rank's silence: one reward call of 2.5 x --timeout-s per
    step (a user's function reports no progress: the rank is excused while its heartbeat beats), the other ranks
    waiting for it. One job at a time (four at once on 2 cores starved heartbeats: issue 27)."""
    (tmp_path / "slow.py").write_text(SLOW_REWARD.format(s=SLOW_S))
    proc = _popen([*LONG_STEP, *MODES[mode], "--reward", f"{tmp_path / 'slow.py'}:slow", "--run-name", mode],
                  tmp_path, tiny_cache, f"{mode}.log")
    assert proc.wait(300) == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
    times = [r["step_time_s"] for r in read_metrics(tmp_path / mode)]
    assert len(times) == 1 and times[0] >= 2 * TIMEOUT_S, (mode, times)


def test_a_long_step_of_short_forwards_completes(tiny_cache, tmp_path):
    """Catches progress not reported from inside long phases: every transformer forward sleeps (0.75 s per
    attention call, two per forward), so generating a fragment takes ~2.3 x --timeout-s and no rank is excused;
    the step completes because each forward, pack and tensor counts (FSDP trainers, TAG and TCSS on)."""
    proc = _popen([*LONG_STEP, *MODES["fsdp"], "--num-steps", "6", "--run-name", "slow"], tmp_path, tiny_cache,
                  "slow.log", env=_hooked(DIGENRL_TEST_SLOW_ATTENTION="0.75"))
    assert proc.wait(300) == 0, (tmp_path / "slow.log").read_text()[-3000:]
    times = [r["step_time_s"] for r in read_metrics(tmp_path / "slow")]
    assert len(times) == 1 and times[0] >= 2 * TIMEOUT_S, times


STUCK_JOB = ["--mode", "digenrl", "--nproc", "3", "--rollout-ranks", "1", "--steps", "500", "--prompts-per-step", "2",
             "--group-size", "2", "--num-steps", "3", "--eval-every", "0", "--save-every", "0", "--no-trace",
             "--timeout-s", "5"]


@pytest.mark.parametrize("stall,expected", [
    ("2:all_reduce:2", r'trainer rank 2 made no progress for \d+ s inside "all-reduce" \(step 0\)'),
    ("0:send:5", r'rollout rank 0 made no progress for \d+ s inside "send" \(thread fragment-sender'),
], ids=["trainer-in-all-reduce", "rollout-in-send"])
def test_a_rank_stuck_in_a_collective_ends_the_job_naming_it(stall, expected, tiny_cache, tmp_path):
    """Catches a hung collective going unnoticed (issue 22 item 1): the heartbeat thread of a rank whose main
    thread (or sender thread) is blocked in a collective keeps beating, so heartbeats alone waited forever.
    Injected on CPU: trainer rank 2's second gradient all-reduce, or the rollout's fifth send (the third
    fragment's header), never returns. The job ends within --timeout-s + 30 s naming the rank and the phase."""
    mark = tmp_path / "stalled_at"
    proc = _popen([*STUCK_JOB, "--run-name", "job"], tmp_path, tiny_cache, "job.log",
                  env=_hooked(DIGENRL_TEST_STALL=stall, DIGENRL_TEST_STALL_MARK=str(mark)))
    try:
        proc.wait(240)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "job.log").read_text()
    assert mark.exists(), log[-3000:]
    took = ended - float(mark.read_text())  # from the stall to the end of the whole job
    assert proc.returncode != 0 and took < 5 + 30, (took, log[-3000:])
    assert re.search(expected, log), log[-3000:]
    assert "no rank made progress" in log and "no sign of life" not in log, log[-3000:]  # heartbeats kept beating


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3")
VICTIM_JOB = ["--mode", "digenrl", "--nproc", "3", "--rollout-ranks", "2", "--steps", "500", "--prompts-per-step", "4",
              "--group-size", "2", "--num-steps", "3", "--eval-every", "0", "--save-every", "0", "--no-trace",
              "--timeout-s", "5"]


@pytest.mark.parametrize("launcher,sig,expected", [
    ("self", signal.SIGSTOP, "rank 2 (trainer) showed no sign of life"),
    ("torchrun", signal.SIGKILL, "rank 2 (trainer) died"),
    ("torchrun", signal.SIGSTOP, "rank 2 (trainer) showed no sign of life"),
], ids=["self-sigstop", "torchrun-sigkill", "torchrun-sigstop"])
def test_a_dead_or_frozen_rank_ends_the_job_naming_it(launcher, sig, expected, tiny_cache, tmp_path):
    cmd = TORCHRUN + ("main.py",) if launcher == "torchrun" else (sys.executable, "main.py")
    args = VICTIM_JOB[:2] + VICTIM_JOB[4:] if launcher == "torchrun" else VICTIM_JOB  # torchrun sets the world
    proc = _popen([*args, "--run-name", "job"], tmp_path, tiny_cache, "job.log", launcher=cmd)
    ranks = {}
    try:
        metrics = tmp_path / "job" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.2)
        ranks = rank_pids(proc.pid, 3)
        pid, role = ranks[2]
        assert role == "trainer"
        os.kill(pid, sig)
        hit = time.monotonic()
        proc.wait(5 + 30 + 10)
        took = time.monotonic() - hit
        log = (tmp_path / "job.log").read_text()
        assert proc.returncode != 0 and took < 5 + 30, (took, log[-3000:])
        assert expected in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid, _ in ranks.values():  # nothing may outlive the test (a frozen rank least of all)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
