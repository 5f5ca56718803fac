"""bench.py without running main.py: mode flags resolve to the intended mechanisms, traces parse back into spans."""
import json

import pytest

from tools import bench
import cli
import config as config_lib
from tools import simulate
from infra import tracing as tr

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", list(simulate.MODES))
def test_mode_flags_resolve_to_the_mechanism_mix(mode):
    """bench.py's flags for a mode give main.py the mechanisms that mode is, written out by hand (not read back
    from config.MODES, which both sides use): catches bench.py running another mix than the row it labels."""
    from test_simulate import MECHANISMS

    cfg = config_lib.resolve(config_lib.parse_args(bench.mode_flags(mode)))
    assert (cfg.placement, cfg.gap, cfg.tsp, cfg.tag, cfg.use_tcss) == MECHANISMS[mode]
    assert cfg.mode == (mode if mode in ("colocated", "naive", "digenrl") else "custom")


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


def _random_run(rng, nproc, steps=4):
    """Synthetic spans: every rank runs back-to-back ops (never overlapping), the leader marks steps."""
    spans, leader = [], nproc - 1
    clock = {r: rng.uniform(0, 0.05) for r in range(nproc)}
    for step in range(steps):
        for r in range(nproc):
            for _ in range(rng.randint(1, 4)):
                kind = rng.choice(["generate", "train", "recv", "wait", "tag", "publish"])
                dur = rng.uniform(0.01, 0.2)
                args = {"step": step}
                if kind in ("generate", "tag"):
                    args["samples"] = rng.choice([2, 4, 8])
                if kind == "train":
                    args["pairs"] = rng.choice([4, 8, 16])
                spans.append(_span(r, "x", kind, clock[r], clock[r] + dur, **args))
                clock[r] += dur + rng.choice([0.0, rng.uniform(0, 0.1)])
        end = max(clock.values())
        spans.append(_span(leader, "trainer", "optimizer", end, end + 0.01, step=step))
        spans.append(_span(leader, "trainer", tr.STEP_MARK_KIND, end + 0.01, end + 0.01, step=step))
        clock = {r: end + 0.02 for r in range(nproc)}
    return {"spans": spans, "metrics": [{"step": k, "step_time_s": 1.0} for k in range(steps)],
            "wall_s": 1.0}


def test_efficiency_never_exceeds_one():
    """Whatever the modes measured, each run's cheapest-cost work fits in P x its window."""
    import random
    from tools import bench_analysis as ba
    rng = random.Random(0)
    highest = 0.0
    for _ in range(40):
        nproc = rng.randint(2, 4)
        w = {"nproc": nproc, "rollout_ranks": 1, "m": 4, "N": 8, "T": 5, "train_steps": 3,
             "steps": 4, "tsp_pack": 4}
        rows = [ba.analyse(rng.choice(["naive", "gap+tsp", "colocated"]), _random_run(rng, nproc), w)
                for _ in range(3)]
        f, b, _, _ = ba.cheapest_costs(rows)
        for row in rows:
            eff = ba.efficiency(row, f, b)
            busy = sum(row["busy"].values()) / nproc
            assert 0 < eff <= busy + 1e-9 <= 1 + 1e-9
            highest = max(highest, eff)
    assert highest > 0.3  # the sweep reaches busy runs, so the check has teeth


def test_efficiency_by_hand(tmp_path):
    from tools import bench_analysis as ba
    spans = []
    for step in range(3):  # the naive run of test_chrome_trace_round_trip_and_analysis
        t = step * 1.0
        spans += [_span(0, "rollout", "generate", t, t + 0.1, step=step),
                  _span(0, "rollout", "generate", t + 0.1, t + 0.2, step=step),
                  _span(1, "trainer", "train", t + 0.25, t + 0.55, step=step),
                  _span(1, "trainer", "train", t + 0.55, t + 0.85, step=step),
                  _span(1, "trainer", "optimizer", t + 0.85, t + 0.9, step=step),
                  _span(1, "trainer", tr.STEP_MARK_KIND, t + 0.95, t + 0.95, step=step)]
    w = {"nproc": 2, "rollout_ranks": 1, "m": 4, "N": 8, "T": 5, "train_steps": 3, "steps": 3}
    run = {"spans": spans, "metrics": [{"step": k, "step_time_s": 1.0} for k in range(3)], "wall_s": 1}
    row = ba.analyse("naive", run, w)
    # window 0.95 .. 2.9: 4 generate ops (4 samples x T 5) and 4 train ops (4 x 3 pairs) inside
    assert row["op"]["f"] == pytest.approx(0.4 / 80) and row["op"]["b"] == pytest.approx(1.2 / 48)
    cheaper = ba.efficiency(row, row["op"]["f"] / 2, row["op"]["b"] / 2)
    assert ba.efficiency(row, row["op"]["f"], row["op"]["b"]) == pytest.approx(1.6 / 3.9)
    assert cheaper == pytest.approx(0.8 / 3.9)


