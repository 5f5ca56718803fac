"""A run's life on a shared cluster: the ranks die with their launcher (self-spawned and under torchrun), SIGTERM
stops a run after the current step with a checkpoint that --resume continues exactly, one job per run directory
(an flock'ed lock, stale locks taken over), a reused --run-name is refused, and `torchrun main.py` with one process
runs the demo colocated.

Every kill moment waits for a step to appear in metrics.jsonl first (never a clock-seeded moment), so which step a
signal lands in varies, and every assertion holds for any of them. The jobs signalled are real launches (main.py,
torchrun); the uninterrupted references and the resumes that continue a stopped job are its ranks forked from this
process (conftest.run_forked: what they compute is their point, not two fresh interpreters importing torch).
Run: python -m pytest -q tests/test_run_life.py --timeout 600
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import main
import cli
from conftest import ROOT, checkpoint_weights, rank_pids, read_metrics, run_forked
from infra.preemption import EXIT_PREEMPTED
from infra.runlock import LOCK_NAME, RunLock

pytestmark = pytest.mark.timeout(300)
TINY = ["--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--eval-every", "0", "--timeout-s", "60",
        "--no-trace", "--seed", "3"]
DEAD_WITHIN_S = 15.0
STOPPED_WITHIN_S = 60.0  # after SIGTERM (stop after the step with a checkpoint); the checks after it say how it ended


def start(args, name, folder, cache, torchrun: int = 0) -> subprocess.Popen:
    """main.py in the background (self-spawned, or under torchrun with `torchrun` processes), in its own process
    group (as a scheduler's job step: os.killpg signals every process of it); log in <name>.log."""
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] \
        if torchrun else [sys.executable]
    cmd = [*launcher, os.path.join(ROOT, "main.py"), *args, "--run-name", name, "--out-dir", str(folder),
           "--no-progress", "--threads", "1"]
    with open(folder / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def log_of(folder, name) -> str:
    return (folder / f"{name}.log").read_text()


def wait_for_rows(proc, run, rows: int, folder, name, timeout_s: float = 180) -> None:
    """Until metrics.jsonl has `rows` lines: the ranks are in their loops."""
    deadline = time.monotonic() + timeout_s
    path = run / "metrics.jsonl"
    while not (path.exists() and path.read_text().count("\n") >= rows):
        assert proc.poll() is None, log_of(folder, name)[-3000:]
        assert time.monotonic() < deadline, f"no {rows} rows in {timeout_s} s"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_all_dead(pids, timeout_s: float = DEAD_WITHIN_S) -> list[int]:
    """The pids still alive after timeout_s (empty: all gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:  # leave nothing behind for the next test
        os.kill(pid, signal.SIGKILL)
    return left


# ---------------------------------------------------------------- the launcher stops: no rank outlives it

@pytest.mark.parametrize("how", ["self", "torchrun"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["KILL", "TERM"])
def test_stopping_the_launcher_leaves_no_rank_alive(how, sig, tiny_cache, tmp_path, monkeypatch, capsys):
    """Ranks outliving their launcher: `kill` of main.py (or of torchrun) used to leave both ranks training to
    the end, reparented to pid 1. SIGKILL: they die with it (PR_SET_PDEATHSIG); SIGTERM: they stop after the
    current step with a checkpoint (status 75 from the self-spawned launcher). Self-spawned, also: a second job on
    the running run directory is refused before it writes anything (two jobs used to interleave their metrics),
    and after the SIGKILL `--resume` takes the dead job's lock over and continues without a duplicate step. (The
    second job and the resume are main.py's command line in this process: the lock and the run are what they
    check, the launcher is the first job's.)"""
    name = f"{how}_{sig.name}"
    run = tmp_path / name
    resumed = how == "self" and sig == signal.SIGKILL  # the one run continued: a checkpoint every step
    args = ["--mode", "digenrl", *TINY, "--steps", "500", "--save-every", "1" if resumed else "0"]
    proc = start(args, name, tmp_path, tiny_cache, torchrun=2 if how == "torchrun" else 0)
    try:
        wait_for_rows(proc, run, 2 if resumed else 1, tmp_path, name)  # 2: the checkpoint of step 1 exists
        if how == "self" and sig == signal.SIGTERM:
            lock, config = (run / LOCK_NAME).read_text(), os.stat(run / "config.json")
            second = refused(["--resume", str(run)], monkeypatch, capsys)  # main.main: exit status 2, nothing run
            assert "is in use by another job (host " in second and f"pid {proc.pid}," in second, second
            now = os.stat(run / "config.json")  # RunDir rewrites it (a new inode): it was not touched
            assert (now.st_ino, now.st_mtime_ns) == (config.st_ino, config.st_mtime_ns)
            assert (run / LOCK_NAME).read_text() == lock
        pids = [pid for pid, _ in rank_pids(proc.pid, 2).values()]
        proc.send_signal(sig)
        if how == "self" and sig == signal.SIGKILL:  # a job resumed at once must not find the lock free while
            took_over = take_the_lock_at_once(run)   # a rank of the killed one still writes (it was ~2 s free)
            writing = [p for p in pids if alive(p)]
            time.sleep(0.2)  # a process closes its files a moment before /proc shows it exited
            writing = [p for p in writing if alive(p)]
            os.close(took_over.fd)  # gone as a killed job goes: its name stays, and --resume below takes it over
            assert writing == [], f"the lock was free while ranks {writing} of the killed job were alive"
        # SIGTERM: the current step, the stop's checkpoint and the shutdown first (2.7-3.7 s on a quiet machine;
        # over 15 s once on 2 loaded cores, where the job's first step took 14 s): bounded far below the 500 steps
        bound = DEAD_WITHIN_S if sig == signal.SIGKILL else STOPPED_WITHIN_S
        assert wait_all_dead(pids, bound) == [], f"ranks alive {bound} s after {sig.name}:\n{log_of(tmp_path, name)}"
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = read_metrics(run)
    if sig == signal.SIGTERM:
        log = log_of(tmp_path, name)
        assert "stopped on request after step" in log and "continue with: python main.py --resume" in log, log[-3000:]
        # --save-every 0: the stop's own checkpoint, after the last row, and no other
        assert sorted(os.listdir(run / "checkpoints")) == [f"step_{len(rows):06d}"], log[-3000:]
        assert (run / "checkpoints" / f"step_{len(rows):06d}" / "state.pt").exists()
        if how == "self":
            assert code == EXIT_PREEMPTED, log[-3000:]
    elif how == "self":
        capsys.readouterr()
        run_forked(["--resume", str(run), "--steps", str(len(rows) + 1)], tmp_path, "resumed", tiny_cache)
        assert f"taking over the lock of {run}: its holder (host " in capsys.readouterr().err
        assert [r["step"] for r in read_metrics(run)] == list(range(len(rows) + 1))  # no step twice


def take_the_lock_at_once(run, timeout_s: float = 120) -> RunLock:
    """RunLock.acquire(run), tried again and again from the moment it is called until it succeeds (what a --resume
    started at once, or a scheduler's retry, sees)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RunLock.acquire(str(run))
        except ValueError:
            assert time.monotonic() < deadline, f"the lock of {run} was still held after {timeout_s} s"
            time.sleep(0.01)


# ---------------------------------------------------------------- preemption: SIGTERM, checkpoint, exact resume

def test_sigterm_checkpoints_and_resume_equals_the_uninterrupted_run_colocated(tiny_cache, tmp_path):
    """A preempted job losing everything since its last --save-every checkpoint: SIGTERM (one process, colocated)
    now finishes the step, writes its checkpoint, exits 75, and --resume continues from the step after it with
    the uninterrupted run's metrics and weights."""
    args = ["--mode", "colocated", "--nproc", "1", *TINY, "--steps", "6", "--save-every", "0"]
    proc = start(args, "stopped", tmp_path, tiny_cache)
    try:
        wait_for_rows(proc, tmp_path / "stopped", 2, tmp_path, "stopped")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == EXIT_PREEMPTED, log_of(tmp_path, "stopped")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run_forked(args, tmp_path, "straight", tiny_cache)  # the reference: what the job computes, no signal
    stopped_after = len(read_metrics(tmp_path / "stopped"))
    assert 2 <= stopped_after < 6, "the stop should land mid-run"
    names = sorted(os.listdir(tmp_path / "stopped" / "checkpoints"))
    assert names == [f"step_{stopped_after:06d}"]  # --save-every 0: the preemption's checkpoint only
    resumed = run_forked(["--resume", str(tmp_path / "stopped")], tmp_path, "resumed", tiny_cache)
    assert f"resumed from step {stopped_after} " in resumed.log
    rows, expected = read_metrics(tmp_path / "stopped"), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == list(range(6))
    for row, ref in zip(rows, expected):
        for key in ("reward_mean", "loss", "grad_norm", "version"):
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (row["step"], key)
    final, want = checkpoint_weights(tmp_path / "stopped", 6), checkpoint_weights(tmp_path / "straight", 6)
    for key in want:
        torch.testing.assert_close(final[key], want[key], rtol=1e-5, atol=1e-7)


def test_sigterm_of_a_two_rank_job_then_resume_matches_the_uninterrupted_run(tiny_cache, tmp_path):
    """SIGTERM to every process of a disaggregated job (1 rollout + 1 trainer), as SLURM's scancel and Kubernetes
    send it, stops it after a step with a checkpoint, and --resume reproduces the uninterrupted run. The CPU ranks'
    parent, the launcher's forkserver, gets the signal too and must not die of it (that would SIGKILL the ranks
    through their lifeline before they checkpoint: infra/rank_server.py); the launcher's SIGTERM test above
    covers the forwarded signal alone. GAP + TSP, the deterministic part of DigenRL: with
    TAG and TCSS which fragments a trainer generates and which are one version stale depend on timing, so two
    uninterrupted runs already differ (as in tests/test_reliability.py); the test above resumes the full mode."""
    args = ["--placement", "disaggregated", "--gap", "--tsp", "--nproc", "2", *TINY, "--steps", "6",
            "--save-every", "0"]
    proc = start(args, "stopped", tmp_path, tiny_cache)
    run = tmp_path / "stopped"
    try:
        wait_for_rows(proc, run, 1, tmp_path, "stopped")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == EXIT_PREEMPTED, log_of(tmp_path, "stopped")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run_forked(args, tmp_path, "straight", tiny_cache)  # the reference: what the job computes, no signal
    stopped_after = len(read_metrics(run))
    assert stopped_after < 6, "the stop should land mid-run"
    assert f"stopped on request after step {stopped_after - 1}" in log_of(tmp_path, "stopped")
    assert sorted(os.listdir(run / "checkpoints")) == [f"step_{stopped_after:06d}"]
    assert (run / LOCK_NAME).read_text() == ""  # released cleanly: nothing stale
    run_forked(["--resume", str(run)], tmp_path, "resumed", tiny_cache)
    rows, expected = read_metrics(run), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == list(range(6))
    for row, ref in zip(rows, expected):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9), (row["step"], key)


