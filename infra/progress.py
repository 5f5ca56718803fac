"""A rank's progress, what liveness watches: counters its threads bump per unit of work, and what each thread is
inside right now.

    progress = Progress()
    tracer = Tracer(rank, role, progress=progress)  # every span also says what its thread is inside
    with progress.inside("process groups"):          # a named phase that is not a trace span
        groups = comm.build_groups(...)
    progress.bump()                                  # one unit done: a forward, a pack, a fragment, a tensor, a bucket
    with progress.excused("reward", up_to_s=90):     # code that reports nothing (a reward function); a known
        scores = reward_fn(images, prompts)           # bound (90 s) replaces --excused-timeout-s
    with progress.inside("next publish", idle=True): # a background thread waiting for work, not doing it
        header = receive_header()
    progress.start()                                 # start-up is over: the rank's loop begins
    progress.finish()                                # the loop is over: shutdown

A heartbeat only says the process is alive: a main thread blocked forever in a collective (`Work.wait()` and
`torch.cuda.synchronize()` release the GIL) leaves the heartbeat thread beating. So the liveness watchdog
(infra/liveness.py) publishes `value()` and `describe()` of this object and ends the job when no rank's value
has moved for --timeout-s. What bumps it: every transformer forward (generation, evaluation, training, the
KL reference: models.Policy.on_forward), every trained pack, every published, received, checkpointed or
resumed tensor or bucket, every fragment and step, every start-up milestone. A step may take many minutes;
a unit of it takes seconds.

Where the code cannot report anything (loading the pipeline, building the reward, a reward function, writing
the run directory or the trace), it runs inside an `excused` section: the watchdog moves the counter itself
(`tick`) while the process is alive, but only for --excused-timeout-s since the section began or since the
main thread last bumped inside it (infra/liveness.py); past that the section's silence counts like any other,
so a disk, a download or a reward that hangs is found. A section that knows how long it can take says so
(`up_to_s`: a remote reward's call ends within its requests' deadlines and retries, rewards/remote.py): that
bound replaces --excused-timeout-s for as long as the section is open. Start-up and shutdown are not excused as such: their
collectives ("connect", "process groups", "align clocks", "resume", "trace gather", "last barrier") are named
phases, and each finished one is a bump.

Threads: the main thread bumps `count`; another thread bumps its own entry of `others` (one writer per entry);
only the watchdog thread touches `ticks`; each thread pushes and pops only its own activity stack, and the
watchdog reads copies of them (list and dict operations are atomic in CPython), so nothing here takes a lock.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

STARTING, RUNNING, FINISHING = "starting", "running", "finishing"


class _Inside:
    """Context manager of one activity on the calling thread's stack (a class with slots: cheap)."""

    __slots__ = ("progress", "name", "step", "excuse", "idle", "stack", "up_to_s", "until")

    def __init__(self, progress: "Progress", name: str, step: int | None, excuse: bool, idle: bool = False,
                 up_to_s: float | None = None):
        self.progress, self.name, self.step, self.excuse, self.idle = progress, name, step, excuse, idle
        self.up_to_s, self.until = up_to_s, None

    def __enter__(self) -> "_Inside":
        p = self.progress
        ident = threading.get_ident()
        stack = p.stacks.get(ident)
        if stack is None:
            stack = p.stacks[ident] = []
            p.thread_names[ident] = threading.current_thread().name
        self.stack = stack
        now = time.monotonic()
        stack.append((self.name, now, self.idle))
        if ident == p.main_ident:
            if self.step is not None:
                p.step = self.step
            if self.excuse:
                if p.excused_depth == 0:
                    p.excused_at = now
                p.excused_depth += 1
                if self.up_to_s is not None:  # the earliest end of the open bounded excuses counts
                    self.until = now + self.up_to_s
                    p.excused_until.append(self.until)
        return self

    def __exit__(self, *exc) -> None:
        self.stack.pop()
        if self.excuse and threading.get_ident() == self.progress.main_ident:
            self.progress.excused_depth -= 1
            if self.until is not None:
                self.progress.excused_until.remove(self.until)


