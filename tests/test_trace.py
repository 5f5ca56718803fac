"""Tests for trace.py: span recording, summarize, Chrome trace / PNG output, and gathering
spans from 3 spawned gloo ranks."""

import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from infra import tracing as tr
from infra.launch import HOST, listening_socket

pytestmark = pytest.mark.timeout(120)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _span(rank, kind, start, end, role="trainer", **args):
    return {"rank": rank, "role": role, "kind": kind, "start": start, "end": end, "args": args}


class ScriptedClock:
    """time.perf_counter (and perf_counter_ns) returning scripted values: span lengths become exact numbers, so
    no assertion here depends on how fast a (shared, loaded) machine runs."""

    def __init__(self, *times):
        self.times = list(times)

    def perf_counter(self):
        return self.times.pop(0)

    def perf_counter_ns(self):
        return int(self.times.pop(0) * 1e9)


def scripted(monkeypatch, *times) -> ScriptedClock:
    clock = ScriptedClock(*times)
    monkeypatch.setattr(tr, "time", clock)  # infra.tracing's own reference to the time module
    return clock


def test_spans_well_formed_and_nested(monkeypatch):
    """Catches a span that records the wrong clock reading (enter/exit swapped, the end of the outer span taken
    at the inner's exit), times not relative to t0, args lost, and `add` that rewrites the times it is given."""
    clock = scripted(monkeypatch, 100.0,  # t0
                     100.5, 100.75, 101.0, 101.25)  # generate opens, reward opens, reward closes, generate closes
    tracer = tr.Tracer(rank=2, role="rollout")
    with tracer.span("generate", step=0, fragment=1):
        with tracer.span("reward", step=0):
            pass
    tracer.add("send", 102.0, 102.01, bytes=123)
    assert clock.times == []  # every reading was taken, none more
    spans = tracer.spans()
    assert [s["kind"] for s in spans] == ["reward", "generate", "send"]  # inner closes first
    for s in spans:
        assert s["kind"] in tr.SPAN_KINDS
        assert s["rank"] == 2 and s["role"] == "rollout"
    reward, generate, send = spans
    assert (generate["start"], generate["end"]) == (0.5, 1.25)  # relative to t0 = 100
    assert (reward["start"], reward["end"]) == (0.75, 1.0)
    assert generate["args"] == {"step": 0, "fragment": 1}
    assert send["args"] == {"bytes": 123}
    assert send["start"] == 2.0 and send["end"] - send["start"] == pytest.approx(0.01, abs=1e-12)


def test_span_recorded_when_body_raises():
    tracer = tr.Tracer(rank=0, role="trainer")
    with pytest.raises(RuntimeError):
        with tracer.span("train"):
            raise RuntimeError("boom")
    assert [s["kind"] for s in tracer.spans()] == ["train"]


def test_unknown_kind_raises_and_lists_kinds():
    for enabled in (True, False):
        tracer = tr.Tracer(rank=0, role="trainer", enabled=enabled)
        with pytest.raises(ValueError, match="generate.*checkpoint"):
            tracer.span("idle")
        with pytest.raises(ValueError, match="unknown span kind"):
            tracer.add("bogus", 0.0, 1.0)


def test_disabled_tracer_records_nothing():
    tracer = tr.Tracer(rank=0, role="trainer", enabled=False)
    first, second = tracer.span("train"), tracer.span("wait", step=1)
    assert first is second  # one shared null context, nothing allocated per span
    with first:
        pass
    tracer.add("send", 0.0, 1.0)
    tracer.mark_step(0)
    assert tracer.spans() == []


