"""The harness of the multi-process gloo tests: start 2-3 ranks and collect what each returned or raised;
never hang.

    reports = dist_harness.run(_worker, 2, "some", "args", timeout_s=90)   # {rank: Report}
    assert reports[1].ok and reports[1].value == ...

`_worker(rank, world, store, *args)` must be a module-level function of an importable module (a test
module is: the ranks get the parent's sys.path). It runs after torch.distributed is initialised (gloo, the
default group = all ranks) and returns any picklable value. The ranks are forked from this process's
forkserver, which imported torch, diffusers and main.py once (tests/stall_matrix.py start_forkserver): a fresh
interpreter per rank spent ~10 s of CPU importing them, more than most workers run. Each rank gets the
parent's environment as it is at run(), as a spawned process would.

The store is a TCPStore that THIS process serves on a port the OS picked (port 0) and holds for the
whole run, so no other job can take the port between choosing it and using it (a free port found by
binding and closing a socket can be taken by then). Every rank connects to it as a client.

A rank that raises reports its traceback; one that neither reports nor exits within `timeout_s` is a
hang: the harness kills every rank and fails naming it. With `needed`, the run ends as soon as those
ranks have reported and the others are killed: a failure-path test needs the failing rank's report,
while its peers may be blocked in a receive that will never complete (in a real job the launcher or
liveness stops them).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import queue as queue_lib
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


@dataclasses.dataclass
class Report:
    rank: int
    ok: bool  # returned (True) or raised (False)
    value: object  # what the worker returned, or "ExceptionType: message\n<traceback>"
    seconds: float  # from the rank's start of the worker to its report


def _entry(worker, rank, world, port, timeout_s, reports, args, environment):
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world, timeout=timeout)
    start = time.perf_counter()
    try:
        value = worker(rank, world, store, *args)
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails the test with it)
        reports.put(Report(rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                           time.perf_counter() - start))
        return
    reports.put(Report(rank, True, value, time.perf_counter() - start))
    dist.destroy_process_group()


def run(worker, world: int, *args, timeout_s: float = 90.0, needed: set[int] | None = None) -> dict[int, Report]:
    """Start `world` ranks running worker(rank, world, store, *args); returns {rank: Report} of the ranks that
    reported (all of `needed`, by default every rank). Raises AssertionError naming a rank that hung or died."""
    needed = set(range(world)) if needed is None else set(needed)
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    import stall_matrix

    stall_matrix.start_forkserver()
    ctx = mp.get_context("forkserver")
    reports = ctx.Queue()
    environment = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(worker, r, world, server.port, timeout_s, reports, args, environment),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Report] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not needed <= set(got):
            try:
                report = reports.get(timeout=0.1)
                got[report.rank] = report
                continue
            except queue_lib.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            if dead:
                time.sleep(0.5)  # a report may still be in the pipe
                while not reports.empty():
                    report = reports.get()
                    got[report.rank] = report
                dead = [r for r in dead if r not in got]
                if dead:
                    raise AssertionError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without "
                                         f"reporting; reports: {got}")
            if time.monotonic() > deadline:
                hung = sorted(needed - set(got))
                raise AssertionError(f"rank(s) {hung} did not report within {timeout_s:.0f} s (hung); "
                                     f"reports: {got}")
        if needed == set(range(world)):  # every rank reported: let them leave destroy_process_group cleanly
            for p in procs:
                p.join(max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        del server
    return got


def check(reports: dict[int, Report]) -> dict[int, object]:
    """{rank: value}, or AssertionError with the traceback of every rank that raised."""
    failed = [r for r in reports.values() if not r.ok]
    if failed:
        raise AssertionError("\n".join(f"rank {r.rank} raised {r.value}" for r in failed))
    return {r.rank: r.value for r in reports.values()}
