"""Liveness instead of deadlines (comm.py, infra/liveness.py, infra/progress.py): steps longer than --timeout-s
complete in every mode, while a rank killed (SIGKILL) or frozen (SIGSTOP) ends the whole job within --timeout-s +
30 s with a message naming the rank and its role, self-spawned and under torchrun. Plus the NCCL decision.
A rank stuck at each blocking point with its heartbeat alive, and each point slowed: tests/test_stall_matrix.py."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import comm
from conftest import ROOT, rank_pids, read_metrics, run_forked

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


# Slow on a fragment (3-4 images), at once on the dry call that checks a custom reward (2 probe images) before the
# run; only on the rollout rank, or colocated rank 1 (main.py names each rank's process): colocated rank 0 then
# waits for rank 1 in the gradient all-reduce (the stall-and-slow matrix's "all-reduce" row, slowed).
SLOW_REWARD = ("import time\n\ndef slow(images, prompts):\n    with open('/proc/self/comm') as f:\n"
               "        generating = f.read().strip() in ('dg0-rollout', 'dg1-colocated')\n"
               "    if len(images) > 2 and generating:\n        time.sleep({s})\n"
               "    return images.mean(dim=(1, 2, 3))\n")
SLOW_S, TIMEOUT_S = 12.5, 5  # one reward call per step takes 2.5 x --timeout-s (4 s: a heartbeat starved at load 13)
MODES = {  # one fragment per generating rank per step. DigenRL with --fsdp on 3 ranks (a row here until
    # 2026-12-04): tests/test_stall_matrix.py's slowed run is that layout with the reward slowed to 3 x --timeout-s
    # (and every other point slowed too); the digenrl row below keeps the default --excused-timeout-s.
    "colocated": ["--mode", "colocated", "--nproc", "2", "--prompts-per-step", "2", "--group-size", "3"],
    "naive": ["--mode", "naive", "--nproc", "2", "--prompts-per-step", "2", "--fragment-groups", "2"],
    "digenrl": ["--mode", "digenrl", "--nproc", "2", "--prompts-per-step", "2", "--fragment-groups", "2"],
}
LONG_STEP = ["--steps", "1", "--group-size", "2", "--num-steps", "2", "--eval-every", "0", "--save-every", "0",
             "--no-trace", "--timeout-s", str(TIMEOUT_S)]


def _popen(args, out, cache, log_name, launcher=(sys.executable, "main.py"), env=None):
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    log = open(out / log_name, "w")
    return subprocess.Popen([*launcher, *args, "--out-dir", str(out), "--no-progress", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("mode", list(MODES))
def test_steps_longer_than_the_timeout_complete_in_every_mode(mode, tiny_cache, tmp_path):
    """Catches liveness that bounds a step instead of a rank's silence: one reward call of 2.5 x --timeout-s per
    step (a user's function reports no progress: the rank is excused, within --excused-timeout-s, while its
    heartbeat beats), the other ranks waiting for it. One job at a time (four at once on 2 cores starved
    heartbeats: issue 27)."""
    (tmp_path / "slow.py").write_text(SLOW_REWARD.format(s=SLOW_S))
    run_forked([*LONG_STEP, *MODES[mode], "--reward", f"{tmp_path / 'slow.py'}:slow"], tmp_path, mode, tiny_cache)
    times = [r["step_time_s"] for r in read_metrics(tmp_path / mode)]
    assert len(times) == 1 and times[0] >= 2 * TIMEOUT_S, (mode, times)


VICTIM_JOB = ["--mode", "digenrl", "--steps", "500", "--prompts-per-step", "4", "--group-size", "2", "--num-steps", "3",
              "--eval-every", "0", "--save-every", "0", "--no-trace", "--timeout-s", "5"]
# Self-spawned: 3 ranks, so two survivors (rollout ranks 0 and 1) must end the job. Under torchrun 2 (one survivor):
# each rank there is a fresh interpreter importing torch and diffusers (~10 s of CPU), and torchrun's agent ends
# every other worker once one fails, so a third rank would add no path of ours.
LAYOUTS = {"self": ((sys.executable, "main.py"), ["--nproc", "3", "--rollout-ranks", "2"]),
           "torchrun": ((sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "main.py"), ["--rollout-ranks", "1"])}  # torchrun sets the world


@pytest.mark.parametrize("launcher,sig,expected", [
    ("self", signal.SIGSTOP, "rank 2 (trainer) showed no sign of life"),
    ("torchrun", signal.SIGKILL, "rank 1 (trainer) died"),
    ("torchrun", signal.SIGSTOP, "rank 1 (trainer) showed no sign of life"),
], ids=["self-sigstop", "torchrun-sigkill", "torchrun-sigstop"])
def test_a_dead_or_frozen_rank_ends_the_job_naming_it(launcher, sig, expected, tiny_cache, tmp_path):
    """The last rank, a trainer, killed or frozen once the job is in its loop: the job ends within --timeout-s + 30 s
    with a message naming it and its role."""
    cmd, layout = LAYOUTS[launcher]
    world = 3 if launcher == "self" else 2
    proc = _popen([*VICTIM_JOB, *layout, "--run-name", "job"], tmp_path, tiny_cache, "job.log", launcher=cmd)
    ranks = {}
    try:
        metrics = tmp_path / "job" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never got going"
            time.sleep(0.2)
        ranks = rank_pids(proc.pid, world)
        pid, role = ranks[world - 1]
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


def test_an_excused_section_is_excused_only_for_its_patience_and_not_after_a_stop_request():
    """Catches an excuse without bound (issue 38 defect 1: loading, resuming and a reward were excused for ever, so
    a rank hung there was never found), a bump inside the section that does not restart its patience, and an
    excuse that outlives a stop request (the grace then never starts). The watchdog's own step, on given clocks."""
    import torch.distributed as dist

    from infra.liveness import Liveness
    from infra.progress import Progress

    progress = Progress()
    progress.start()
    watch = Liveness(dist.HashStore(), 0, ["trainer"], timeout_s=5.0, progress=progress, excused_timeout_s=10.0,
                     stop_grace_s=2.0)
    t0 = time.monotonic()
    watch._publish_progress(t0 + 50)  # outside any excused section: nothing moves
    assert progress.ticks == 0 and watch.silence_limit_s() == 5.0
    with progress.excused("reward"):
        for now, ticks in ((t0 + 1, 1), (t0 + 9, 2), (t0 + 11, 2), (t0 + 30, 2)):
            watch._publish_progress(now)
            assert progress.ticks == ticks, now - t0
        assert "silent past --excused-timeout-s 10" in watch.store.get("progress/0").decode()
        progress.bump()  # a report of its own restarts the patience
        watch._publish_progress(t0 + 31)
        watch._publish_progress(t0 + 40)
        assert progress.ticks == 4
        watch.asked_to_stop()
        watch._publish_progress(t0 + 41)
        assert progress.ticks == 4 and watch.silence_limit_s() == 2.0  # min(--timeout-s 5, --stop-grace-s 2)
        assert "not excused after a stop request" in watch.store.get("progress/0").decode()


def test_a_report_names_a_busy_background_thread_first_and_an_idle_wait_last():
    """Catches a report that names what a rank waits for instead of what it is stuck in: the mailbox receiving
    published weights (or a sender sending) is named before the main thread waiting for it, while the mailbox's
    idle wait for the next publish never hides the main thread's phase."""
    from infra.progress import Progress

    progress = Progress()
    progress.start()
    inside, leave = threading.Event(), threading.Event()

    def mailbox(name, idle):
        with progress.inside(name, idle=idle):
            inside.set()
            leave.wait()

    with progress.inside("wait", step=3):
        for name, idle, expected in (("next publish", True, 'inside "wait" (step 3)'),
                                     ("receive weights", False, 'inside "receive weights" (thread weight-mailbox; '
                                                                'main thread inside "wait") (step 3)')):
            inside.clear(), leave.clear()
            thread = threading.Thread(target=mailbox, args=(name, idle), name="weight-mailbox")
            thread.start()
            inside.wait()
            assert progress.describe() == expected
            leave.set()
            thread.join()
