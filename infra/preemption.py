"""Preemption: SIGTERM (or SIGINT) stops a run at the end of the current step, with a checkpoint to resume from.

    preemption = Preemption(store, rank, world, urgent=..., finishing=watch.finishing, starting=...,
                            on_request=watch.asked_to_stop).start()  # every rank
    asked = preemption.stop_asked()      # trainers, per step: max-reduced with the step's metrics (all agree)
    ...                                  # the leader writes the step's checkpoint, then:
    preemption.finish(leader=True)       # announce it; every rank exits with EXIT_PREEMPTED (never returns)

Schedulers stop a job by sending SIGTERM, waiting a grace period (SLURM's KillWait, Kubernetes'
terminationGracePeriodSeconds: ~30 s), then SIGKILL. On the first SIGTERM or SIGINT a rank only notes the
request (and posts it in the store, so a request that reached one rank reaches all); the trainers read it
at the end of each step through the step's metric reduction, so all of them decide at the same step; the
leader writes that step's checkpoint and the reward curve, prints where to resume from, and announces it in
the store; every rank then exits with status 75 (EX_TEMPFAIL: "try again later", i.e. --resume).
A rank still starting (loading, before its loop) has nothing to save and exits at once (status 128 + signal):
the run directory is as it was. A running rank also tells liveness (`on_request`): from then on a job that makes
no progress for --stop-grace-s ends (infra/liveness.py), so a rank stuck in a collective, a disk or a reward
ends within that grace instead of waiting for the scheduler's SIGKILL; its step's checkpoint is then lost, the
last complete one stays.
Another signal more than SAME_REQUEST_S later exits at once (status 128 + signal): a checkpoint being
written is lost whole, never half-written (infra/rundir.py writes a folder and renames it), and so is
one cut by the grace period's SIGKILL. Two signals less than SAME_REQUEST_S apart are one request: a
scheduler's SIGTERM to every process plus the launcher's forwarded copy, or a terminal's Ctrl-C (SIGINT
to the whole process group) plus the launcher's SIGTERM.

Signals are read through the wakeup fd of Python's signal module by a thread: the moment one is delivered,
even while the main thread is blocked in a collective (a Python handler would only run after it returns).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint; continue with --resume
SAME_REQUEST_S = 2.0  # signals closer than this are one stop request
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.25  # how often a rank looks for the leader's announcement
EXIT_WAIT_S = 10.0
HOST_LINGER_S = 1.0  # how long a rank waits for the others to be on their way out (the store's host leaves last)


class Preempted(Exception):
    """Raised by a trainer's step end when the trainers agreed to stop there (its checkpoint is written)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}")
        self.step = step


def _ignore(signum, frame) -> None:  # the wakeup fd reports the signal; the StopSignals thread acts on it
    pass


