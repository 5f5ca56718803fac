"""A rank's progress, what liveness watches: a counter its main thread bumps per unit of work, and what each
thread is inside right now.

    progress = Progress()
    tracer = Tracer(rank, role, progress=progress)  # every span also says what its thread is inside
    progress.start()                                 # the rank's loop begins: from now on the counter must move
    with progress.inside("all-reduce"):              # a named phase that is not a trace span
        dist.all_reduce(flat, group=compute)
    progress.bump()                                  # one unit done: a forward, a pack, a fragment, a tensor
    with progress.excused("reward", up_to_s=90):     # code that reports nothing (a reward function), for at
        scores = reward_fn(images, prompts)           # most 90 s (None: as long as it takes)
    progress.finish()                                # the loop is over: shutdown reports nothing either

A heartbeat only says the process is alive: a main thread blocked forever in a collective (`Work.wait()` and
`torch.cuda.synchronize()` release the GIL) leaves the heartbeat thread beating. So the liveness watchdog
(infra/liveness.py) publishes `value()` and `describe()` of this object and ends the job when no rank's value
has moved for --timeout-s. What bumps it: every transformer forward (generation, evaluation, training, the
KL reference: models.Policy.on_forward), every trained pack, every published or checkpointed tensor, every
fragment and step. A step may take many minutes; a unit of it takes seconds.

Where the code reports nothing by itself, the rank is *excused*: before its loop starts (loading weights),
after it ends (shutdown), and inside `excused` sections (a reward function, writing a checkpoint to disk).
The watchdog then moves the counter itself (`tick`), as long as the process is alive. The price: a reward
function or a disk that hangs forever is not caught. A section that knows how long it can take says so
(`up_to_s`: a remote reward's call ends within its requests' deadlines and retries, rewards/remote.py): past
that it is excused no more, and a hang there is a stall like any other.

Threads: the main thread bumps `count`; only the watchdog thread touches `ticks`; each thread pushes and pops
only its own activity stack, and the watchdog reads copies of them (list and dict operations are atomic in
CPython), so nothing here takes a lock.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

STARTING, RUNNING, FINISHING = "starting", "running", "finishing"


class _Inside:
    """Context manager of one activity on the calling thread's stack (a class with slots: cheap)."""

    __slots__ = ("progress", "name", "step", "excuse", "stack", "up_to_s", "until")

    def __init__(self, progress: "Progress", name: str, step: int | None, excuse: bool,
                 up_to_s: float | None = None):
        self.progress, self.name, self.step, self.excuse = progress, name, step, excuse
        self.up_to_s, self.until = up_to_s, None

    def __enter__(self) -> "_Inside":
        p = self.progress
        ident = threading.get_ident()
        stack = p.stacks.get(ident)
        if stack is None:
            stack = p.stacks[ident] = []
            p.thread_names[ident] = threading.current_thread().name
        self.stack = stack
        stack.append((self.name, time.monotonic()))
        if ident == p.main_ident:
            if self.step is not None:
                p.step = self.step
            if self.excuse:
                p.excused_depth += 1
                if self.up_to_s is not None:  # the earliest end of the open bounded excuses counts
                    self.until = time.monotonic() + self.up_to_s
                    p.excused_until.append(self.until)
        return self

    def __exit__(self, *exc) -> None:
        self.stack.pop()
        if self.excuse and threading.get_ident() == self.progress.main_ident:
            self.progress.excused_depth -= 1
            if self.until is not None:
                self.progress.excused_until.remove(self.until)


class Progress:
    """This rank's progress counter, step and activities (see the module docstring)."""

    def __init__(self):
        self.count = 0  # bumped by the main thread
        self.ticks = 0  # moved by the watchdog while the main thread is excused
        self.step: int | None = None
        self.phase = STARTING
        self.excused_depth = 0
        self.excused_until: list[float] = []  # monotonic ends of the open excuses that have one (main thread)
        self.main_ident = threading.main_thread().ident
        self.stacks: dict[int, list[tuple[str, float]]] = {}  # thread id -> [(activity, since)], innermost last
        self.thread_names: dict[int, str] = {}

    # --- the rank's code ------------------------------------------------------------------------
    def bump(self, step: int | None = None) -> None:
        self.count += 1
        if step is not None:
            self.step = step

    def inside(self, name: str, step: int | None = None) -> _Inside:
        """`with progress.inside("all-reduce"):` what this thread is doing (does not count as progress)."""
        return _Inside(self, name, step, excuse=False)

    def excused(self, name: str, up_to_s: float | None = None) -> _Inside:
        """`with progress.excused("reward"):` a main-thread section that reports no progress of its own, for at
        most `up_to_s` seconds when it is given (beyond, the rank is not excused: it made no progress)."""
        return _Inside(self, name, None, excuse=True, up_to_s=up_to_s)

    def each(self, items: Iterable) -> Iterator:
        """Yield `items`, one bump per item consumed (drops its reference before fetching the next: a just-in-time
        gathered FSDP tensor is freed before the next one is gathered)."""
        for item in items:
            yield item
            del item
            self.count += 1

    def start(self) -> None:
        self.phase = RUNNING
        self.count += 1

    def finish(self) -> None:
        self.phase = FINISHING

    # --- the watchdog's side ------------------------------------------------------------------------
    def is_excused(self) -> bool:
        if self.phase != RUNNING:
            return True
        until = list(self.excused_until)  # the main thread may change it meanwhile
        return self.excused_depth > 0 and (not until or time.monotonic() < min(until))

    def tick(self) -> None:
        self.ticks += 1

    def value(self) -> int:
        return self.count + self.ticks

    def describe(self) -> str:
        """What the rank is inside: the innermost activity of the thread that has been in its own the longest
        (a sender thread stuck in "send" says more than the main thread waiting for weights because of it),
        with the main thread's when that is another one, and the step."""
        innermost = []
        for ident, stack in list(self.stacks.items()):
            stack = list(stack)
            if stack:
                name, since = stack[-1]
                innermost.append((since, ident != self.main_ident, name, self.thread_names.get(ident, "?"), ident))
        if not innermost:
            where = "outside any named phase"
        else:
            since, _, name, thread, ident = min(innermost)
            where = f'inside "{name}"'
            if ident != self.main_ident:
                main = [f'"{n}"' for _, _, n, _, i in innermost if i == self.main_ident]
                where += f" (thread {thread}; main thread inside {main[0] if main else 'no named phase'})"
        if self.phase != RUNNING:
            where += f", {self.phase}"
        return where + (f" (step {self.step})" if self.step is not None else "")