def test_per_op_costs_for_the_simulator_by_hand():
    """forward_table: the level from the traced m-sample span, the batch shape from the one-thread timings
    (decode + reward taken out of both); b_span: training seconds per pair slot, a TAG share's smaller
    spans priced by their own slots (a whole-fragment divisor would halve their price)."""
    from tools import bench_analysis as ba
    w = {"nproc": 2, "rollout_ranks": 1, "m": 8, "N": 16, "T": 5, "train_steps": 3, "steps": 3, "tsp_pack": 4}
    inproc = {"decode_reward_s": 0.008, "generate_s": {4: 0.05, 8: 0.07}}  # 1 ms decode + reward per sample
    table = ba.forward_table(0.088, w, inproc)
    level = (0.088 - 0.008) / 40
    assert table[8] == pytest.approx(level)
    assert table[4] == pytest.approx(level * ((0.05 - 0.004) / 20) / ((0.07 - 0.008) / 40))
    spans = []
    for step in range(3):
        t = step * 1.0
        spans += [_span(0, "rollout", "generate", t, t + 0.2, step=step, samples=8),
                  _span(0, "rollout", "generate", t + 0.2, t + 0.35, step=step, samples=4),  # after a TAG share
                  _span(1, "trainer", "tag", t, t + 0.15, step=step, samples=4),
                  _span(1, "trainer", "train", t + 0.2, t + 0.3, step=step, pairs=12, slots=12),
                  _span(1, "trainer", "train", t + 0.4, t + 0.6, step=step, pairs=24, slots=24),
                  _span(1, "trainer", "optimizer", t + 0.85, t + 0.9, step=step),
                  _span(1, "trainer", tr.STEP_MARK_KIND, t + 0.95, t + 0.95, step=step)]
    run = {"spans": spans, "metrics": [{"step": k, "step_time_s": 1.0} for k in range(3)], "wall_s": 1}
    row = ba.analyse("gap+tsp+tag", run, w)
    assert row["op"]["b_span"] == pytest.approx(0.3 / 36)  # steps 1 and 2: 2 x 0.3 s over 2 x 36 slots
    assert row["op"]["generate_fragment_s"] == pytest.approx(0.2)  # m-sample spans only
    pooled = simulate.Costs(forward_s={8: 1.0}, train_s={4: 1.0}, publish_s=0.5)
    own = ba.mode_costs(pooled, row, w, inproc)
    assert own.train_s == {4: pytest.approx(0.3 / 36)} and own.publish_s == 0.5
    assert own.forward_s == pytest.approx(ba.forward_table(0.2, w, inproc))


def test_repeated_runs_report_the_median_run_and_bad_counts_are_refused(tmp_path):
    rows = [{"mode": "naive", "step_s": s, "tag": i} for i, s in enumerate((0.3, 0.1, 0.2))]
    assert bench.median_run(rows) == {"mode": "naive", "step_s": 0.2, "tag": 2, "step_s_runs": [0.3, 0.1, 0.2]}
    assert bench.median_run(rows[:2])["step_s"] == 0.3  # of two, the slower
    with pytest.raises(SystemExit, match="--repeat 0: the number of rounds must be >= 1"):
        bench.main(["--repeat", "0", "--out", str(tmp_path / "never")])
    assert not (tmp_path / "never").exists()


