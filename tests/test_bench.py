"""bench.py without running main.py: mode flags resolve to the intended mechanisms, traces parse back into spans."""
import json

import pytest

from tools import bench
import config as config_lib
from tools import simulate
from infra import tracing as tr

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", list(simulate.MODES))
def test_mode_flags_resolve_to_the_mechanism_mix(mode):
    cfg = config_lib.resolve(config_lib.parse_args(bench.mode_flags(mode)))
    assert (cfg.placement, cfg.gap, cfg.tsp, cfg.tag, cfg.use_async) == simulate.MODES[mode]


def _span(rank, role, kind, start, end, **args):
    return {"rank": rank, "role": role, "kind": kind, "start": start, "end": end, "args": args}


def test_chrome_trace_round_trip_and_analysis(tmp_path):
    # A hand-made naive run: rollout generates 2 fragments (0.1 s each), trainer receives and trains them.
    spans = []
    for step in range(3):
        t = step * 1.0
        spans += [_span(0, "rollout", "generate", t, t + 0.1, step=step, index=0, version=step),
                  _span(0, "rollout", "generate", t + 0.1, t + 0.2, step=step, index=1, version=step),
                  _span(0, "rollout", "wait", t + 0.2, t + 1.0, step=step + 1, what="weights"),
                  _span(1, "trainer", "recv", t + 0.2, t + 0.25, step=step, index=0),
                  _span(1, "trainer", "train", t + 0.25, t + 0.55, step=step, index=0),
                  _span(1, "trainer", "train", t + 0.55, t + 0.85, step=step, index=1),
                  _span(1, "trainer", "optimizer", t + 0.85, t + 0.9, step=step),
                  _span(1, "trainer", tr.STEP_MARK_KIND, t + 0.95, t + 0.95, step=step),
                  _span(1, "trainer", "publish", t + 0.95, t + 1.0, version=step + 1)]
    path = tmp_path / "trace.json"
    tr.write_chrome_trace(spans, path)
    back = bench.load_spans(str(path))
    assert sorted((s["rank"], s["kind"], round(s["start"], 6)) for s in back) == \
        sorted((s["rank"], s["kind"], round(s["start"], 6)) for s in spans)
    metrics = [{"step": k, "step_time_s": 1.0} for k in range(3)]
    w = {"nproc": 2, "rollout_ranks": 1, "m": 4, "N": 8, "T": 5, "train_steps": 3, "steps": 3}
    row = bench.analyse("naive", {"spans": back, "metrics": metrics, "wall_s": 1.0}, w)
    assert row["step_s"] == pytest.approx(1.0)
    assert row["op"]["f"] == pytest.approx(0.1 / (4 * 5))
    assert row["op"]["b"] == pytest.approx(0.3 / (4 * 3))
    # window: step 0's mark (0.95) .. the last optimizer end (2.9): rollout busy 0.4 s, trainer 1.4 s of 1.95 s
    assert row["busy"]["0:rollout"] == pytest.approx(0.4 / 1.95)
    assert row["busy"]["1:trainer"] == pytest.approx((0.05 + (0.05 + 0.6 + 0.05 + 0.05) + (0.05 + 0.6 + 0.05)) / 1.95)
    json.dumps(row)  # the row is what bench.json stores


def test_gpu_check_without_cuda_exits_clearly(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert bench.main(["--size", "flux-12b", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_compare_runs_plots_every_run_and_summarises(tmp_path, capsys):
    from tools import compare_runs

    for name, slope in (("fast", 0.01), ("slow", 0.005)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "reward_mean": slope * s, "step_time_s": 0.5, "stale_frac": 0.25 if name == "fast" else 0.0,
                 "staleness_mean": 0.25 if name == "fast" else 0.0, "tag_fragments": 1.0} for s in range(10)]
        rows[-1]["eval_reward"] = 0.3
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves.png"
    assert compare_runs.main([str(tmp_path / "fast"), f"B={tmp_path / 'slow'}", "--out", str(out), "--tail", "0.2"]) == 0
    table = capsys.readouterr().out
    assert out.stat().st_size > 1000
    fast = next(line for line in table.splitlines() if line.startswith("fast")).split()
    slow = next(line for line in table.splitlines() if line.startswith("B ")).split()
    assert float(fast[3]) == pytest.approx(0.085) and float(slow[3]) == pytest.approx(0.0425)  # mean of steps 8, 9
    assert float(fast[6]) == pytest.approx(0.25) and float(slow[6]) == 0.0
    assert compare_runs.main([str(tmp_path / "missing")]) == 2
