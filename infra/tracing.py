"""Span recorder for every rank -> Chrome trace JSON (open in Perfetto) and a Gantt PNG.

Each rank owns a `Tracer` and wraps the work it does in spans of a fixed set of kinds
(`SPAN_KINDS`). After the run, the spans of all ranks are gathered to one rank, which
writes them as a Chrome trace (drag it into https://ui.perfetto.dev) and as a Gantt chart
where idle time shows up as white and explicit waiting as light grey. `summarize` turns
the same spans into the numbers bench.py reports: busy fraction per rank and the bubble
fraction (docs/DESIGN.md section 6).

    tracer = Tracer(rank=dist.get_rank(), role="trainer")
    tracer.align()                                  # barrier, then t0 on every rank
    with tracer.span("train", step=3, fragment=1):
        loss.backward()
    tracer.mark_step(3)                             # step boundary, for step times
    spans = gather_spans(tracer)                    # list on rank 0, None elsewhere
    if spans is not None:
        write_chrome_trace(spans, "run/trace.json")
        write_timeline_png(spans, "run/timeline.png")
        write_timeline_png(steps_window(spans, 1, 3), "run/timeline_steps_1-3.png")
        print(summarize(spans))

Recording costs one small object and one tuple append per span (see `measure_overhead`),
so tracing can stay on. A disabled tracer returns a shared no-op context. Spans may be
recorded from background threads (the weight mailbox) without a lock: `list.append` is
atomic in CPython.

Clocks: times come from `time.perf_counter()` and are exported relative to each rank's
`t0`, agreed in `align`. On one machine perf_counter is a single monotonic clock shared
by all processes, so ranks on one host share the earliest t0 and line up exactly (each
rank's own post-barrier t0 can be milliseconds late on a loaded machine, which put a
trainer's spans before the rollout spans they waited for); across hosts the barrier only
aligns them to within its own latency (about a network round trip).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import socket
import tempfile
import time

import torch.distributed as dist

SPAN_KINDS = ("generate", "reward", "send", "recv", "train", "optimizer", "publish", "wait",
              "tag", "decode", "eval", "checkpoint")
_VALID_KINDS = frozenset(SPAN_KINDS)

# Fixed so the same kind has the same colour in every chart; "wait" is light grey so that
# bubbles stand out against real work, and time with no span at all stays white.
KIND_COLORS = {
    "generate": "#1f77b4", "reward": "#9467bd", "send": "#ff7f0e", "recv": "#ffbb78",
    "train": "#2ca02c", "optimizer": "#17becf", "publish": "#d62728", "wait": "#d9d9d9",
    "tag": "#8c564b", "decode": "#aec7e8", "eval": "#e377c2", "checkpoint": "#bcbd22",
}

# Step boundaries travel in the same list as spans, as zero-length entries of this kind;
# it is deliberately not a span kind, so they never count as busy time.
STEP_MARK_KIND = "step"

_NULL_SPAN = contextlib.nullcontext()


def _check_kind(kind: str) -> None:
    if kind not in _VALID_KINDS:
        raise ValueError(f"unknown span kind {kind!r}; expected one of {', '.join(SPAN_KINDS)}")


class _Span:
    """Context manager for one enabled span; a class with slots is several times cheaper
    than a @contextmanager generator."""

    __slots__ = ("records", "kind", "args", "start", "inside")

    def __init__(self, records: list, kind: str, args: tuple, inside=None):
        self.records, self.kind, self.args, self.inside = records, kind, args, inside

    def __enter__(self) -> "_Span":
        if self.inside is not None:
            self.inside.__enter__()
        self.start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Recorded even when the body raised: the time was spent either way.
        self.records.append((self.kind, self.start, time.perf_counter(), self.args))
        if self.inside is not None:
            self.inside.__exit__(exc_type, exc, tb)


class Tracer:
    """Records (kind, start, end, args) spans and step marks for one rank."""

    def __init__(self, rank: int, role: str, enabled: bool = True, progress=None):
        """`progress` (infra.progress.Progress): every span, recorded or not, also tells it what its thread is
        inside, which liveness reports when the job is stuck."""
        self.rank, self.role, self.enabled, self.progress = rank, role, enabled, progress
        self.t0 = time.perf_counter()  # replaced by align(); exported times are relative to it
        # (kind, start, end, args as a tuple of items), times absolute. Items, not the dict:
        # the GC untracks tuples of plain values but never a tuple holding a dict, and
        # millions of tracked records made recording ~3x slower through full collections.
        # Appended from any thread (e.g. the weight mailbox) without a lock: list.append
        # is atomic in CPython.
        self._records: list[tuple] = []
        self._step_marks: list[tuple] = []  # (step, time)

    def span(self, kind: str, **args):
        """`with tracer.span("train", step=k):` records the time spent in the block."""
        _check_kind(kind)  # also when disabled, so a typo fails in tests run without tracing
        inside = self.progress.inside(kind, args.get("step")) if self.progress is not None else None
        if not self.enabled:
            return inside if inside is not None else _NULL_SPAN
        return _Span(self._records, kind, tuple(args.items()), inside)

    def add(self, kind: str, start: float, end: float, **args) -> None:
        """Record a span measured elsewhere (absolute `time.perf_counter()` values)."""
        _check_kind(kind)
        if self.enabled:
            self._records.append((kind, start, end, tuple(args.items())))

    def mark_step(self, step: int) -> None:
        """Record a step boundary (an instant event); consecutive marks give step times."""
        if self.enabled:
            self._step_marks.append((step, time.perf_counter()))

    def align(self, group=None) -> None:
        """Barrier across the group, then agree on t0: ranks on one host take the earliest
        t0 any of them took (one clock, so their spans line up exactly, however late the
        scheduler let each leave the barrier); ranks on other hosts keep their own, aligned
        to within the barrier's latency. Just t0 here without torch.distributed. `group`
        must be a gloo group (all_gather_object)."""
        if not (dist.is_available() and dist.is_initialized()):
            self.t0 = time.perf_counter()
            return
        dist.barrier(group=group)
        self.t0 = time.perf_counter()
        mine = (socket.gethostname(), self.t0)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        self.t0 = min(t0 for host, t0 in everyone if host == mine[0])

    def spans(self) -> list[dict]:
        """This rank's spans and step marks as dicts, times in seconds relative to t0."""
        base = {"rank": self.rank, "role": self.role}
        # list(...) snapshots first: a background thread may still be appending.
        out = [dict(base, kind=kind, start=start - self.t0, end=end - self.t0, args=dict(items))
               for kind, start, end, items in list(self._records)]
        out += [dict(base, kind=STEP_MARK_KIND, start=at - self.t0, end=at - self.t0,
                     args={"step": step}) for step, at in list(self._step_marks)]
        return out