class StopSignals:
    """SIGTERM / SIGINT as they are delivered: on_first(signum) for the first, on_again(signum) for one more than
    SAME_REQUEST_S later. install() from the main thread; uninstall() restores what was there."""

    def __init__(self, on_first: Callable[[int], None], on_again: Callable[[int], None]):
        self.on_first, self.on_again = on_first, on_again
        self.first_at: float | None = None
        self._old: dict = {}
        self._fds: tuple[int, int] | None = None
        self._old_wakeup = -1

    def install(self) -> "StopSignals":
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block
        self._fds = (read, write)
        self._old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        for s in STOP_SIGNALS:
            signal.signal(s, _ignore)
        threading.Thread(target=self._run, args=(read,), name="stop-signals", daemon=True).start()
        return self

    def uninstall(self) -> None:
        if self._fds is None:
            return
        signal.set_wakeup_fd(self._old_wakeup)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        os.close(self._fds[1])  # the reader sees end of file and returns
        self._fds = None

    def _run(self, read: int) -> None:
        try:
            while data := os.read(read, 64):
                for signum in data:  # one byte per delivered signal
                    if signum not in STOP_SIGNALS:
                        continue
                    now = time.monotonic()
                    if self.first_at is None:
                        self.first_at = now
                        self.on_first(signum)
                    elif now - self.first_at > SAME_REQUEST_S:
                        self.on_again(signum)
        finally:
            os.close(read)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Preemption:
    """One rank's side of a graceful stop (see the module docstring). `store`: the job's store (None at world size
    1); `urgent()`: a message when stopping gracefully is pointless (a peer is dead), then the first signal exits
    at once; `finishing()`: tells liveness this rank's exit is no death."""

    def __init__(self, store, rank: int, world: int, urgent: Callable[[], str | None] = lambda: None,
                 finishing: Callable[[], None] = lambda: None, hosts_store: bool = False,
                 starting: Callable[[], bool] = lambda: False, on_request: Callable[[], None] = lambda: None,
                 grace_s: float | None = None):
        """`starting()`: the rank has not begun its loop (a stop exits at once); `on_request()`: called on the first
        signal of a running rank (liveness' grace); `grace_s`: --stop-grace-s, for the message."""
        self.store = store.clone() if store is not None else None  # a connection of its own
        self.rank, self.world, self.urgent, self.finishing = rank, world, urgent, finishing
        self.starting, self.on_request, self.grace_s = starting, on_request, grace_s
        self.hosts_store = hosts_store  # this rank's process serves the store: it leaves last
        self.asked = threading.Event()
        self.exiting = threading.Event()  # set once this rank is on its way out with EXIT_PREEMPTED
        self._exit_lock = threading.Lock()
        self.signals = StopSignals(self._first, self._again)
        self._closed = threading.Event()

    def start(self) -> "Preemption":
        self.signals.install()
        if self.store is not None:
            threading.Thread(target=self._watch, name="preemption-watch", daemon=True).start()
        return self

    def close(self) -> None:
        """Normal end: stop watching, give the signals back."""
        self._closed.set()
        self.signals.uninstall()

    def _first(self, signum: int) -> None:
        message = self.urgent()
        if message:
            print(f"[digenrl] {message}: rank {self.rank} stops ({signal_name(signum)})", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        if self.starting():
            print(f"[digenrl] rank {self.rank}: {signal_name(signum)} while starting: nothing to save yet, stopping "
                  "at once (the run directory is as it was)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + signum)
        grace = (f"; if no rank makes progress for --stop-grace-s {self.grace_s:g} it stops without it"
                 if self.grace_s is not None else "")
        print(f"[digenrl] rank {self.rank}: {signal_name(signum)}: the run stops after the current step with a "
              f"checkpoint{grace} (signal again after {SAME_REQUEST_S:g} s to stop at once)", file=sys.stderr,
              flush=True)
        self.asked.set()
        self.on_request()
        if self.store is not None:
            try:
                self.store.set("stop/asked", str(self.rank))
            except Exception:  # noqa: BLE001  the store's host may be gone; this rank's own flag still counts
                pass

    def _again(self, signum: int) -> None:
        print(f"[digenrl] rank {self.rank}: {signal_name(signum)} again: stopping at once (no checkpoint of this "
              "step; the last complete one stays)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def stop_asked(self) -> bool:
        """This rank was signalled, or (through the store) another one was."""
        if self.asked.is_set():
            return True
        try:
            return self.store is not None and self.store.check(["stop/asked"])
        except Exception:  # noqa: BLE001
            return False

    def finish(self, leader: bool) -> None:
        """After the agreed step: the leader (its checkpoint on disk) announces it; every rank exits. Never returns."""
        if leader and self.store is not None:
            self.store.set("stop/done", str(self.rank))
        # (a store that went away here: its host left, which it does only once the stop was announced)
        while self.store is not None and not self._announced(if_unreachable=True):
            time.sleep(POLL_S)
        self._exit()

    def _announced(self, if_unreachable: bool) -> bool:
        try:
            return self.store.check(["stop/done"])
        except Exception:  # noqa: BLE001
            return if_unreachable

    def _watch(self) -> None:  # every rank: the rollout ranks learn of the stop only here
        while not self._closed.wait(POLL_S):
            if self._announced(if_unreachable=False):  # an unreachable store is liveness' business, not a stop
                self._exit()

    def absorb(self, error: BaseException) -> None:
        """An error of the main thread after this rank began its preempted exit is the peers leaving (a closed
        connection): let the exit finish (it ends the process) instead of reporting a failure."""
        if self.exiting.is_set():
            while True:
                time.sleep(1.0)

    def _exit(self) -> None:
        with self._exit_lock:  # once per process (the main thread and the watch thread may both get here)
            if self.exiting.is_set():
                first = False
            else:
                self.exiting.set()
                first = True
        if not first:
            while True:
                time.sleep(1.0)
        self.finishing()
        if self.store is not None:  # whoever hosts the store leaves after everyone counted themselves out
            try:
                self.store.add("stop/exited", 1)
                deadline = time.monotonic() + EXIT_WAIT_S
                while self.store.add("stop/exited", 0) < self.world and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.hosts_store:
                    time.sleep(HOST_LINGER_S)  # the others leave on seeing the count: let them, then close the store
            except Exception:  # noqa: BLE001
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)