def test_mark_step_gives_step_times(monkeypatch):
    """Step marks are instants at the clock's reading: catches marks counted as busy time or step times taken
    between the wrong marks."""
    # t0; then per step: its mark, the train span's open and close; the closing mark
    scripted(monkeypatch, 10.0, 10.0, 10.1, 10.3, 10.5, 10.6, 10.8, 11.5, 11.6, 11.7, 12.5)
    tracer = tr.Tracer(rank=0, role="trainer")
    for step in range(3):
        tracer.mark_step(step)
        with tracer.span("train", step=step):
            pass
    tracer.mark_step(3)
    spans = tracer.spans()
    marks = [s for s in spans if s["kind"] == tr.STEP_MARK_KIND]
    assert [m["args"]["step"] for m in marks] == [0, 1, 2, 3]
    assert [m["start"] for m in marks] == pytest.approx([0.0, 0.5, 1.5, 2.5]) and all(m["start"] == m["end"]
                                                                                    for m in marks)
    summary = tr.summarize(spans)
    assert summary["mean_step_s"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert summary["kind_s"] == pytest.approx({"train": 0.2 + 0.2 + 0.1})  # step marks are not busy time


def test_align_without_distributed_resets_t0(monkeypatch):
    scripted(monkeypatch, 5.0, 6.0, 6.5, 7.0)  # t0, the span's open and close, align's new t0
    tracer = tr.Tracer(rank=0, role="trainer")
    with tracer.span("eval"):
        pass
    tracer.align()
    (span,) = tracer.spans()
    assert (span["start"], span["end"]) == (-1.0, -0.5)  # recorded before the new zero
    assert tr.gather_spans(tracer) == tracer.spans()  # not initialized -> own spans


def test_summarize_merges_overlaps():
    spans = [
        # rank 0: train [0, 2] and optimizer [1, 3] overlap -> busy 3; wait is not busy.
        _span(0, "train", 0.0, 2.0), _span(0, "optimizer", 1.0, 3.0), _span(0, "wait", 3.0, 4.0),
        # rank 1: [0, 1] + ([2, 3] u [2.5, 3.5]) -> busy 2.5; the nested reward adds nothing.
        _span(1, "generate", 0.0, 1.0, role="rollout"), _span(1, "generate", 2.0, 3.0, role="rollout"),
        _span(1, "reward", 2.5, 3.5, role="rollout"), _span(1, "decode", 2.6, 2.7, role="rollout"),
    ]
    summary = tr.summarize(spans)
    assert summary["wall_s"] == pytest.approx(4.0)
    assert summary["busy_s"] == pytest.approx({0: 3.0, 1: 2.5})
    assert summary["busy_fraction"] == pytest.approx({0: 0.75, 1: 0.625})
    assert summary["bubble_fraction"] == pytest.approx(1 - (0.75 + 0.625) / 2)
    assert summary["roles"] == {0: "trainer", 1: "rollout"}
    assert summary["kind_s"] == pytest.approx(
        {"train": 2.0, "optimizer": 2.0, "wait": 1.0, "generate": 2.0, "reward": 1.0, "decode": 0.1})
    assert summary["mean_step_s"] is None
    # A rank that recorded nothing is fully idle.
    with_idle_rank = tr.summarize(spans, num_ranks=3)
    assert with_idle_rank["busy_fraction"][2] == 0.0
    assert with_idle_rank["bubble_fraction"] == pytest.approx(1 - (0.75 + 0.625) / 3)
    empty = tr.summarize([])
    assert empty["wall_s"] == 0.0 and empty["bubble_fraction"] == 0.0


def _check_chrome_trace(path, expected_ranks):
    data = json.loads(Path(path).read_text())
    assert data["displayTimeUnit"] == "ms"
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete
    for event in complete:
        for key in ("ts", "dur", "pid", "tid", "name"):
            assert key in event, (key, event)
        assert event["dur"] >= 0 and event["ts"] >= 0
        assert event["name"] in tr.SPAN_KINDS
    thread_names = {e["tid"]: e["args"]["name"] for e in events
                    if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(thread_names) == set(expected_ranks)
    assert {e["tid"] for e in complete} == set(expected_ranks)
    return data, thread_names


def test_chrome_trace_and_png_from_one_rank(tmp_path):
    import torch

    tracer = tr.Tracer(rank=0, role="colocated")
    tracer.mark_step(0)
    with tracer.span("train", loss=torch.tensor(0.5), shape=torch.zeros(2, 3)):
        with tracer.span("optimizer"):
            pass
    tracer.add("wait", time.perf_counter() - 5.0, time.perf_counter())  # before t0: shifted
    spans = tracer.spans()
    trace_path, png_path = tmp_path / "sub" / "trace.json", tmp_path / "timeline.png"
    tr.write_chrome_trace(spans, trace_path)
    tr.write_timeline_png(spans, png_path, title="one rank")
    data, thread_names = _check_chrome_trace(trace_path, [0])
    assert thread_names == {0: "rank 0 (colocated)"}
    train = next(e for e in data["traceEvents"] if e["name"] == "train")
    assert train["args"]["loss"] == 0.5  # one-element tensor kept as a number
    assert any(e["ph"] == "i" for e in data["traceEvents"])
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["timeline.png", "trace.json"]
    tr.write_timeline_png([], tmp_path / "empty.png")  # an empty run still gives a chart
    assert (tmp_path / "empty.png").stat().st_size > 0


def test_measure_overhead_reports_both(monkeypatch):
    """The per-span cost is the loop's time over n (how long that is on this machine is the benchmark's business,
    not a unit test's): catches a result that is not divided by n or that swaps enabled and disabled."""
    # enabled: t0 of its tracer, the loop's start and end (spans read the clock too: 2 per span); disabled: the same
    # without span readings
    n = 3
    scripted(monkeypatch, 0.0, 1.0, *[0.0] * (2 * n), 1.0 + 6e-6, 0.0, 2.0, 2.0 + 3e-6)
    assert tr.measure_overhead(n=n) == pytest.approx({"n": n, "enabled_ns": 2000.0, "disabled_ns": 1000.0})


def _gather_worker(rank, world_size, master, out_dir):
    import torch.distributed as dist

    from infra import tracing as project_trace  # spawn children inherit the parent's sys.path
    from infra.launch import open_store

    store = open_store(master, world_size, is_master=rank == 0, timeout_s=30)  # rank 0 serves on the held socket
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    try:
        tracer = project_trace.Tracer(rank=rank, role="trainer" if rank == 0 else "rollout")
        tracer.align()
        with open(os.path.join(out_dir, f"t0_{rank}.txt"), "w") as f:
            f.write(repr(tracer.t0))
        tracer.mark_step(0)
        with tracer.span("generate" if rank else "train", step=0, who=rank):
            time.sleep(0.01 * (rank + 1))
        with tracer.span("wait", step=0):
            dist.barrier()
        tracer.mark_step(1)
        spans = project_trace.gather_spans(tracer)
        if rank == 0:
            project_trace.write_chrome_trace(spans, os.path.join(out_dir, "trace.json"))
            project_trace.write_timeline_png(spans, os.path.join(out_dir, "timeline.png"),
                                             title="gather test")
            with open(os.path.join(out_dir, "summary.json"), "w") as f:
                json.dump(project_trace.summarize(spans, num_ranks=world_size), f)
        elif spans is not None:
            raise AssertionError(f"rank {rank} got spans from gather_spans")
    finally:
        dist.destroy_process_group()


def test_gather_from_every_rank(tmp_path):
    world_size = 3
    ctx = mp.get_context("spawn")
    listener = listening_socket()  # held from bind to use: no other job can take the port meanwhile
    master = (HOST, listener.getsockname()[1])
    procs = [ctx.Process(target=_gather_worker, args=(rank, world_size, master + ((listener,) if rank == 0 else ()),
                                                      str(tmp_path)))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 90
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [proc for proc in procs if proc.is_alive()]
    for proc in hung:
        proc.kill()
        proc.join(5)
    assert not hung, "gather test ranks hung and were killed"
    assert [proc.exitcode for proc in procs] == [0] * world_size
    # One host, one perf_counter clock: every rank takes the same zero, so a span that waited
    # for another rank's span never appears to start before it ended.
    assert len({(tmp_path / f"t0_{rank}.txt").read_text() for rank in range(world_size)}) == 1

    data, thread_names = _check_chrome_trace(tmp_path / "trace.json", range(world_size))
    assert thread_names == {0: "rank 0 (trainer)", 1: "rank 1 (rollout)", 2: "rank 2 (rollout)"}
    work = {e["tid"]: e for e in data["traceEvents"] if e["name"] in ("train", "generate")}
    assert {tid: e["args"]["who"] for tid, e in work.items()} == {0: 0, 1: 1, 2: 2}
    assert work[2]["dur"] >= 30_000  # rank 2 slept 30 ms, in microseconds
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["busy_fraction"]) == world_size
    assert 0.0 <= summary["bubble_fraction"] < 1.0


def test_steps_window_keeps_the_spans_of_a_few_steps_clipped_to_them():
    """By hand: step ends marked at 1, 2, 3, 4 (two ranks, rank 1 a little later). Steps 1-2 run from step 0's
    earliest end (1.0) to step 2's latest (3.1). Catches the window taken from the wrong marks (a step late or
    early), spans outside it kept, spans crossing it left unclipped, a run too short not reported."""
    def span(rank, kind, start, end, **args):
        return {"rank": rank, "role": "trainer", "kind": kind, "start": start, "end": end, "args": args}
    marks = [span(r, tr.STEP_MARK_KIND, t + 0.1 * r, t + 0.1 * r, step=s) for r in (0, 1)
             for s, t in enumerate([1.0, 2.0, 3.0, 4.0])]
    work = [span(0, "train", 0.2, 0.9), span(0, "train", 0.5, 1.5), span(1, "generate", 2.5, 3.5),
            span(1, "recv", 3.5, 3.9)]
    got = tr.steps_window(work + marks, 1, 2)
    bars = sorted((s["rank"], s["kind"], s["start"], s["end"]) for s in got if s["kind"] != tr.STEP_MARK_KIND)
    assert bars == [(0, "train", 1.0, 1.5), (1, "generate", 2.5, 3.1)]
    assert sorted(s["start"] for s in got if s["kind"] == tr.STEP_MARK_KIND) == pytest.approx([1.0, 1.1, 2.0, 2.1,
                                                                                             3.0, 3.1])
    assert tr.steps_window(work + marks, 3, 2) is None  # no end of step 4
    tr.write_timeline_png(got, tmp := os.path.join(tempfile.mkdtemp(), "few.png"))
    assert os.path.getsize(tmp) > 0
