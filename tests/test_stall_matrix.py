"""The stall-and-slow matrix (issue 38): for every blocking point of a run (each collective, store wait,
send/recv, checkpoint and publish I/O, model loading, start-up and resume), found from the calls the
communication contract records (tests/inject/comm_recorder.py: every torch.distributed call and every wait of
the project's own code, with the phase liveness would name; every excused section), a real job of main.py's ranks
- stalled there on one rank ends within --timeout-s plus a bound (--excused-timeout-s first where the phase
  reports nothing of its own), the report naming the rank and the point;
- slowed there to several times --timeout-s while it keeps reporting progress finishes (the points split over
  stall_matrix.SLOW_PARTS: jobs of one command side by side, each slowing its part's points at once).
A blocking point without its row fails test_every_blocking_point_has_a_row (and tests/test_comm_contract.py checks
its layouts the same way), so a collective added later gets its row or the suite says so. Plus SIGTERM: a rank
still starting stops at once, a stuck job after --stop-grace-s.
The rows, the jobs and the faults: tests/stall_matrix.py, tests/inject/faults.py. The jobs run JOBS_AT_ONCE at a
time, their ranks forked from one forkserver of this process (no per-job imports).
"""
import concurrent.futures
import os
import re
import shutil
import signal
import threading
import time

import pytest

import stall_matrix as sm

pytestmark = pytest.mark.timeout(1800)  # the matrix fixture runs every job in the first test that needs it
T = sm.TIMEOUT_S
BOUND_S = 30.0  # after --timeout-s (and --excused-timeout-s): the watchdog's interval, the launcher's teardown, load
EXCUSED_S = 2 * T  # --excused-timeout-s of a job stalled in an excused phase (healthy phases: the default, 4 T)


JOBS_AT_ONCE = 4  # the matrix's jobs run side by side: most of a job's time is waiting (for a stall's report, the
# slowed units). The two slowed parts go first and take two places for most of the file: as many stalled rows
# run beside them as ran beside the one slowed job before (3 jobs at once then, 9 ranks on 2 loaded cores)
STALL_TEST = "test_a_rank_stalled_at_a_blocking_point_ends_the_job_naming_it"
SLOW_TESTS = ("test_every_blocking_point_slowed", "test_every_blocking_point_has_a_row")


def expected(phase: str, row: sm.Row) -> str:
    role = sm.ROLES[row.layout][row.rank]
    named = re.escape(row.names or phase)
    thread = rf" \(thread {row.thread}" if row.thread else ""
    return rf'{role} rank {row.rank} made no progress for \d+ s inside "{named}"{thread}'


def _checkpointed(folder, cache):
    """A run of one step with its checkpoint: what the resume row and the slow run resume."""
    job = sm.run_job([*sm.LAYOUTS["fsdp"], *sm.SAVE, "--steps", "1", "--timeout-s", "60"], folder, "run", cache,
                     bound_s=600)  # healthy: a --timeout-s that no load can trip
    assert job.code == 0, job.log[-4000:]
    return folder / "run"


def _stall(phase: str, folder, cache, checkpoint):
    """The row's job, stalled: (job, when the stall began (time.time()) or None, the ranks' reports)."""
    row = sm.ROWS[phase]
    folder.mkdir()
    args = [*sm.LAYOUTS[row.layout], *row.args, "--steps", str(row.steps + (1 if row.resume else 0))]
    if row.excused:
        args += ["--excused-timeout-s", f"{EXCUSED_S:g}"]
    if row.resume:  # a checkpoint of step 1, resumed in a copy
        shutil.copytree(checkpoint, folder / "job")
        args += ["--resume", str(folder / "job")]
    mark = folder / "stalled_at"
    where = {"function": row.function} if row.function else {"phase": phase}
    stall = {"stall": {"rank": row.rank, **where, "nth": row.nth, "mark": str(mark)}}
    limit = T + (EXCUSED_S if row.excused else 0)
    job = sm.run_job(args, folder, "job", cache, bound_s=600, faults=stall,
                     inject=("scripted_schedule",) if row.scripted else (), after_mark_s=limit + 2 * BOUND_S)
    report = "\n".join(line for line in job.log.splitlines() if line.startswith("[digenrl]"))
    return job, float(mark.read_text()) if mark.exists() else None, report


def _slow(folder, cache, checkpoint, rows, recorded):
    """The points of `rows` slowed at once (stall_matrix.slow_faults) in a job that resumes `checkpoint` for two more
    steps, with evaluation, checkpoints, the trace and TAG / TCSS at scripted moments; its calls recorded if
    `recorded` (every part runs the same command, so one part's record has every point). (job, stats, record or
    None)."""
    folder.mkdir()
    stats, record = folder / "stats", folder / "calls"
    stats.mkdir(), record.mkdir()
    shutil.copytree(checkpoint, folder / "run")
    args = [*sm.LAYOUTS["fsdp"], *sm.EVAL, *sm.SAVE, *sm.TRACE, "--steps", "3", "--resume", str(folder / "run"),
            "--excused-timeout-s", f"{sm.SLOW_EXCUSED_S:g}", "--timeout-s", f"{T:g}"]
    job = sm.run_job(args, folder, "run", cache, bound_s=600, faults=sm.slow_faults(str(stats), rows),
                     comm_log=str(record) if recorded else None, inject=("scripted_schedule",))
    return job, sm.read_stats(stats), sm.read_record(record) if recorded else None


