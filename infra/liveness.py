"""Liveness instead of deadlines: heartbeats and progress in the store, and a watchdog that ends a job that is stuck.

    watch = Liveness(store, rank, roles, timeout_s=300, on_silent=report, progress=progress).start()
    ...                     # the rank's work: steps may take any time as long as some rank makes progress
    watch.asked_to_stop()   # SIGTERM (infra/preemption.py): from now on --stop-grace-s of silence ends the job
    watch.stop()            # after the last collective that needs the other ranks

A step may take minutes (paper scale), so no wait in digenrl has a deadline (comm.NO_DEADLINE). Each rank's
watchdog thread, over its own store connection (a blocking store call of the main thread never delays it),
every `interval` seconds:
- beats `alive/<rank>` (process alive, store reachable) and reads everyone's: a counter still for timeout_s
  means that rank froze (SIGSTOP, a hung driver), died on another host, or cannot reach the store; a rank on
  this host whose process is gone is known at once;
- publishes `progress/<rank>`: its main thread's progress counter and what it is inside
  (infra/progress.py), and reads everyone's. A heartbeat is no proof of work: a main thread blocked in a
  collective (`Work.wait()`, `torch.cuda.synchronize()` release the GIL) leaves the heartbeat thread
  beating. When no rank's progress has moved for timeout_s, the job is stuck: a rank waiting for another
  is not, as long as that one progresses, and a hang anywhere stops every rank once the others run out
  of work. The message names each rank, its role, what it was inside and its step, e.g.
  `trainer rank 2 made no progress for 300 s inside "all-reduce" (step 17)`.
- excuses with bounded patience: while its main thread is inside an `excused` section (loading the pipeline, a
  reward function, writing files: code that cannot report progress) the watchdog moves the rank's counter itself,
  for at most `excused_timeout_s` (--excused-timeout-s, default EXCUSED_TIMEOUT_FACTOR x timeout_s) since the
  section began or the main thread last bumped inside it, or until the bound a section states (`up_to_s`: a
  remote reward's deadlines and retries); past that its silence counts like any other's, so a
  hung disk, download or reward ends the job within excused_timeout_s + timeout_s, named;
- after a stop request (`asked_to_stop`, SIGTERM on a running rank) nothing is excused any more and the job
  ends once no rank has progressed for min(timeout_s, stop_grace_s): a healthy job finishes its step and writes
  its checkpoint (publishing, gathering and writing one report progress per tensor), a stuck one ends within
  the grace period instead of waiting for a scheduler's SIGKILL.
The watchdog then reports (`on_silent(message, kind)`), SIGKILLs a frozen rank on this host (it would
otherwise hold its peers' sockets and GPU memory), and ends its own process with os._exit: the main thread
may be blocked inside a C++ collective that nothing else can interrupt.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

# the kinds of report: silent for timeout_s, its process has exited, or no rank progressed for timeout_s
FROZEN, GONE, STALLED = "frozen", "gone", "stalled"
MAX_LISTED = 8  # ranks named in a stall report (the longest still first)
EXCUSED_TIMEOUT_FACTOR = 4  # --excused-timeout-s unset: this many --timeout-s
NAME_THE_DEAD_WAIT_S = 2.0  # after an error, how long to look for a local peer that died (error path only)


class Liveness:
    def __init__(self, store, rank: int, roles: list[str], timeout_s: float,
                 on_silent: Callable[[str, str], None] | None = None, interval_s: float | None = None,
                 progress=None, excused_timeout_s: float | None = None, stop_grace_s: float = 30.0):
        self.store = store.clone()  # a connection of its own: the main thread may block in store calls
        self.rank, self.roles, self.timeout_s = rank, roles, timeout_s
        self.progress = progress  # infra.progress.Progress of this rank's main thread (None: heartbeats only)
        self.excused_timeout_s = excused_timeout_s or EXCUSED_TIMEOUT_FACTOR * timeout_s
        self.stop_grace_s = stop_grace_s
        self.asked_at: float | None = None  # when this rank was asked to stop (time.monotonic())
        self._own_seen, self._own_moved = -1, time.monotonic()  # the main thread's own count, when it last moved
        self.interval_s = interval_s or min(1.0, timeout_s / 5)
        self.on_silent = on_silent
        self.where: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as each rank registered it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-watchdog", daemon=True)
        self.store.set(f"where/{rank}", f"{socket.gethostname()} {os.getpid()}")
        if progress is not None:
            self._publish_progress()

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

    def asked_to_stop(self) -> None:
        """A stop was requested (SIGTERM; any thread): from now on excused sections count as silence and the job
        ends once no rank has progressed for min(--timeout-s, --stop-grace-s)."""
        if self.asked_at is None:
            self.asked_at = time.monotonic()

    def silence_limit_s(self) -> float:
        """How long the job may make no progress before it counts as stuck."""
        return self.timeout_s if self.asked_at is None else min(self.timeout_s, self.stop_grace_s)

    def _excuse(self, now: float) -> str:
        """Move the counter for a main thread inside an excused section, within its patience; the note for the
        description once it is past it."""
        own = self.progress.count
        if own != self._own_seen:
            self._own_seen, self._own_moved = own, now
        since = self.progress.excused_since()
        if since is None:
            return ""
        if self.asked_at is not None:
            return "; not excused after a stop request"
        stated = self.progress.excused_until_s()  # a section that knows how long it can take (a remote reward)
        if stated is not None:
            if now < stated:
                self.progress.tick()
                return ""
            return "; silent past its stated bound"
        quiet = now - max(since, self._own_moved)  # a bump inside the section restarts its patience
        if quiet < self.excused_timeout_s:
            self.progress.tick()
            return ""
        return f"; silent past --excused-timeout-s {self.excused_timeout_s:g}"

    def _publish_progress(self, now: float | None = None) -> None:
        note = self._excuse(time.monotonic() if now is None else now)
        self.store.set(f"progress/{self.rank}", f"{self.progress.value()}|{self.progress.describe()}{note}")

    def _read_progress(self, known: set[int]) -> dict[int, tuple[int, str]]:
        """rank -> (progress value, what it is inside) of every rank that has published one (one round trip
        once all have)."""
        world = len(self.roles)
        known.update(r for r in range(world) if r not in known and self.store.check([f"progress/{r}"]))
        ranks = sorted(known)
        values = self.store.multi_get([f"progress/{r}" for r in ranks]) if ranks else []
        out = {}
        for r, raw in zip(ranks, values):
            value, _, doing = raw.decode().partition("|")
            out[r] = (int(value), doing)
        return out

    def stall_message(self, still_s: dict[int, float], doing: dict[int, str]) -> str:
        """The report of a stuck job: each rank, longest still first, with what it was inside and its step."""
        order = sorted(still_s, key=lambda r: (-still_s[r], r))
        named = [f"{self.roles[r]} rank {r} made no progress for {still_s[r]:.0f} s {doing.get(r, '')}".rstrip()
                 for r in order[:MAX_LISTED]]
        more = f"; and {len(order) - MAX_LISTED} more" if len(order) > MAX_LISTED else ""
        limit = f"--timeout-s {self.timeout_s:g}"
        stop = ""
        if self.asked_at is not None:
            limit = f"{self.silence_limit_s():g} s after a stop request: --stop-grace-s, --timeout-s"
            stop = (f"; asked to stop {time.monotonic() - self.asked_at:.0f} s ago, it ends without this step's "
                    "checkpoint (the last complete one stays)")
        return (f"no rank made progress for {min(still_s.values()):.0f} s ({limit}), the job is stuck: "
                f"{'; '.join(named)}{more}; seen by {self.describe(self.rank)}{stop}")

    def dead_local_peers(self) -> list[int]:
        """Ranks on this host whose process has exited (or is a zombie nobody reaped yet)."""
        here = socket.gethostname()
        return [r for r, (host, pid) in sorted(self.where.items())
                if r != self.rank and host == here and not _process_alive(pid)]

    def name_the_dead(self, error: BaseException) -> None:
        """After `error` in this rank's work: if a peer on this host has died, say which (a connection reset is
        usually the first sign of it, and torchrun's own report names the rank, not its role)."""
        deadline = time.monotonic() + NAME_THE_DEAD_WAIT_S
        dead = self.dead_local_peers()
        while not dead and time.monotonic() < deadline:  # a peer's sockets close before its process is reaped:
            time.sleep(0.05)  # the connection reset can arrive a moment before /proc shows the process gone
            dead = self.dead_local_peers()
        if dead:
            who = "; ".join(f"{self.describe(r)} died" for r in dead)
            print(f"[digenrl] {who}: {self.describe(self.rank)} stops ({type(error).__name__})",
                  file=sys.stderr, flush=True)

    def _run(self) -> None:
        world = len(self.roles)
        seen = [-1] * world  # last heartbeat counter read per rank
        moved = [time.monotonic()] * world  # when it last changed (this host's clock)
        progress_seen, progress_moved = [-1] * world, [time.monotonic()] * world  # the same for progress
        doing: dict[int, str] = {}
        known: set[int] = set()  # ranks whose progress key exists
        store_ok = started = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            # A rank that has not registered yet is still arriving (importing, on a slower host: under torchrun
            # the store does not wait for it): excused like loading, for excused_timeout_s from this rank's start.
            arriving = now - started < self.excused_timeout_s
            try:
                self.store.add(f"alive/{self.rank}", 1)
                for r in range(world):
                    value = self.store.add(f"alive/{r}", 0)
                    if value != seen[r] or (arriving and r not in self.where):
                        seen[r], moved[r] = value, now
                    if r not in self.where and self.store.check([f"where/{r}"]):
                        host, pid = self.store.get(f"where/{r}").decode().split()
                        self.where[r] = (host, int(pid))
                if self.progress is not None:
                    self._publish_progress(now)
                    for r, (value, what) in self._read_progress(known).items():
                        if value != progress_seen[r]:
                            progress_seen[r], progress_moved[r] = value, now
                        doing[r] = what
                    for r in range(world):
                        if r not in known:
                            doing[r] = "before joining the job (no report yet)"
                            if arriving:
                                progress_moved[r] = now
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
                if r not in self.where:
                    self._fail(f"{self.describe(r)} never joined the job: no sign of life in {now - started:.0f} s "
                               f"(--excused-timeout-s {self.excused_timeout_s:g} + --timeout-s {self.timeout_s:g}); "
                               f"seen by {self.describe(self.rank)}", FROZEN)
                self._fail(f"{self.describe(r)} showed no sign of life for {now - moved[r]:.0f} s "
                           f"(--timeout-s {self.timeout_s:g}): it froze, died or cannot reach the store; "
                           f"seen by {self.describe(self.rank)}", FROZEN)
            if self.progress is not None and now - max(progress_moved) > self.silence_limit_s():
                self._fail(self.stall_message({r: now - progress_moved[r] for r in range(world)}, doing), STALLED)

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

