"""The self-spawning launcher: start P ranks on this host, watch them, and name the rank that failed first.

    code = launch(run_rank, cfg_dict, nproc=2, role_of=lambda r: "rollout" if r == 0 else "trainer")

Under torchrun each process is a rank and torchrun watches them; started as one process, main.py
spawns the ranks here. If one rank fails (an exception, a signal, or a silent peer reported by its
watchdog, infra/liveness.py), the others are stopped (SIGTERM, then SIGKILL after 10 s: a frozen
process ignores SIGTERM) and the exit message names the first failure: a rank killed by a signal,
else the earliest report.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable

from infra.liveness import FROZEN, GONE, STALLED  # reports of a liveness watchdog: the message names the rank itself


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(target, rank, world, port, payload, failures, threads):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import faulthandler
    faulthandler.enable()  # a rank that aborts in native code (SIGABRT/SIGSEGV) still prints its Python stack

    def report_silent(message: str, kind: str) -> None:
        failures.put((time.time(), rank, message, kind))

    try:
        target(payload, rank, world, rank, ("127.0.0.1", port), False, report_silent)
    except BaseException as exc:
        failures.put((time.time(), rank, f"{type(exc).__name__}: {exc}", "error"))  # the launcher names it
        raise


def first_failure(exitcodes: list, reports: list, role_of: Callable[[int], str]) -> str | None:
    """The failure to name: a frozen rank (a watchdog then SIGKILLs it), else a stuck job (no rank made
    progress), else a rank killed by SIGKILL, else the earliest report, else any non-zero exit."""
    frozen = sorted(r for r in reports if r[3] == FROZEN)
    if frozen:
        return frozen[0][2]
    stalled = sorted(r for r in reports if r[3] == STALLED)  # every rank's watchdog saw it: the first one's words
    if stalled:
        return stalled[0][2]
    killed = [r for r, code in enumerate(exitcodes) if code == -9]
    if killed:
        return f"rank {killed[0]} ({role_of(killed[0])}) was killed by signal 9"
    if reports:
        _, r, message, kind = min(reports)
        if kind == GONE:
            return message
        return f"rank {r} ({role_of(r)}) failed: {message.splitlines()[0][:300]}"
    dead = [(r, code) for r, code in enumerate(exitcodes) if code not in (None, 0)]
    if dead:
        r, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {r} ({role_of(r)}) {how}"
    return None


def launch(target, payload, nproc: int, role_of: Callable[[int], str], threads: int = 1) -> int:
    """Spawn `nproc` ranks running target(payload, rank, world, local_rank, master, agent_store, report_silent);
    returns 0, or 1 after printing which rank failed first."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=_entry, args=(target, r, nproc, port, payload, failures, threads))
             for r in range(nproc)]
    for p in procs:
        p.start()
    while all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    if all(p.exitcode == 0 for p in procs):
        return 0
    time.sleep(0.5)  # let the ranks that failed first report before we decide who it was
    reports = []
    while not failures.empty():
        reports.append(failures.get())
    message = first_failure([p.exitcode for p in procs], reports, role_of)
    print(f"[digenrl] {message}; stopping the other ranks", file=sys.stderr, flush=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.kill()
            p.join(5)
    return 1
