"""The self-spawning launcher: start P ranks on this host, watch them, and name the rank that failed first.

    code = launch(run_rank, cfg_dict, nproc=2, role_of=lambda r: "rollout" if r == 0 else "trainer")

Under torchrun each process is a rank and torchrun watches them; started as one process, main.py
spawns the ranks here. If one rank fails (an exception, a signal, or a silent peer reported by its
watchdog, infra/liveness.py), the others are SIGKILLed and the exit message names the first failure:
a rank killed by a signal, else the earliest report.

- The store's port: the OS picks a free one for a socket that is bound and listening *before* the ranks
  start and is handed to rank 0, whose store serves on it (TCPStore's master_listen_fd). Nothing can take the
  port in between, so any number of jobs started together on one host each get their own store (binding,
  closing and rebinding a "free" port let two jobs pick the same one: EADDRINUSE).
- Stopping: SIGTERM or SIGINT to the launcher is forwarded (once) to every rank, which stop after the current
  step with a checkpoint (infra/preemption.py); the launcher waits for them and exits with their status 75.
  Another signal more than preemption.SAME_REQUEST_S later SIGKILLs the ranks at once.
- The ranks die with the launcher (infra/lifeline.py): a SIGKILLed launcher leaves no rank behind. They also
  inherit the run lock's descriptor (`held_fd`), so the run directory stays locked until the last of them is gone,
  and get the job store's secret (DIGENRL_JOB_SECRET if set, else a new random one: infra/jobstore.py).
- CPU ranks are forked from a forkserver that imported torch, diffusers and main.py once (start_method_for,
  infra/rank_server.py); ranks that may use CUDA are spawned fresh.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from infra import lifeline
from infra.liveness import FROZEN, GONE, STALLED  # reports of a liveness watchdog: the message names the rank itself
from infra.preemption import EXIT_PREEMPTED, StopSignals, signal_name

HOST = "127.0.0.1"
SECRET_ENV = "DIGENRL_JOB_SECRET"  # the job store's secret (infra/jobstore.py): set in every rank by launch()
PREEMPTED_WAIT_S = 60.0  # after one rank exited preempted, the others must follow within this


def listening_socket(host: str = HOST) -> socket.socket:
    """A TCP socket on a port the OS picked, bound and listening: the port stays ours until the socket is closed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def open_store(master: tuple, world: int, is_master: bool, timeout_s: float):
    """The job's TCPStore at master = (host, port[, listening socket]): with a socket, the host rank serves on it.
    (torch is imported here, not at the top: the launcher process needs none of it.)"""
    import torch.distributed as dist

    host, port = master[0], master[1]
    listener = master[2] if len(master) > 2 else None
    extra = {"master_listen_fd": listener.detach()} if is_master and listener is not None else {}
    return dist.TCPStore(host, port, world, is_master=is_master, timeout=datetime.timedelta(seconds=timeout_s),
                         **extra)


def _let_the_forkserver_go() -> None:
    """A forkserver lives while anyone holds its `alive` pipe, and multiprocessing hands every child a copy: the
    ranks would keep it (their parent) alive after a SIGKILLed launcher, and their PR_SET_PDEATHSIG would never
    fire. Closing the rank's copy leaves the launcher the only holder, so the forkserver, then the ranks, end
    with it. (The ranks start no processes through it.)"""
    from multiprocessing import forkserver
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


class InheritedFd:
    """An open file descriptor every rank keeps for its whole life: the run lock's (infra/runlock.py), whose flock
    is then released only when the launcher and every rank are gone. Pickled for spawned and forkserver ranks the
    way multiprocessing hands over sockets (reduction.DupFd); a forked rank has it already."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup) -> InheritedFd:
    return InheritedFd(dup.detach())


_KEPT: list[int] = []  # descriptors a rank holds until it exits (never closed: the kernel closes them at exit)


def _entry(target, rank, world, master, payload, failures, threads, launcher_pid, held=None, secret=None):
    if os.getppid() == launcher_pid:  # spawned
        lifeline.die_with_parent(launcher_pid)
    else:  # forked by the forkserver, which must end with the launcher for the lifeline to hold
        _let_the_forkserver_go()
        lifeline.die_with_parent()
    if held is not None:
        os.set_inheritable(held.fd, False)  # a process the rank starts must not keep the run locked
        _KEPT.append(held.fd)
    if secret is not None:  # through the start method's pipe: never on a command line
        os.environ[SECRET_ENV] = secret
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import faulthandler
    faulthandler.enable()  # a rank that aborts in native code (SIGABRT/SIGSEGV) still prints its Python stack

    def report_silent(message: str, kind: str) -> None:
        failures.put((time.time(), rank, message, kind))

    try:
        target(payload, rank, world, rank, master, False, report_silent)
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


class _Forwarder:
    """The launcher's stop signals: the first is forwarded to every rank once, another one SIGKILLs them."""

    def __init__(self, procs):
        self.procs, self.signum, self.killed = procs, None, False

    def first(self, signum: int) -> None:
        self.signum = signum
        print(f"[digenrl] launcher: {signal_name(signum)}: the ranks stop after the current step with a checkpoint",
              file=sys.stderr, flush=True)
        _signal_all(self.procs, signal.SIGTERM)

    def again(self, signum: int) -> None:
        self.killed = True
        print(f"[digenrl] launcher: {signal_name(signum)} again: killing the ranks", file=sys.stderr, flush=True)
        _signal_all(self.procs, signal.SIGKILL)


