"""The stall-and-slow matrix's machinery (tests/test_stall_matrix.py): real jobs of main.py's ranks launched from
this process, faults injected into them (tests/inject/faults.py), their blocking calls recorded
(tests/inject/comm_recorder.py), and the blocking points derived from that record.

Jobs are launched in-process (infra.launch.launch, as main.py does) from one multiprocessing forkserver that
imported main.py and the pipeline once: a job then costs its ranks' work, not 15 s of imports per process. The
ranks' own output goes to <folder>/<name>.log (each rank's watchdog prints its report there); the launcher's to this
process's stderr.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import signal
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INJECT = os.path.join(ROOT, "tests", "inject")
if INJECT not in sys.path:
    sys.path.insert(0, INJECT)
HOOKS = ("faults", "comm_recorder", "stall_matrix")  # what the ranks import from tests/ (preloaded too)
WARM = "warm_forkserver"  # preloaded last: the per-process first-use work of every rank, done once (tests/inject)


def rank_entry(payload, rank, world, local_rank, master, agent_store, report_silent):
    """A rank of a test job: its output to the job's log, faults and the recorder installed, then main.run_rank."""
    extra = payload.pop("_test")
    with open(os.path.join(extra["pids"], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    log = os.open(extra["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(extra.get("env") or {})  # before the hooks: scripted_schedule reads its options on import
    import faults
    if extra.get("faults"):  # a job without faults runs the project's code unpatched (conftest.run_forked)
        faults.install(extra["faults"], rank)
    for module in extra.get("inject", ()):  # e.g. scripted_schedule: patches the project on import
        importlib.import_module(module)
    if extra.get("comm_log"):  # after the faults: the recorder then sees the project's own callers
        import comm_recorder
        comm_recorder.install(extra["comm_log"])
    import main
    try:
        return main.run_rank(payload, rank, world, local_rank, master, agent_store, report_silent)
    finally:
        faults.write_stats()


@dataclasses.dataclass
class Job:
    code: int | None  # the launcher's exit status
    took_s: float  # from the launch to the end
    ended: float  # time.time() at the end
    killed_by_test: bool  # the test's bound ran out and it killed the ranks itself
    folder: str
    name: str

    @property
    def log(self) -> str:
        with open(os.path.join(self.folder, f"{self.name}.log"), errors="replace") as f:
            return f.read()


def preload() -> tuple[str, ...]:
    """What the forkserver imports once: main.py, the tiny FLUX pipeline's module, the test hooks, the warm-up."""
    import models
    return ("main", models.get_family("flux").pipeline_module, *HOOKS, WARM)


def start_forkserver() -> None:
    """The forkserver every job's ranks are forked from, importing main.py and the pipeline once (if another test
    of this process started it already, its ranks import what it lacks themselves: slower, same result)."""
    from infra.launch import start_forkserver
    start_forkserver(preload())


def run_job(args: list[str], folder, name: str, cache: str, bound_s: float, faults: dict | None = None,
            comm_log: str | None = None, inject: tuple[str, ...] = (), after_mark_s: float | None = None,
            env: dict[str, str] | None = None) -> Job:
    """main.py's job for `args` (its ranks in this process's forkserver), at most `bound_s` seconds, or
    `after_mark_s` after a stall's mark file appeared: then the test kills the ranks itself (killed_by_test).
    `env`: variables set in each rank before anything of the test or the project runs there."""
    import cli
    from infra.launch import launch
    import comm

    folder = str(folder)
    pids = os.path.join(folder, f"{name}.pids")
    os.makedirs(pids, exist_ok=True)
    cfg = cli.prepare([*args, "--run-name", name, "--out-dir", folder, "--cache-dir", cache, "--no-progress",
                       "--threads", "1"])
    payload = dataclasses.asdict(cfg)
    payload["_test"] = {"pids": pids, "log": os.path.join(folder, f"{name}.log"), "faults": faults,
                        "comm_log": comm_log, "inject": inject, "env": env}
    start_forkserver()
    killed = threading.Event()
    done = threading.Event()
    mark = ((faults or {}).get("stall") or {}).get("mark")

    def bound() -> None:
        deadline = time.time() + bound_s
        while not done.wait(0.2):
            if mark and after_mark_s is not None and os.path.exists(mark):
                deadline = min(deadline, os.path.getmtime(mark) + after_mark_s)
            if time.time() > deadline:
                killed.set()
                kill_ranks(pids)
                return

    threading.Thread(target=bound, daemon=True).start()
    lock = cli.lock_run_dir(cfg)
    start = time.monotonic()
    try:
        code = launch(rank_entry, payload, cfg.nproc, threads=1, start_method="forkserver", preload=preload(),
                      role_of=functools.partial(comm.role_of, cfg.placement, cfg.rollout_ranks, world=cfg.nproc))
    finally:
        took, ended = time.monotonic() - start, time.time()
        done.set()
        lock.release()
        kill_ranks(pids)  # nothing outlives its test
    return Job(code, took, ended, killed.is_set(), folder, name)


def kill_ranks(pids_folder: str) -> None:
    for name in os.listdir(pids_folder):
        try:
            with open(os.path.join(pids_folder, name)) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone already


# --- the blocking points, derived from a record ------------------------------------------------------------------
def read_record(folder) -> list[dict]:
    return [json.loads(line) for f in sorted(os.listdir(folder)) for line in open(os.path.join(folder, f))]


def blocking_points(rows: list[dict]) -> tuple[dict[str, str], list[str]]:
    """({phase: an example of what blocks there}, [blocking calls outside any named phase]) of a record: every
    torch.distributed call and every wait of the project's own code is a blocking point of the phase its thread
    was inside (what liveness names); an excused section is one by definition (it reports nothing)."""
    points: dict[str, str] = {}
    unnamed: list[str] = []
    for row in rows:
        if row["op"] == "phase":
            if row["excused"]:
                points.setdefault(row["phase"], "excused section")
            continue
        what = f'{row["op"]} from {row.get("site") or row.get("file", "?").split("site-packages/")[-1]} ' \
               f'(rank {row["rank"]}, thread {row["thread"]})'
        if row.get("phase") is None:
            unnamed.append(what)
        else:
            points.setdefault(row["phase"], what)
    return points, sorted(set(unnamed))


# --- the matrix --------------------------------------------------------------------------------------------------
TIMEOUT_S = 5.0  # --timeout-s of the matrix's jobs. 3 s was too little on 2 loaded cores (the whole suite: 9 ranks of
# the matrix's three jobs beside the other worker's tests): a heartbeat 3 s late ("no sign of life") ended a row's
# job before its point, and a slowed rank 3 s without a report ended the slow run (2026-12-04, two suite runs)
SMALL = ["--group-size", "2", "--num-steps", "3", "--prompts-per-step", "4", "--seed", "0", "--no-trace",
         "--eval-every", "0", "--eval-seeds", "1", "--eval-prompts", "2", "--save-every", "0",
         "--timeout-s", f"{TIMEOUT_S:g}"]
LAYOUTS = {  # R = 1, K = 2 with FSDP, TSP, TAG and TCSS: every point but the gradient all-reduce; colocated: that
    "fsdp": ["--mode", "digenrl", "--fsdp", "--nproc", "3", "--rollout-ranks", "1", "--fragment-groups", "2",
             *SMALL],
    "colocated": ["--mode", "colocated", "--nproc", "2", "--fragment-groups", "2", *SMALL],
}
EVAL = ["--eval-every", "1"]
SAVE = ["--save-every", "1"]
TRACE = ["--trace"]
ROLES = {"fsdp": ["rollout", "trainer", "trainer"], "colocated": ["colocated", "colocated"]}


@dataclasses.dataclass(frozen=True)
class Row:
    """A blocking point: where to stall it (layout, rank, which entry of the phase) and what the report says."""

    layout: str
    rank: int
    nth: int = 1
    args: tuple = ()  # on top of the layout's: what makes the point happen (evaluation, a checkpoint, ...)
    steps: int = 1
    excused: bool = False  # reports no progress of its own: found after --excused-timeout-s, then --timeout-s
    scripted: bool = False  # TAG and TCSS at scripted moments (tests/inject/scripted_schedule.py)
    names: str | None = None  # the phase the report names for this rank, when not the point's own (an idle wait)
    thread: str | None = None  # a background thread's phase: the report names the thread
    resume: bool = False  # resumes a checkpoint (test_stall_matrix.py's `checkpointed`)
    function: str | None = None  # stall inside this function instead ("module:qualname"), where a defect was found
    # The slow half (slow_faults), what the slowed run must show: "stay", a rank stayed 3 T at a time in the
    # phase (a wait while a peer works, a phase of many units, an excused phase inside its patience); "total",
    # 3 T over the run in a phase entered per fragment or update, made of units that report progress; "unit",
    # a phase of one or two calls per fragment: each slowed (a step of many is several T long: the stay rows);
    # "call", one collective every rank enters together, slowed by T / 2 (a single call silent for longer than
    # T is a hang by definition).
    slow: str = "stay"


ROWS = {
    # start-up: every rank, before its loop
    "connect": Row("fsdp", 2, slow="call"),
    "process groups": Row("fsdp", 2, slow="call"),
    "align clocks": Row("fsdp", 2, slow="call"),
    "load the pipeline": Row("fsdp", 2, excused=True, function="models:load"),
    "build the reward": Row("fsdp", 0, excused=True),
    # reading a checkpoint (and, under FSDP, DTensor's scatter); issue 38 defect 1 was found hung in here
    "resume": Row("fsdp", 2, resume=True, function="infra.checkpoint_state:load"),
    # the rollout rank
    "wait": Row("fsdp", 0),  # for the weights of its step (trainers: for the next fragment, the same code path)
    "reward": Row("fsdp", 0, excused=True),
    "send": Row("fsdp", 0, thread="fragment-sender"),
    "next publish": Row("fsdp", 0, names="wait"),  # the mailbox's idle wait: the main thread waits for weights
    "receive weights": Row("fsdp", 0, thread="weight-mailbox"),
    "wait for the trainers' end": Row("fsdp", 0),
    # the trainers
    "recv": Row("fsdp", 1, slow="unit"),
    "command broadcast": Row("fsdp", 2),
    "fragment broadcast": Row("fsdp", 2, slow="unit"),
    "tag": Row("fsdp", 2, steps=2, scripted=True, slow="unit"),
    "tag share": Row("fsdp", 2, steps=2, scripted=True, slow="unit"),
    "train": Row("fsdp", 2, slow="unit"),
    "optimizer": Row("fsdp", 2, slow="total"),
    "grad-norm all-reduce": Row("fsdp", 2, slow="call"),
    "loss-check all-reduce": Row("fsdp", 2, slow="call"),
    "metrics all-reduce": Row("fsdp", 2, slow="total"),
    "all-reduce": Row("colocated", 1, slow="call"),  # the gradients' (FSDP reduce-scatters them in "train")
    "publish": Row("fsdp", 1, nth=2),  # the leader's first publish after an update
    "eval": Row("fsdp", 2, args=tuple(EVAL), slow="unit"),
    "evaluation gather": Row("fsdp", 2, args=tuple(EVAL), slow="call"),  # every trainer's share of the evaluation
    "checkpoint": Row("fsdp", 2, args=tuple(SAVE)),
    "write the run directory": Row("fsdp", 1, args=tuple(SAVE), excused=True),
    # shutdown
    "trace gather": Row("fsdp", 2, args=tuple(TRACE), slow="call"),
    "write the trace": Row("fsdp", 1, args=tuple(TRACE), excused=True),
    "last barrier": Row("fsdp", 2),
}


# --- the slow half: every point slowed, in SLOW_PARTS jobs side by side ----------------------------------------------
EXCUSED = [p for p, row in ROWS.items() if row.excused]
# A slowed point adds up to 3 T on its rank, and the points of one rank follow each other: one job slowing all of
# them took 231 s (2026-12-05), the matrix's longest path by far. So the points are split over two jobs of the same
# command that run side by side, each slowing its part at once (balanced by the seconds each point added in that
# one job: ~115 s of delay each; three parts cost a third job's start-up and steps for a path the stalled rows are
# longer than anyway). A row named in no part is slowed in the last one, so a new row is never left out.
SLOW_PARTS = (  # a "stay" row goes with the slowed points its long wait comes from (what its peer is doing meanwhile)
    # start-up, resume, the rollout rank's reward and weights (the leader waits for its fragments meanwhile, and
    # rank 2 in "command broadcast" for the leader), publishing and evaluation
    ("connect", "process groups", "align clocks", "load the pipeline", "build the reward", "resume", "wait", "reward",
     "next publish", "receive weights", "recv", "fragment broadcast", "tag share", "command broadcast", "publish",
     "eval", "evaluation gather"),
    # a step's training and its collectives (the rollout rank's sender waits for the trainers meanwhile),
    # checkpoints and the trace (the rollout rank waits for the trainers' end meanwhile, and rank 2 at the last
    # barrier for the leader writing the trace), and every row named in no part
    ("tag", "train", "optimizer", "grad-norm all-reduce", "loss-check all-reduce", "metrics all-reduce", "send",
     "checkpoint", "write the run directory", "trace gather", "write the trace", "wait for the trainers' end",
     "last barrier"),
)


def slow_parts() -> list[list[str]]:
    """The rows of each slowed job: SLOW_PARTS, the last part taking every row named in none (each row once)."""
    named = [p for part in SLOW_PARTS for p in part]
    assert len(named) == len(set(named)) and set(named) <= set(ROWS), "SLOW_PARTS names a row twice or no row"
    return [list(part) for part in SLOW_PARTS[:-1]] + [[*SLOW_PARTS[-1], *(p for p in ROWS if p not in named)]]


def slow_faults(stats: str, rows: list[str] | None = None) -> dict:
    """Each row's phase (of `rows`, default every row) slowed on its rank: every unit of progress and every blocking
    call of the project's own code there waits TIMEOUT_S / 8, until 3 TIMEOUT_S were added; an excused phase waits
    3 TIMEOUT_S on entering (inside its patience), a "call" row TIMEOUT_S / 2; publishing goes in 4 KiB buckets (a
    real model's are many)."""
    phases = {}
    for phase, row in ROWS.items():
        if rows is not None and phase not in rows:
            continue
        entry = 3 * TIMEOUT_S if row.excused else TIMEOUT_S / 2 if row.slow == "call" else None
        phases[phase] = {"rank": row.rank, **({"entry_s": entry} if entry else {})}
    buckets = {"bucket_bytes": 4096} if {"publish", "receive weights"} & set(phases) else {}  # only where slowed
    return {"slow": {"unit_s": TIMEOUT_S / 8, "budget_s": 3 * TIMEOUT_S, "phases": phases, **buckets},
            "stats": stats}


SLOW_EXCUSED_S = 8 * TIMEOUT_S  # --excused-timeout-s of the slow runs: an excused phase slowed by 3 T still fits


def read_stats(folder) -> dict[int, dict]:
    return {int(f[:-5]): json.load(open(os.path.join(folder, f))) for f in os.listdir(folder) if f.endswith(".json")}