# ---------------------------------------------------------------- the run directory's lock and name

def refused(argv, monkeypatch, capsys) -> str:
    spawned = []
    monkeypatch.setattr(main, "launch", lambda *a, **k: spawned.append(a) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a) or 0)
    assert main.main(argv) == 2 and not spawned
    return capsys.readouterr().err


def test_a_locked_run_directory_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A second job on a run directory another job holds: refused with the holder's host and pid, nothing
    written (the lock is an flock: another open file description of the same file cannot take it)."""
    held = RunLock.acquire(str(tmp_path / "x"))
    try:
        err = refused(["--run-name", "x", "--out-dir", str(tmp_path)], monkeypatch, capsys)
    finally:
        held.release()
    assert f"'{tmp_path / 'x'}' is in use by another job (host " in err and f"pid {os.getpid()}," in err
    assert os.listdir(tmp_path / "x") == [LOCK_NAME]


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, monkeypatch, capsys, tiny_cache):
    """A lock file left by a killed job (no process holds its flock) must not block the run forever."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / LOCK_NAME).write_text(json.dumps({"host": "h0", "pid": int(dead.stdout), "started": 0}))
    ran = []
    monkeypatch.setattr(main, "launch", lambda *a, **k: ran.append(json.loads((tmp_path / "x" / LOCK_NAME).read_text()))
                        or 0)
    assert main.main(["--run-name", "x", "--out-dir", str(tmp_path)]) == 0
    assert f"taking over the lock of {tmp_path / 'x'}: its holder (host h0, pid {int(dead.stdout)}, " in \
        capsys.readouterr().err
    assert ran == [{"host": socket.gethostname(), "pid": os.getpid(), "started": ran[0]["started"],  # ours meanwhile
                    "job": f"{socket.gethostname()} {os.getpid()}"}]
    assert (tmp_path / "x" / LOCK_NAME).read_text() == ""  # released