def gather_spans(tracer: Tracer, group=None, dst: int = 0) -> list[dict] | None:
    """Collect every rank's spans on global rank `dst` (gather_object; meant for gloo).

    Returns the merged list, sorted by (rank, start), on `dst` and None elsewhere; without
    torch.distributed or at world size 1 returns this rank's own spans.
    """
    local = tracer.spans()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return sorted(local, key=lambda s: (s["rank"], s["start"]))
    is_dst = dist.get_rank() == dst
    per_rank = [None] * dist.get_world_size(group) if is_dst else None
    dist.gather_object(local, per_rank, dst=dst, group=group)
    if not is_dst:
        return None
    merged = [span for rank_spans in per_rank for span in rank_spans]
    return sorted(merged, key=lambda s: (s["rank"], s["start"]))


def _atomic_write(path, write) -> None:
    """Write via a temp file in the same directory, then os.replace: a reader (or a crash)
    never sees a half-written file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; the result should read like any other output file
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise


def _json_fallback(value):
    # Span args may hold tensors or numpy scalars: keep one-element ones as numbers.
    try:
        return value.item()
    except (AttributeError, ValueError, RuntimeError):
        return str(value)


def _rank_label(rank: int, role: str) -> str:
    return f"rank {rank} ({role})"


def write_chrome_trace(spans: list[dict], path) -> None:
    """Write spans in the Chrome trace event format: one "X" event per span (ts/dur in
    microseconds), one instant "i" event per step mark, pid 0 and tid = rank."""
    # Perfetto dislikes negative timestamps (spans recorded before align); shift all together.
    offset = min([0.0] + [s["start"] for s in spans])
    events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "digenrl"}}]
    for rank, role in sorted({(s["rank"], s["role"]) for s in spans}):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank,
                       "args": {"name": _rank_label(rank, role)}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": rank,
                       "args": {"sort_index": rank}})
    for s in spans:
        ts = (s["start"] - offset) * 1e6
        if s["kind"] == STEP_MARK_KIND:
            events.append({"ph": "i", "s": "t", "name": f"step {s['args'].get('step')}",
                           "cat": STEP_MARK_KIND, "ts": ts, "pid": 0, "tid": s["rank"],
                           "args": s["args"]})
        else:
            events.append({"ph": "X", "name": s["kind"], "cat": s["kind"], "ts": ts,
                           "dur": max(0.0, (s["end"] - s["start"]) * 1e6), "pid": 0,
                           "tid": s["rank"], "args": s["args"]})
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, default=_json_fallback)
    _atomic_write(path, lambda f: f.write(text.encode()))


def write_timeline_png(spans: list[dict], path, title: str | None = None) -> None:
    """Gantt chart: one row per rank, one coloured bar per span, step marks as black ticks."""
    # Lazy imports keep `import trace` fast; Figure + the Agg canvas avoid pyplot's global
    # state, so this works headless and from any thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = sorted({(s["rank"], s["role"]) for s in spans})
    row_of = {rank: row for row, (rank, _) in enumerate(ranks)}
    fig = Figure(figsize=(12, max(2.0, 0.55 * len(ranks) + 1.5)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    bars = [s for s in spans if s["kind"] != STEP_MARK_KIND]
    # Longest first, so nested (shorter) spans are drawn on top of their parents.
    bars.sort(key=lambda s: s["end"] - s["start"], reverse=True)
    if bars:
        ax.barh([row_of[s["rank"]] for s in bars], [s["end"] - s["start"] for s in bars],
                left=[s["start"] for s in bars], height=0.8,
                color=[KIND_COLORS[s["kind"]] for s in bars], linewidth=0)
    marks = [s for s in spans if s["kind"] == STEP_MARK_KIND]
    if marks:
        rows = [row_of[s["rank"]] for s in marks]
        ax.vlines([s["start"] for s in marks], [r - 0.45 for r in rows], [r + 0.45 for r in rows],
                  colors="black", linewidth=0.8)
    if not spans:
        ax.text(0.5, 0.5, "no spans recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_yticks(range(len(ranks)), [_rank_label(rank, role) for rank, role in ranks])
    if ranks:
        ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("time (s)")
    kinds_present = [k for k in SPAN_KINDS if any(s["kind"] == k for s in bars)]
    if kinds_present:
        ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds_present],
                  loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    _atomic_write(path, lambda f: fig.savefig(f, format="png"))


def steps_window(spans: list[dict], first: int, count: int) -> list[dict] | None:
    """The spans of steps [first, first + count), each clipped to them: a few steps a reader can
    follow (a whole run's timeline is stripes). The window runs from the trainers' earliest
    end-of-step mark of step first - 1 to their latest mark of step first + count - 1 (marks are
    made at a step's end, infra/bookkeeping.py); None when the run has no such marks."""
    ends: dict[int, list[float]] = {}
    for s in spans:
        if s["kind"] == STEP_MARK_KIND:
            ends.setdefault(s["args"].get("step"), []).append(s["start"])
    if first - 1 not in ends or first + count - 1 not in ends:
        return None
    lo, hi = min(ends[first - 1]), max(ends[first + count - 1])
    return [dict(s, start=max(s["start"], lo), end=min(s["end"], hi)) for s in spans
            if s["end"] >= lo and s["start"] <= hi]


def union_length(intervals, lo: float = -math.inf, hi: float = math.inf) -> float:
    """Total length covered by the intervals inside [lo, hi], overlaps counted once (the one
    interval union of the project: trace summaries, bench.py and simulate.py use it)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= start:
            continue  # empty, or outside the window
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(spans: list[dict], num_ranks: int | None = None) -> dict:
    """Busy time per rank (union of non-"wait" spans), wall time (first start to last end
    over all ranks), busy fraction per rank, bubble fraction = 1 - mean busy fraction,
    total seconds per kind (plain sums, so nested spans of different kinds both count),
    and the mean time between consecutive step marks of a rank.

    `num_ranks` counts ranks 0..num_ranks-1 even if some recorded nothing (busy 0).
    """
    bars = [s for s in spans if s["kind"] != STEP_MARK_KIND]
    roles = {s["rank"]: s["role"] for s in spans}
    ranks = sorted(set(roles) | set(range(num_ranks or 0)))
    wall = (max(s["end"] for s in bars) - min(s["start"] for s in bars)) if bars else 0.0
    busy = {r: union_length([(s["start"], s["end"]) for s in bars
                              if s["rank"] == r and s["kind"] != "wait"]) for r in ranks}
    busy_fraction = {r: (busy[r] / wall if wall > 0 else 0.0) for r in ranks}
    mean_busy = sum(busy_fraction.values()) / len(ranks) if ranks else 0.0
    kind_seconds = {}
    for s in bars:
        kind_seconds[s["kind"]] = kind_seconds.get(s["kind"], 0.0) + (s["end"] - s["start"])
    step_times = []
    for r in ranks:
        marks = sorted(s["start"] for s in spans if s["kind"] == STEP_MARK_KIND and s["rank"] == r)
        step_times += [b - a for a, b in zip(marks, marks[1:])]
    return {
        "wall_s": wall,
        "roles": {r: roles.get(r, "") for r in ranks},
        "busy_s": busy,
        "busy_fraction": busy_fraction,
        "mean_busy_fraction": mean_busy,
        "bubble_fraction": 1.0 - mean_busy if ranks else 0.0,
        "kind_s": kind_seconds,
        "mean_step_s": sum(step_times) / len(step_times) if step_times else None,
    }


def measure_overhead(n: int = 100000) -> dict:
    """Nanoseconds per `with tracer.span(...): pass`, enabled and disabled (loop included)."""
    result = {"n": n}
    for name, enabled in (("enabled_ns", True), ("disabled_ns", False)):
        tracer = Tracer(rank=0, role="bench", enabled=enabled)
        gc.collect()  # don't bill one full collection of the whole (torch-sized) heap to spans
        start = time.perf_counter_ns()
        for _ in range(n):
            with tracer.span("train"):
                pass
        result[name] = (time.perf_counter_ns() - start) / n
    return result
