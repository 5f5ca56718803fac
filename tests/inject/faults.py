"""Faults injected into the ranks of a real run for the stall-and-slow matrix (tests/stall_matrix.py): installed
in a rank by `install(spec, rank)` before main.run_rank (tests/stall_matrix.py's rank entry), never by the
project. A phase is what liveness names (infra/progress.py: a named phase, a trace span, an excused section).

spec["stall"] = {"rank": R, "phase": P, "nth": N, "mark": FILE}: on rank R, the N-th time a thread enters phase
    P it blocks there for ever, as a hung collective, disk, download or reward shows it (its heartbeat thread
    keeps beating); or {"rank": R, "function": "module:Class.method", "nth": N, "mark": FILE}: the N-th call
    of that function blocks (to reproduce a hang in code that names no phase). When it blocks, the time goes
    to FILE.
spec["slow"] = {"unit_s": d, "budget_s": B, "phases": {P: {"rank": R, "entry_s": s}}, "bucket_bytes": b}: on
    rank R, inside phase P, every torch.distributed call (the project's own and the libraries': FSDP, DTensor)
    and every unit of progress the thread reports first waits d seconds, until B seconds were added there; with
    "entry_s",
    entering P waits s seconds once (an excused phase: loading, a reward). Each unit stays shorter than
    --timeout-s while the phase as a whole takes several times it: a phase that reports progress survives it,
    one that does not (publishing before issue 38) ends the job. "bucket_bytes": transport's publish buckets
    (every rank), so a tiny model's publish is many buckets, as a real one's is.
spec["stats"] = FOLDER: every rank writes <FOLDER>/<rank>.json at its end: per phase, the seconds its threads
    spent inside it (the longest single stay, the total) and the seconds added.
"""
import functools
import importlib
import json
import os
import threading
import time

import phases

_spec: dict = {}
_rank = [-1]
_lock = threading.Lock()
_entries: dict = {}  # phase -> times entered (stall counting)
_calls = [0]  # calls of the stalled function
_added: dict = {}  # phase -> seconds of delay added on this rank
_entry_slowed: set = set()
_stays: dict = {}  # phase -> [longest stay, total stay]
_slowed: set = set()  # the phases slowed on this rank
_sleep = time.sleep  # the real one, whatever comm_recorder wraps later


def install(spec: dict, rank: int) -> None:
    """Patch this process (a rank, before main.run_rank) with the faults of `spec`."""
    _spec.update(spec)
    _rank[0] = rank
    phases.watch()
    from infra import progress as progress_lib
    inside = progress_lib._Inside
    enter, leave = inside.__enter__, inside.__exit__

    def entered(self):
        result = enter(self)
        _on_enter(self.name)
        return result

    def left(self, *exc):
        entries = phases.stack()
        if entries:
            name, since = entries[-1][:2]
            with _lock:
                stay = _stays.setdefault(name, [0.0, 0.0])
                took = time.monotonic() - since
                stay[0], stay[1] = max(stay[0], took), stay[1] + took
        return leave(self, *exc)

    inside.__enter__, inside.__exit__ = entered, left
    stall = spec.get("stall") or {}
    if stall.get("rank") == rank and stall.get("function"):
        module_name, qualname = stall["function"].split(":")
        owner = importlib.import_module(module_name)
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _stalling_function(getattr(owner, name)))
    slow = spec.get("slow")
    if slow:
        if slow.get("bucket_bytes"):
            import transport
            transport.PUBLISH_BUCKET_BYTES = slow["bucket_bytes"]
        _slowed.update(p for p, where in slow["phases"].items() if where["rank"] == rank)
        _slow_calls_and_units(progress_lib.Progress)


def _block_forever() -> None:
    with open(_spec["stall"]["mark"], "w") as f:
        f.write(f"{time.time()}\n")
    while True:  # blocked inside, as a wedged NCCL or gloo wait, a hung disk or reward would be
        _sleep(3600)


def _stalling_function(original):
    @functools.wraps(original)
    def stalling(*args, **kwargs):
        with _lock:
            _calls[0] += 1
            hit = _calls[0] == _spec["stall"]["nth"]
        if hit:
            _block_forever()
        return original(*args, **kwargs)

    return stalling


def _on_enter(name: str) -> None:
    stall = _spec.get("stall") or {}
    if stall.get("rank") == _rank[0] and stall.get("phase") == name:
        with _lock:
            _entries[name] = _entries.get(name, 0) + 1
            hit = _entries[name] == stall["nth"]
        if hit:
            _block_forever()
    entry_s = _spec["slow"]["phases"][name].get("entry_s") if name in _slowed else None
    if entry_s:
        with _lock:
            first = name not in _entry_slowed
            _entry_slowed.add(name)
        if first:
            _delay(name, entry_s, limit=False)


def _delay(phase: str | None, seconds: float, limit: bool = True) -> None:
    if phase not in _slowed:
        return
    with _lock:
        if limit and _added.get(phase, 0.0) >= _spec["slow"]["budget_s"]:
            return
        _added[phase] = _added.get(phase, 0.0) + seconds
    _sleep(seconds)


def _slow_calls_and_units(progress_cls) -> None:
    unit = _spec["slow"]["unit_s"]
    bump = progress_cls.bump
    local = threading.local()

    def slow_bump(self, step=None):
        _delay(phases.current(), unit)
        return bump(self, step)

    def make(module, name, original):
        @functools.wraps(original)
        def slowed(*args, **kwargs):
            if getattr(local, "inside", False):  # all_gather_object's own all_gather: one call
                return original(*args, **kwargs)
            _delay(phases.current(), unit)  # the project's calls and the libraries' (FSDP, DTensor) alike
            local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False

        return slowed

    progress_cls.bump = slow_bump
    phases.wrap_distributed(make)


def write_stats() -> None:
    """<stats>/<rank>.json: per phase the longest stay, the total stay and the seconds added (the slow run)."""
    folder = _spec.get("stats")
    if not folder:
        return
    with _lock:
        out = {name: {"longest_s": s[0], "total_s": s[1], "added_s": _added.get(name, 0.0)}
               for name, s in _stays.items()}
    with open(os.path.join(folder, f"{_rank[0]}.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
