"""Liveness instead of deadlines (comm.py, infra/liveness.py): steps longer than --timeout-s complete in every
mode, while a rank killed (SIGKILL) or frozen (SIGSTOP) ends the whole job within --timeout-s + 30 s with a
message naming the rank and its role, self-spawned and under torchrun. Plus the NCCL decision."""
import os
import signal
import statistics
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


SLOW_REWARD = "import time\n\ndef slow(images, prompts):\n    time.sleep({s})\n    return images.mean(dim=(1, 2, 3))\n"
SLOW_S, TIMEOUT_S = 7, 3  # every reward call takes 2.3 x --timeout-s; steps take 2.3-4.7 x
MODES = {
    "colocated": ["--mode", "colocated", "--nproc", "2", "--prompts-per-step", "3"],  # uneven shares: rank 1 waits
    "naive": ["--mode", "naive", "--nproc", "2", "--prompts-per-step", "2"],
    "digenrl": ["--mode", "digenrl", "--nproc", "2", "--prompts-per-step", "2"],
    "fsdp": ["--mode", "digenrl", "--fsdp", "--nproc", "3", "--prompts-per-step", "2", "--fragment-groups", "2"],
}


def _popen(args, out, cache, log_name, launcher=(sys.executable, "main.py")):
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(out / log_name, "w")
    return subprocess.Popen([*launcher, *args, "--out-dir", str(out), "--no-progress", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_steps_longer_than_the_timeout_complete_in_every_mode(tiny_cache, tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_REWARD.format(s=SLOW_S))
    common = ["--steps", "2", "--group-size", "2", "--num-steps", "2", "--eval-every", "0", "--save-every", "0",
              "--no-trace", "--timeout-s", str(TIMEOUT_S), "--reward", f"{tmp_path / 'slow.py'}:slow"]
    procs = {name: _popen([*common, *args, "--run-name", name], tmp_path, tiny_cache, f"{name}.log")
             for name, args in MODES.items()}  # all at once: they mostly sleep
    for name, proc in procs.items():
        assert proc.wait(300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    for name in MODES:
        times = [r["step_time_s"] for r in read_metrics(tmp_path / name)]
        assert len(times) == 2 and statistics.median(times) >= 2 * TIMEOUT_S, (name, times)


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