@pytest.fixture(scope="module")
def matrix(tiny_cache, tmp_path_factory, request):
    """The jobs of this module's selected tests, JOBS_AT_ONCE at a time: the checkpointed run first, then the slowed
    parts (stall_matrix.slow_parts), then each stalled row. {"slow": [(rows, job, stats, record or None)] (empty
    when no slow test is selected), "stalls": {phase: (job, stalled at, report)}}."""
    names = {item.name for item in request.session.items}
    rows = [p for p in sm.ROWS if f"{STALL_TEST}[{p}]" in names]
    slow = any(name.startswith(SLOW_TESTS) for name in names)
    parts = sm.slow_parts() if slow else []
    folder = tmp_path_factory.mktemp("matrix")
    sm.start_forkserver()
    with concurrent.futures.ThreadPoolExecutor(JOBS_AT_ONCE) as pool:
        checkpoint = pool.submit(_checkpointed, folder, tiny_cache)  # first: the slow runs and "resume" wait for it
        slowed = [pool.submit(lambda i=i, part=part: (part, *_slow(folder / f"slow{i}", tiny_cache,
                                                                   checkpoint.result(), part, i == 0)))
                  for i, part in enumerate(parts)]
        stalls = {p: pool.submit(lambda p=p, i=i: _stall(p, folder / f"row{i}", tiny_cache,
                                                        checkpoint.result() if sm.ROWS[p].resume else None))
                  for i, p in enumerate(rows)}
        return {"slow": [f.result() for f in slowed], "stalls": {p: f.result() for p, f in stalls.items()}}


@pytest.mark.parametrize("phase", list(sm.ROWS))
def test_a_rank_stalled_at_a_blocking_point_ends_the_job_naming_it(phase, matrix):
    """Catches a blocking point liveness cannot see or name: a phase excused without bound (start-up, resume and
    shutdown were, issue 38 defect 1: a trainer hung in load_checkpoint_state was still hung after 25 min), a
    blocking call outside any named phase ("outside any named phase" names nothing), a wait with a deadline of its
    own instead of liveness'. One rank blocks for ever on entering the phase (its heartbeat keeps beating); the
    job must end within --timeout-s + BOUND_S of it (excused phases: + --excused-timeout-s), the ranks' report
    naming that rank inside that phase, as a stall, not as a silent rank."""
    row = sm.ROWS[phase]
    job, stalled_at, report = matrix["stalls"][phase]
    assert stalled_at is not None, f"the job never reached {phase!r} on rank {row.rank}:\n{job.log[-4000:]}"
    took = job.ended - stalled_at
    assert not job.killed_by_test, f"still running {took:.0f} s after the stall (the test killed it):\n" \
                                   f"{report}\n{job.log[-4000:]}"
    limit = T + (EXCUSED_S if row.excused else 0)
    assert job.code != 0 and took < limit + BOUND_S, f"ended {took:.0f} s after the stall:\n{report}"
    assert "no rank made progress" in report and "no sign of life" not in report, f"\n{report}"
    assert re.search(expected(phase, row), report), f"\n{expected(phase, row)}\nnot in\n{report}"


def test_every_blocking_point_slowed_to_several_timeouts_the_job_finishes(matrix):
    """Catches a long phase that reports no progress (issue 38 defect 2: publishing full weights was none, and a
    healthy job publishing for 3 x --timeout-s was killed "inside publish"), an excuse that is too short, a wait
    with a deadline: every point slowed, on its row's rank (a unit never longer than T / 8, many of them), at once
    with the other points of its part (stall_matrix.SLOW_PARTS), and each part's job must finish. Each "stay" row's rank, or a peer waiting for it, stayed 3 T at a time in the point;
    each "total" row's phase 3 T over the run; each "call" row was slowed by T / 2."""
    assert sorted(p for part, *_ in matrix["slow"] for p in part) == sorted(sm.ROWS)  # each row in one part
    tables, stats_of = [], {}
    for part, job, stats, _ in matrix["slow"]:
        assert job.code == 0, f"the slowed job of {part} failed ({job.took_s:.0f} s):\n{job.log[-5000:]}"
        tables.append(f"slowed: {', '.join(part)} ({job.took_s:.0f} s)\n" + "\n".join(f"{phase:28} " + "  ".join(
            f"r{r}: {s[phase]['longest_s']:5.1f} {s[phase]['total_s']:6.1f} +{s[phase]['added_s']:4.1f}"
            if phase in s else f"r{r}:  -" for r, s in sorted(stats.items()))
            for phase in sorted({p for s in stats.values() for p in s})))
        stats_of.update({phase: stats for phase in part})  # each row's point is judged in the job that slowed it
    table = "\n".join(tables)
    print(table)
    short = []
    for phase, row in sm.ROWS.items():
        if row.layout != "fsdp":
            continue
        stats = stats_of[phase]
        seen = [s[phase] for s in stats.values() if phase in s]
        mine = stats[row.rank].get(phase, {})
        if row.slow == "stay":
            ok = bool(seen) and max(x["longest_s"] for x in seen) >= 3 * T
        elif row.slow == "total":
            ok = bool(seen) and max(x["total_s"] for x in seen) >= 3 * T
        else:  # "unit" and "call": slowed on the row's rank
            ok = mine.get("added_s", 0) >= (T / 2 if row.slow == "call" else T / 8)
        if not ok:
            short.append(phase)
    assert not short, f"not slowed to 3 x --timeout-s: {short}\n(longest stay, total stay, + added, per rank)\n{table}"
    # the colocated layout's one point: tests/test_liveness.py's colocated run waits in it while a peer's reward is slow
    assert [p for p, row in sm.ROWS.items() if row.layout != "fsdp"] == ["all-reduce"]


