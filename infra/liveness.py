"""Liveness instead of deadlines: heartbeats in the store, and a watchdog that ends the job when a rank goes silent.

    watch = Liveness(store, rank, roles, timeout_s=300, on_silent=report).start()
    ...                     # the rank's work: steps may take any time as long as every rank is alive
    watch.stop()            # after the last collective that needs the other ranks

A step may take minutes (paper scale), so no wait in digenrl has a deadline (comm.NO_DEADLINE).
What --timeout-s bounds is how long a rank may show *no sign of life*: each rank's watchdog thread
adds 1 to its counter `alive/<rank>` in the torch.distributed store every `interval` seconds, over its
own store connection (a blocking store call of the main thread never delays it), and reads every
other rank's counter. A counter that has not moved for timeout_s means that rank froze (SIGSTOP, a
hung driver), died on another host, or cannot reach the store; a rank on this host whose process is
gone is known at once. The watchdog then reports the rank and its role (`on_silent(message, kind)`),
SIGKILLs a frozen rank on this host (it would otherwise hold its peers' sockets and GPU memory), and
ends its own process with os._exit: the main thread may be blocked inside a C++ collective that
nothing else can interrupt.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

FROZEN, GONE = "frozen", "gone"  # the kinds of report: silent for timeout_s, or its process has exited


class Liveness:
    def __init__(self, store, rank: int, roles: list[str], timeout_s: float,
                 on_silent: Callable[[str, str], None] | None = None, interval_s: float | None = None):
        self.store = store.clone()  # a connection of its own: the main thread may block in store calls
        self.rank, self.roles, self.timeout_s = rank, roles, timeout_s
        self.interval_s = interval_s or min(1.0, timeout_s / 5)
        self.on_silent = on_silent
        self.where: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as each rank registered it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-watchdog", daemon=True)
        self.store.set(f"where/{rank}", f"{socket.gethostname()} {os.getpid()}")

    def start(self) -> "Liveness":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (call once no collective needs the other ranks any more)."""
        self._stop.set()
        self._thread.join()

    def finishing(self) -> None:
        """Say this rank is about to exit normally (before the last barrier), so that its process ending
        a moment before a peer stops its watchdog is not taken for a death."""
        self.store.set(f"done/{self.rank}", "1")

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.roles[rank]})"

    def dead_local_peers(self) -> list[int]:
        """Ranks on this host whose process has exited (or is a zombie nobody reaped yet)."""
        here = socket.gethostname()
        return [r for r, (host, pid) in sorted(self.where.items())
                if r != self.rank and host == here and not _process_alive(pid)]

    def name_the_dead(self, error: BaseException) -> None:
        """After `error` in this rank's work: if a peer on this host has died, say which (a connection reset is
        usually the first sign of it, and torchrun's own report names the rank, not its role)."""
        dead = self.dead_local_peers()
        if dead:
            who = "; ".join(f"{self.describe(r)} died" for r in dead)
            print(f"[digenrl] {who}: {self.describe(self.rank)} stops ({type(error).__name__})",
                  file=sys.stderr, flush=True)

    def _run(self) -> None:
        world = len(self.roles)
        seen = [-1] * world  # last counter value read per rank
        moved = [time.monotonic()] * world  # when it last changed (this host's clock)
        store_ok = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self.store.add(f"alive/{self.rank}", 1)
                for r in range(world):
                    value = self.store.add(f"alive/{r}", 0)
                    if value != seen[r]:
                        seen[r], moved[r] = value, now
                    if r not in self.where and self.store.check([f"where/{r}"]):
                        host, pid = self.store.get(f"where/{r}").decode().split()
                        self.where[r] = (host, int(pid))
                store_ok = now
            except Exception as error:  # noqa: BLE001  the store host (rank 0 or the agent) may be gone
                if self._stop.is_set():
                    return
                if now - store_ok > self.timeout_s:
                    self._fail(f"{self.describe(self.rank)} could not reach the store for {now - store_ok:.0f} s "
                               f"(--timeout-s {self.timeout_s:g}): the rank or agent that hosts it is gone ({error})",
                               GONE)
                continue
            if self._stop.is_set():
                return
            gone = [r for r in self.dead_local_peers() if not self.store.check([f"done/{r}"])]
            if gone:
                self._fail(f"{self.describe(gone[0])} died: its process is gone (seen by {self.describe(self.rank)})",
                           GONE)
            silent = [r for r in range(world) if r != self.rank and now - moved[r] > self.timeout_s]
            if silent:
                r = silent[0]
                self._kill_if_local(r)
                self._fail(f"{self.describe(r)} showed no sign of life for {now - moved[r]:.0f} s "
                           f"(--timeout-s {self.timeout_s:g}): it froze, died or cannot reach the store; "
                           f"seen by {self.describe(self.rank)}", FROZEN)

    def _kill_if_local(self, rank: int) -> None:
        host, pid = self.where.get(rank, ("", 0))
        if host == socket.gethostname() and pid not in (0, os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone already

    def _fail(self, message: str, kind: str) -> None:
        if self.on_silent is not None:
            try:
                self.on_silent(message, kind)
            except Exception:  # noqa: BLE001  reporting must not keep a dead job alive
                pass
        print(f"[digenrl] {message}; stopping", file=sys.stderr, flush=True)
        os._exit(3)


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def on_sigterm_name_the_dead(watch: Liveness | None, rank: int, role: str) -> None:
    """Under torchrun: when the agent stops this rank because another one failed, say which one died
    (torchrun names the rank, not its role) before exiting."""
    def handler(signum, frame):
        dead = watch.dead_local_peers() if watch is not None else []
        who = "; ".join(f"{watch.describe(r)} died" for r in dead) or "another rank failed"
        print(f"[digenrl] {who}: rank {rank} ({role}) stops (SIGTERM)", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