def test_rank_speed_parsing_and_pacing(monkeypatch):
    from infra import emulate
    assert emulate.parse_rank_speed("0=0.5, 2=0.25") == {0: 0.5, 2: 0.25}
    assert emulate.parse_rank_speed(None) == {} and emulate.speed_of("1=0.5", 0) == 1.0
    for bad, words in (("0=2", "(0, 1]"), ("0=0", "(0, 1]"), ("x=1", "RANK=FACTOR"),
                       ("1", "RANK=FACTOR"), ("0=.5,0=.6", "twice")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            emulate.parse_rank_speed(bad)
    with pytest.raises(ValueError, match="rank 3 does not exist"):
        emulate.check_rank_speed("3=0.5", 2)
    clock, slept = iter([10.0, 10.3]), []
    monkeypatch.setattr(emulate.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(emulate.time, "sleep", slept.append)
    with emulate.paced(0.25):  # the body took 0.3 s: sleep 3 x 0.3 more, 1.2 s in all
        pass
    assert slept == [pytest.approx(0.9)]
    with emulate.paced(1.0):  # full speed: no clock reads, no sleep
        pass
    assert slept == [pytest.approx(0.9)]


def test_rank_speed_is_validated_before_spawning(tmp_path):
    with pytest.raises(ValueError, match="rank 5 does not exist"):
        cli.validate(config_lib.resolve(config_lib.parse_args(["--rank-speed", "5=0.5"])), 2)
    out = tmp_path / "bench"
    with pytest.raises(SystemExit, match="rank 9 does not exist"):
        bench.main(["--quick", "--hetero", "9=0.5", "--out", str(out)])
    assert not out.exists()  # nothing ran, nothing was written


def _write_run(path, rewards, step_time, wall=None):
    path.mkdir(parents=True)
    rows = [{"step": s, "reward_mean": r, "step_time_s": step_time} for s, r in enumerate(rewards)]
    for row, t in zip(rows, wall or []):
        row["wall_s"] = t
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_time_to_reward_and_reward_at_wall_by_hand(tmp_path):
    from tools import compare_runs as cr
    rows = _write_run(tmp_path / "a", [0.0, 0.1, 0.2, 0.3, 0.4], step_time=0.5)
    assert cr.wall_clock(rows) == [0.5, 1.0, 1.5, 2.0, 2.5]  # cumulative step_time_s
    assert cr.time_to_reward(rows, 0.3, window=1) == 2.0
    assert cr.time_to_reward(rows, 0.3, window=2) == 2.5  # trailing means 0, .05, .15, .25, .35
    assert cr.time_to_reward(rows, 0.9, window=1) is None
    assert cr.reward_at(rows, 1.7, window=1) == 0.2 and cr.reward_at(rows, 0.1, window=1) is None
    logged = _write_run(tmp_path / "b", [0.0, 0.5], step_time=0.5, wall=[3.0, 7.0])
    assert cr.wall_clock(logged) == [3.0, 7.0]  # a logged wall clock wins


def test_time_to_reward_over_seeds(tmp_path, capsys):
    from tools import compare_runs as cr
    # "fast" steps take 0.5 s and "slow" 1 s; both learn 0.1 per step. colocated's final reward is
    # 0.4 (mean of its two seeds 0.35 and 0.45), so fast reaches it at step 4 -> 2.5 s, 3.0 s.
    specs = []
    for label, step_time, rates in (("fast", 0.5, (0.1, 0.08)), ("colocated", 1.0, (0.07, 0.09))):
        for seed, rate in enumerate(rates):
            _write_run(tmp_path / f"{label}{seed}", [rate * s for s in range(6)], step_time)
            specs.append(f"{label}={tmp_path / f'{label}{seed}'}")
    out, js = tmp_path / "curves.png", tmp_path / "ttr.json"
    assert cr.main(specs + ["--out", str(out), "--target-reward", "colocated", "--at-wall-s", "2",
                            "--json", str(js)]) == 0
    table = json.loads(js.read_text())
    assert table["target_reward"] == pytest.approx(0.4)
    fast, col = table["labels"]["fast"], table["labels"]["colocated"]
    assert fast["time_to_target_s"] == pytest.approx([2.5, 3.0])  # 0.1 x 4 = 0.4; 0.08 x 5 = 0.4
    assert col["time_to_target_s"] == [None, 6.0]  # 0.07 x 5 = 0.35 never reaches; 0.09 x 5 = 0.45
    assert fast["reward_at_wall"] == pytest.approx([0.3, 0.24])
    assert col["reward_at_wall"] == pytest.approx([0.07, 0.09])
    text = capsys.readouterr().out
    assert "1/2 reached" in text and "2/2 reached" in text
    assert out.stat().st_size > 1000 and (tmp_path / "curves_wall.png").stat().st_size > 1000
    assert cr.main(specs + ["--target-reward", "nobody"]) == 2