def test_every_blocking_point_has_a_row(matrix):
    """Catches a blocking point without its row (a collective, a wait or an excused section added later) and a
    blocking call outside any named phase (a stall there would be reported as "outside any named phase"): the
    points of the slow run's record, every rank and thread (tests/test_comm_contract.py checks its layouts the
    same way)."""
    points, unnamed = sm.blocking_points(matrix["slow"][0][3])  # the recorded part's (every part: one command)
    assert not unnamed, f"blocking calls outside any named phase: {unnamed}"
    missing = {p: what for p, what in points.items() if p not in sm.ROWS}
    assert not missing, f"blocking points without a row in tests/stall_matrix.py ROWS: {missing}"
    assert {"resume", "publish", "load the pipeline"} <= set(points)  # the record saw the run: its difference counts


def _stalled_then_signalled(phase, rank, args, tmp_path, cache, function=None):
    """A job stalled in `phase` on `rank`; once it is, every rank gets SIGTERM (as torchrun's agent or a scheduler
    sends it). Returns (job, seconds from the signal to the job's end, the ranks' log)."""
    mark = tmp_path / "stalled_at"
    where = {"function": function} if function else {"phase": phase}
    signalled = {}

    def signal_when_stalled():
        while not mark.exists():
            time.sleep(0.1)
        time.sleep(0.5)
        signalled["at"] = time.time()
        for name in os.listdir(tmp_path / "job.pids"):
            try:
                os.kill(int((tmp_path / "job.pids" / name).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass

    threading.Thread(target=signal_when_stalled, daemon=True).start()
    job = sm.run_job(args, tmp_path, "job", cache, bound_s=300,
                     faults={"stall": {"rank": rank, **where, "nth": 1, "mark": str(mark)}}, after_mark_s=120)
    assert "at" in signalled and not job.killed_by_test, f"still running after SIGTERM:\n{job.log[-4000:]}"
    return job, job.ended - signalled["at"], job.log


def test_sigterm_while_a_rank_is_starting_stops_the_job_at_once(tiny_cache, tmp_path):
    """Catches a stop request that only asks for "stop after this step" where no step can come: a trainer hung
    while loading the pipeline (excused here for 600 s) kept the job alive through SIGTERM (issue 38 defect 1;
    tools/gpu_session.sh's `timeout` sends one). A rank still starting has nothing to save and exits at once."""
    args = [*sm.LAYOUTS["fsdp"], "--steps", "1", "--excused-timeout-s", "600"]
    job, took, log = _stalled_then_signalled("load the pipeline", 2, args, tmp_path, tiny_cache, "models:load")
    assert job.code != 0 and took < BOUND_S, (took, log[-3000:])
    assert "rank 2: SIGTERM while starting: nothing to save yet, stopping at once" in log, log[-3000:]


def test_sigterm_ends_a_job_stuck_in_an_excused_phase_after_the_grace(tiny_cache, tmp_path):
    """Catches a stop request that waits for a step that cannot end: the leader hung writing the run directory
    (an excused phase, excused here for 600 s), every rank asked to stop. After a stop request nothing is excused
    and --stop-grace-s of silence ends the job (here well before --timeout-s 60), saying so and naming the rank
    and the phase (the last complete checkpoint stays)."""
    grace = 2.0
    args = [*sm.LAYOUTS["fsdp"], *sm.SAVE, "--steps", "1", "--excused-timeout-s", "600", "--stop-grace-s",
            f"{grace:g}", "--timeout-s", "60"]
    job, took, log = _stalled_then_signalled("write the run directory", 1, args, tmp_path, tiny_cache)
    assert job.code != 0 and took < grace + BOUND_S, (took, log[-3000:])
    assert re.search(r'trainer rank 1 made no progress for \d+ s inside "write the run directory"', log), log[-3000:]
    assert "after a stop request" in log and "asked to stop" in log, log[-3000:]