def test_reusing_a_run_name_is_refused(tmp_path, monkeypatch, capsys):
    """--run-name of an existing run used to replace its config.json and append to its metrics."""
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    err = refused(["--run-name", "x", "--out-dir", str(tmp_path)], monkeypatch, capsys)
    assert f"already holds a run (config.json): continue it with --resume {tmp_path / 'x'}, or give another " \
           "--run-name" in err
    assert (tmp_path / "x" / "config.json").read_text() == "{}"


# ---------------------------------------------------------------- torchrun with one process

def test_torchrun_with_one_process_runs_colocated_and_learns_as_one_rank_does(tiny_cache, tmp_path):
    """`torchrun main.py --model flux` (one process per node, torchrun's default) used to stop with 'needs at least
    2 ranks'. It now runs colocated, says so in one line, and trains exactly as `python main.py --nproc 1` does."""
    args = [*TINY, "--steps", "3", "--lr", "3e-2"]
    env = dict(os.environ, DIGENRL_CACHE=tiny_cache, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           os.path.join(ROOT, "main.py"), "--model", "flux", *args, "--run-name", "tr", "--out-dir", str(tmp_path),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("[digenrl] one rank: running colocated") == 1
    assert json.loads((tmp_path / "tr" / "config.json").read_text())["mode"] == "colocated"
    run_forked(["--model", "flux", "--nproc", "1", *args], tmp_path, "one", tiny_cache)
    ours, ref = read_metrics(tmp_path / "tr"), read_metrics(tmp_path / "one")
    # grad_norm_mean: at lr 3e-2 the step's second update may find every pair clipped (its gradient exactly 0)
    assert len(ours) == 3 and all(r["grad_norm_mean"] > 0 for r in ours)
    for row, want in zip(ours, ref):
        for key in ("reward_mean", "loss", "grad_norm", "grad_norm_mean"):
            assert row[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key


def test_an_explicit_disaggregated_mode_on_one_rank_names_the_command(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ValueError, match="needs at least 2 ranks .* Run: torchrun --nproc_per_node=2 main.py "
                                         "--mode digenrl --steps 3 "):
        cli.prepare(["--mode", "digenrl", "--steps", "3"])
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.raises(ValueError, match="Run: python main.py --mode naive --nproc 2 "):
        cli.prepare(["--mode", "naive", "--nproc", "1"])


def test_cpu_ranks_are_forked_from_a_forkserver_that_imported_their_pipeline():
    """CPU ranks start from a forkserver (imports paid once), ranks that may use CUDA fresh (a process forked from
    one that touched CUDA cannot use it); each family names the module its pipeline class lives in, which the
    forkserver imports for the ranks (a stale name would only cost time: the import error is swallowed). The
    module's source is read, not imported: importing the five pipelines costs this process ~6 s of CPU (the first
    brings in diffusers' and transformers' models), and every run of a family imports its class anyway."""
    import importlib.util
    import re

    import models
    from infra.launch import main_module, start_method_for
    assert start_method_for("cpu") == "forkserver" and start_method_for("cuda") == "spawn"
    assert start_method_for("auto") == ("spawn" if torch.cuda.is_available() else "forkserver")
    for name in ("flux", "qwenimage", "wan", "hunyuanvideo", "sd3"):
        family = models.get_family(name)
        package, *inside = family.pipeline_module.split(".")
        source = os.path.join(os.path.dirname(importlib.util.find_spec(package).origin), *inside) + ".py"
        with open(source) as f:  # where the class is defined, as its __module__ would name it
            assert re.search(rf"^class {family.pipeline_class_name}\(", f.read(), re.MULTILINE), (name, source)
    assert main_module() is None  # pytest's __main__ is not a script folder's module


PROBE = '''
import os
IMPORTED_BY = os.getpid()


def rank(payload, rank, world, local_rank, master, agent_store, report_silent):
    """Fails unless this module came with the fork (imported once, in the forkserver), not imported by this rank."""
    if IMPORTED_BY == os.getpid():
        raise SystemExit(f"rank {rank}: the forkserver's preload missed {__name__}: the rank imported it itself")
    return 0
'''


def test_the_forkserver_preloads_modules_found_through_the_launchers_sys_path(tmp_path):
    """main.py run from another folder (`python /path/to/main.py`): its folder is on the launcher's sys.path, not the
    forkserver's (Python 3.11's forkserver drops the sys_path it is handed, and a missing preload is an ImportError
    it swallows), so every rank imported main.py, torch and diffusers itself; the tests' forkserver missed its hooks
    and warm-up the same way. A fresh interpreter: a forkserver already running in this worker keeps its imports."""
    scripts, elsewhere = tmp_path / "scripts", tmp_path / "elsewhere"
    scripts.mkdir()
    elsewhere.mkdir()
    (scripts / "probe_preload.py").write_text(PROBE)
    code = (f"import sys; sys.path[:0] = [{str(scripts)!r}, {ROOT!r}]\n"
            "from infra.launch import launch\n"
            "import probe_preload\n"
            "sys.exit(launch(probe_preload.rank, {}, 2, role_of=lambda r: 'rank', start_method='forkserver',\n"
            "               preload=('probe_preload',)))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