class Progress:
    """This rank's progress counters, step and activities (see the module docstring)."""

    def __init__(self):
        self.count = 0  # bumped by the main thread
        self.others: dict[int, int] = {}  # thread id -> units another thread bumped (its own entry only)
        self.ticks = 0  # moved by the watchdog while the main thread is excused (within its patience)
        self.step: int | None = None
        self.phase = STARTING
        self.excused_depth = 0
        self.excused_at = 0.0  # when the outermost excused section of the main thread began (monotonic)
        self.excused_until: list[float] = []  # monotonic ends of the open excuses that state one (main thread)
        self.main_ident = threading.main_thread().ident
        self.stacks: dict[int, list[tuple[str, float, bool]]] = {}  # thread id -> [(activity, since, idle)]
        self.thread_names: dict[int, str] = {}

    # --- the rank's code ------------------------------------------------------------------------
    def bump(self, step: int | None = None) -> None:
        """One unit of work done, on any thread."""
        ident = threading.get_ident()
        if ident == self.main_ident:
            self.count += 1
        else:
            self.others[ident] = self.others.get(ident, 0) + 1
        if step is not None:
            self.step = step

    def inside(self, name: str, step: int | None = None, idle: bool = False) -> _Inside:
        """`with progress.inside("all-reduce"):` what this thread is doing (does not count as progress). `idle`: a
        background thread waiting for work (the mailbox between publishes), named only when nothing else is."""
        return _Inside(self, name, step, excuse=False, idle=idle)

    def excused(self, name: str, up_to_s: float | None = None) -> _Inside:
        """`with progress.excused("reward"):` a main-thread section that reports no progress of its own, excused
        for --excused-timeout-s (infra/liveness.py), or for `up_to_s` seconds when it states how long it can take."""
        return _Inside(self, name, None, excuse=True, up_to_s=up_to_s)

    def each(self, items: Iterable) -> Iterator:
        """Yield `items`, one bump per item consumed (drops its reference before fetching the next: a just-in-time
        gathered FSDP tensor is freed before the next one is gathered)."""
        for item in items:
            yield item
            del item
            self.bump()

    def start(self) -> None:
        self.phase = RUNNING
        self.count += 1

    def finish(self) -> None:
        self.phase = FINISHING

    # --- the watchdog's side ------------------------------------------------------------------------
    def excused_since(self) -> float | None:
        """When the main thread's current excused section began (time.monotonic()); None outside one."""
        return self.excused_at if self.excused_depth > 0 else None

    def excused_until_s(self) -> float | None:
        """The earliest stated end (time.monotonic()) of the main thread's open excused sections; None if none
        states one (then --excused-timeout-s bounds them)."""
        until = list(self.excused_until)  # the main thread may change it meanwhile
        return min(until) if until else None

    def tick(self) -> None:
        self.ticks += 1

    def value(self) -> int:
        return self.count + self.ticks + sum(list(self.others.values()))

    def describe(self) -> str:
        """What the rank is inside: the innermost activity of a background thread busy in one (a sender stuck
        in "send", a mailbox in "receive weights" say more than the main thread waiting for them), the longest
        first, else the main thread's, else a thread idly waiting for work; with the main thread's when that is
        another one, and the step."""
        innermost = []
        for ident, stack in list(self.stacks.items()):
            stack = list(stack)
            if stack:
                name, since, idle = stack[-1]
                main = ident == self.main_ident
                innermost.append((idle, main, since, name, self.thread_names.get(ident, "?"), ident))
        if not innermost:
            where = "outside any named phase"
        else:
            _, _, since, name, thread, ident = min(innermost)
            where = f'inside "{name}"'
            if ident != self.main_ident:
                main = [f'"{n}"' for _, _, _, n, _, i in innermost if i == self.main_ident]
                where += f" (thread {thread}; main thread inside {main[0] if main else 'no named phase'})"
        if self.phase != RUNNING:
            where += f", {self.phase}"
        return where + (f" (step {self.step})" if self.step is not None else "")