def _signal_all(procs, signum: int) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signum)
            except OSError:
                pass  # gone already


def start_method_for(device: str) -> str:
    """"forkserver" for CPU ranks (imports paid once, infra/rank_server.py), "spawn" where ranks may use CUDA: a
    process forked from one that touched CUDA cannot use it, and a GPU rank's start is minutes of weights anyway."""
    if device == "cpu":
        return "forkserver"
    import torch
    return "spawn" if device == "cuda" or torch.cuda.is_available() else "forkserver"


def main_module() -> str | None:
    """The name the running script imports as (main.py -> "main"), for a forkserver to preload; None if it cannot."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    folder = os.path.dirname(os.path.abspath(path))
    on_path = any(os.path.abspath(p or os.getcwd()) == folder for p in sys.path)
    return os.path.basename(path)[:-3] if on_path else None


def start_forkserver(preload: tuple[str, ...]) -> None:
    """This process's forkserver (started once: a running one keeps what it imported), importing the SIGTERM guard
    (infra/rank_server.py) and then `preload`, with this process's sys.path. Python 3.11's forkserver drops the
    sys_path it is handed and swallows a preload's ImportError: run from another folder (`python /path/main.py`)
    it imported neither main.py nor the guard, and every rank imported torch and diffusers itself."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(["infra.rank_server", *preload])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.getcwd()) for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def launch(target, payload, nproc: int, role_of: Callable[[int], str], threads: int = 1,
           start_method: str = "spawn", preload: tuple[str, ...] = (), held_fd: int | None = None) -> int:
    """Spawn `nproc` ranks running target(payload, rank, world, local_rank, master, agent_store, report_silent);
    returns 0, EXIT_PREEMPTED when they stopped on a signal with a checkpoint, 128 + signal when killed on a
    second signal, or 1 after printing which rank failed first. `start_method`: "spawn" (fresh processes, as
    CUDA needs), "forkserver" (CPU: `preload` modules imported once, the ranks forked from that process), or
    "fork" only for tests whose ranks should share the launcher's imports (tests/rendezvous_job.py). `held_fd`:
    a descriptor every rank keeps open until it exits (the run lock's)."""
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        start_forkserver(preload)
    listener = listening_socket()  # held until rank 0's store serves on it
    master = (HOST, listener.getsockname()[1])
    failures = ctx.SimpleQueue()
    held = InheritedFd(held_fd) if held_fd is not None else None
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)  # the job store's (infra/jobstore.py)
    procs = [ctx.Process(target=_entry, args=(target, r, nproc, master + ((listener,) if r == 0 else ()), payload,
                                              failures, threads, os.getpid(), held, secret))
             for r in range(nproc)]
    forwarder = _Forwarder(procs)
    signals = StopSignals(forwarder.first, forwarder.again)
    if threading.current_thread() is threading.main_thread():
        signals.install()
    try:
        for p in procs:
            p.start()
        code = _watch(procs, failures, role_of, forwarder)
    finally:
        signals.uninstall()
        listener.close()
    return code


def _watch(procs, failures, role_of, forwarder: _Forwarder) -> int:
    preempted_at = None
    while any(p.is_alive() for p in procs):
        codes = [p.exitcode for p in procs]
        if forwarder.killed or any(c not in (None, 0, EXIT_PREEMPTED) for c in codes):
            break
        if EXIT_PREEMPTED in codes:
            preempted_at = preempted_at or time.monotonic()
            if time.monotonic() - preempted_at > PREEMPTED_WAIT_S:
                break
        time.sleep(0.05)
    for p in procs:
        p.join(0.5 if forwarder.killed else 0)
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    if all(c in (0, EXIT_PREEMPTED) for c in codes):
        return EXIT_PREEMPTED
    if forwarder.killed:
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            p.join(5)
        return 128 + forwarder.signum
    time.sleep(0.5)  # let the ranks that failed first report before we decide who it was
    reports = []
    while not failures.empty():
        reports.append(failures.get())
    message = first_failure(codes, reports, role_of)
    if forwarder.signum is not None:
        message = f"stopped by {signal_name(forwarder.signum)}; {message or 'a rank did not stop cleanly'}"
    print(f"[digenrl] {message}; stopping the other ranks", file=sys.stderr, flush=True)
    _signal_all(procs, signal.SIGKILL)  # a failed job: nothing left to finish (checkpoints are atomic)
    for p in procs:
        p.join(10)
    return 1
