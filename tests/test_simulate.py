"""simulate.py: hand-computed step times for tiny synthetic cases, and the bound is never beaten."""
import random

import pytest

from tools import sim_model
from tools import simulate as sim

pytestmark = pytest.mark.timeout(60)


def _costs(f, b, publish=0.05, optimizer=0.0, **kw):
    return sim.Costs(forward_s={4: f}, train_s={4: b}, publish_s=publish, optimizer_s=optimizer, **kw)


# M = 3 fragments of m = 4 trajectories, T = 5, T_train = 3: one fragment is generated in 4*5*f, trained in 4*3*b.
WL = sim.Workload(groups=3, group_size=4, num_steps=5, train_steps=3, steps=8)
ONE_EACH = sim.Cluster(nproc=2, rollout_ranks=1)


def test_naive_is_gen_plus_train_plus_publish():
    costs = _costs(f=0.01, b=0.02, optimizer=0.01)
    gen, train = 3 * (4 * 5 * 0.01), 3 * (4 * 3 * 0.02)  # Gen = N T f / R, Tr = N T_train b / K
    rep = sim.simulate("naive", costs, ONE_EACH, WL)
    assert rep.step_s == pytest.approx(gen + train + 0.01 + 0.05)
    assert rep.busy["rollout"] == pytest.approx(gen / rep.step_s)


@pytest.mark.parametrize("f,b", [(0.01, 0.02), (0.02, 0.01)])
def test_gap_one_rollout_one_trainer_by_hand(f, b):
    g, t = 4 * 5 * f, 4 * 3 * b  # per fragment
    # Fragments arrive at g, 2g, 3g; the trainer trains each on arrival, so it ends at max(g + 3t, 3g + t).
    expected = max(g + 3 * t, 3 * g + t) + 0.05
    assert expected == pytest.approx(max(3 * g, 3 * t) + min(3 * g, 3 * t) / 3 + 0.05)  # docs/DESIGN.md section 5's formula
    for mode in ("gap", "gap+tsp"):  # with K = 1, TSP changes nothing
        assert sim.simulate(mode, _costs(f, b), ONE_EACH, WL).step_s == pytest.approx(expected)


def test_colocated_by_hand():
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, steps=6)
    costs = _costs(f=0.01, b=0.02, optimizer=0.01, switch_s=0.1)
    work = 2 * (4 * 5 * 0.01 + 4 * 3 * 0.02) + 0.01  # 2 fragments per rank, then the optimizer
    assert sim.simulate("colocated", costs, sim.Cluster(nproc=2), wl).step_s == pytest.approx(work)
    real = sim.simulate(sim.REAL_COLOCATED, costs, sim.Cluster(nproc=2), wl)  # + the switch
    assert real.step_s == pytest.approx(work + 0.1)


def test_several_updates_per_batch_by_hand():
    """M = 2 (--updates-per-batch): an optimizer step after each minibatch; colocated ranks each hold a
    share of every minibatch (colocated.static_claims), so both train through both updates."""
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, fragment_groups=2, steps=6,
                      updates_per_batch=2)
    costs = _costs(f=0.01, b=0.02, optimizer=0.01)
    # each rank: groups 0 and 2 (rank 0) or 1 and 3, generated in one call of 8 samples (f per item at
    # 8 is 0.006: one call of 2 groups, not two of 1 at 0.01), then per minibatch one group's training
    # and the optimizer
    costs.forward_s[8] = 0.006
    gen, train = 8 * 5 * 0.006, 4 * 3 * 0.02
    assert sim.simulate("colocated", costs, sim.Cluster(nproc=2), wl).step_s == pytest.approx(
        gen + 2 * (train + 0.01))
    del costs.forward_s[8]
    one = sim.Workload(**{**wl.__dict__, "updates_per_batch": 1})
    # naive, 1 + 1 ranks: the trainer trains the batch after it is in, with one more optimizer step at M = 2
    naive = {m: sim.simulate("naive", costs, ONE_EACH, w).step_s for m, w in ((1, one), (2, wl))}
    assert naive[2] == pytest.approx(naive[1] + 0.01)
    assert naive[1] == pytest.approx(2 * (8 * 5 * 0.01) + 2 * (8 * 3 * 0.02) + 0.01 + 0.05)
    # GAP with training the bottleneck (a group: 0.2 s to generate, 0.24 s to train): the first update
    # sits between two trainings, so it adds its 0.01 s, streaming or spanning packs alike
    wl1 = sim.Workload(**{**one.__dict__, "fragment_groups": 1, "tsp_span": True})
    for mode in ("gap", "gap+tsp", "digenrl"):
        steps = [sim.simulate(mode, costs, ONE_EACH, sim.Workload(**{**wl1.__dict__, "updates_per_batch": m}))
                 for m in (1, 2)]
        assert steps[1].step_s == pytest.approx(steps[0].step_s + 0.01), mode
    assert steps[0].step_s == pytest.approx(4 * 0.24 + 0.01 + 0.05)  # DigenRL: training-bound, TCSS hides generation


# Every mode's mechanisms, written out by hand (placement, gap, tsp, tag, tcss): the README's table of modes.
MECHANISMS = {"colocated": ("colocated", False, False, False, False),
              "naive": ("disaggregated", False, False, False, False),
              "gap": ("disaggregated", True, False, False, False),
              "gap+tsp": ("disaggregated", True, True, False, False),
              "gap+tsp+tag": ("disaggregated", True, True, True, False),
              "digenrl": ("disaggregated", True, True, True, True)}


def test_modes_are_the_documented_mechanism_mixes():
    """Catches a preset that changed (DigenRL without TCSS, naive with GAP) or a mix parsed into the wrong flags:
    simulate.py and bench.py would then simulate and run another mode than the one they name."""
    import config
    assert sim.MODES == MECHANISMS
    assert config.MODES == {name: MECHANISMS[name] for name in ("digenrl", "colocated", "naive")}
    assert sim.mechanisms("tsp+gap") == MECHANISMS["gap+tsp"]  # order-free
    assert sim.mechanisms("gap+tcss") == sim.mechanisms("gap+async") == ("disaggregated", True, False, False, True)
    assert sim.mechanisms(sim.REAL_COLOCATED) == MECHANISMS["colocated"]
    with pytest.raises(ValueError, match="unknown mode"):
        sim.mechanisms("gap+fast")


def test_group_granular_tag_by_hand():
    # B = 4 groups, fragments of 2, one rollout + one trainer; a group takes 0.6 s to generate
    # (4 x 5 x 0.03) and 0.06 s to train (4 x 3 x 0.005, 3 packs of 4, no padding). Before each
    # publish the leader claims 2 groups of the next step (tag.assist_groups' balancing share);
    # it generates them (1.2 s) and trains them (0.12 s) while the rollout rank generates the
    # other fragment (1.2 s), which is trained last: 1.44 s per step instead of 2.52 s.
    costs = _costs(f=0.03, b=0.005, publish=0.0)
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, fragment_groups=2, steps=8)
    with_tag = sim.simulate("gap+tsp+tag", costs, ONE_EACH, wl)
    assert with_tag.step_s == pytest.approx(1.44)
    assert with_tag.tag_groups == pytest.approx(2)  # step 0 too: claimed mid-step
    assert sim.simulate("gap+tsp", costs, ONE_EACH, wl).step_s == pytest.approx(2.52)


def test_tag_acts_under_tcss_when_generation_is_the_bottleneck():
    # bench.py --quick's shape (2 fragments of 2 groups, j = 1): the rollout rank finishes its
    # stale fragment during the trainer's long tail (optimizer 1 s) and claims the other fragment
    # the moment the weights arrive, while the trainer trains the stale one: only the leader's
    # claim right before the publish lets TAG take a share (without it: 2.45 s, no gain).
    costs = _costs(f=0.03, b=0.01, publish=0.01, optimizer=1.0)
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, fragment_groups=2, steps=8)
    full = sim.simulate("digenrl", costs, ONE_EACH, wl)
    no_tag = sim.simulate("gap+tsp+tcss", costs, ONE_EACH, wl)
    assert full.tag_groups > 0.5 and full.step_s < 0.9 * no_tag.step_s


def test_tag_groups_split_idle_trainers_without_a_share():
    # 3 trainers, TAG by groups: a 1-group claim keeps 2 trainers idle (the runtime's split);
    # the trajectories what-if gives every trainer a third of the group.
    costs = _costs(f=0.05, b=0.001, publish=0.0)
    wl = sim.Workload(groups=6, group_size=3, num_steps=4, train_steps=1, steps=8)
    cluster = sim.Cluster(nproc=4, rollout_ranks=1)
    groups = sim.simulate("gap+tsp+tag", costs, cluster, wl)
    traj = sim.simulate("gap+tsp+tag", costs, cluster,
                        sim.Workload(**{**wl.__dict__, "tag_split": "trajectories"}))
    assert groups.tag_groups > 0 and traj.step_s < groups.step_s


def test_slow_rank_runs_its_work_slower():
    costs = _costs(f=0.01, b=0.02, optimizer=0.01)
    slow = sim.Cluster(nproc=2, rollout_ranks=1, rank_speed={0: 0.5})
    assert slow.speed(0) == 0.5 and slow.speed(1) == 1.0
    gen, train = 3 * (4 * 5 * 0.01), 3 * (4 * 3 * 0.02)
    assert sim.simulate("naive", costs, slow, WL).step_s == pytest.approx(2 * gen + train + 0.06)


def test_tcss_training_bound_hides_generation():
    # t > g: the one stale fragment keeps the trainer busy across the weight publish -> step = M t + s.
    costs = _costs(f=0.01, b=0.03)
    rep = sim.simulate("digenrl", costs, ONE_EACH, WL)
    assert rep.step_s == pytest.approx(3 * 4 * 3 * 0.03 + 0.05)
    assert rep.tag_fragments == 0  # training is the bottleneck: TAG declines
    assert rep.stale_fragments > 0


def test_tag_helps_when_generation_is_the_bottleneck():
    costs = _costs(f=0.03, b=0.005, publish=0.0)
    wl = sim.Workload(groups=6, group_size=4, num_steps=5, train_steps=3, steps=8)
    with_tag = sim.simulate("gap+tsp+tag", costs, ONE_EACH, wl)
    without = sim.simulate("gap+tsp", costs, ONE_EACH, wl)
    assert with_tag.tag_fragments > 0 and with_tag.step_s < without.step_s


def test_bound_is_never_beaten():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(120):
        nproc = rng.randint(2, 6)
        cluster = sim.Cluster(nproc, rng.randint(1, nproc - 1), "a", "b", {"a": rng.choice([0.5, 1.0, 2.0]), "b": 1.0})
        groups = rng.choice([1, 2, 3, 4, 6])
        wl = sim.Workload(groups=groups, group_size=rng.choice([2, 4]), num_steps=rng.randint(2, 8), train_steps=1,
                          fragment_groups=rng.choice([1, 2, 3]), max_stale=rng.randint(0, 3),
                          tsp_pack=rng.choice([1, 2, 4]), steps=7, fsdp=rng.random() < 0.3,
                          tag_split=rng.choice(["groups", "trajectories"]),
                          tsp_span=rng.random() < 0.3)
        wl.train_steps = rng.randint(1, wl.num_steps)
        maybe = lambda: rng.choice([0.0, rng.uniform(0, 0.02)])  # noqa: E731
        costs = sim.Costs(forward_s={1: rng.uniform(0.001, 0.02), 8: rng.uniform(0.001, 0.02)},
                          train_s={1: rng.uniform(0.001, 0.05), 4: rng.uniform(0.001, 0.05)}, decode_s=maybe(),
                          reward_s=maybe(), transfer_s=maybe(), publish_s=maybe(), optimizer_s=maybe(),
                          step_overhead_s=maybe(), weights_latency_s=maybe(), switch_s=maybe(), true_cfg=rng.random() < 0.3)
        cluster.rank_speed = {rng.randrange(nproc): 0.5} if rng.random() < 0.3 else {}
        for mode in [*sim.MODES, sim.REAL_COLOCATED]:
            rep = sim.simulate(mode, costs, cluster, wl)
            worst = max(worst, rep.efficiency)
            assert rep.efficiency <= 1 + 1e-9, (mode, cluster, wl, costs, rep)
            assert 0 <= rep.bubble <= 1 + 1e-9
    assert worst > 0.5  # the sweep reaches efficient schedules, so the check has teeth


def test_paper_profiles_load():
    from tools import paper_scale
    for label in paper_scale.paper_settings()["models"]:
        costs = paper_scale.paper_costs(label, fragment_m=8, train_steps=8)
        assert costs.forward_s and costs.train_s and "measured" in costs.provenance


def test_real_colocated_switch_costs_from_the_profiles():
    from tools import paper_scale
    parts = paper_scale.switch_parts("Qwen-Image-20B 512px", 16)
    # the replica's size matches the ~55 GB veRL-Omni moves per step for Qwen-Image at TP=1
    assert 50 < parts["replica GB"] < 60
    assert parts["rollout sleep (D2H)"] == pytest.approx(parts["replica GB"] * 1e9 / 51e9)
    sync = 2 * 20430401088 * 15 / 16 / 25e9  # the bf16 transformer all-gathered at 25 GB/s
    assert parts["weight sync (all-gather)"] == pytest.approx(sync)


def test_simulate_does_not_import_paper_scale():
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(sim))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert not any("paper_scale" in name for name in imported)


def test_sweep_simulates_each_value_of_one_workload_field(tmp_path, capsys):
    import dataclasses
    import json
    costs = _costs(f=0.03, b=0.005, publish=0.01, optimizer=0.2)
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, fragment_groups=2, steps=8)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": costs.__dict__, "workload": wl.__dict__,
                                "cluster": ONE_EACH.__dict__}))
    out = tmp_path / "sweep.json"
    modes = ["gap+tsp+tcss", "digenrl"]
    assert sim.main(["--costs", str(path), "--modes", ",".join(modes), "--sweep", "num_steps=4,12",
                     "--steps", "8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["num_steps"], r["mode"]) for r in rows] == [(t, m) for t in (4, 12) for m in modes]
    for row in rows:  # each value is the workload simulated, not the file's
        rep = sim.simulate(row["mode"], costs, ONE_EACH, dataclasses.replace(wl, num_steps=row["num_steps"]))
        assert row["step_s"] == pytest.approx(rep.step_s)
    assert rows[0]["step_s"] < rows[2]["step_s"]  # more sampling steps, longer step
    printed = capsys.readouterr().out
    assert "## num_steps=12  Gen/Tr" in printed and printed.count("digenrl ") == 2
    ratio = sim.gen_train_ratio(costs, ONE_EACH, dataclasses.replace(wl, num_steps=12))
    assert ratio == pytest.approx((4 * 4 * 12 * 0.03) / (4 * 4 * 3 * 0.005))  # N T f / N T_train b


@pytest.mark.parametrize("flags, message", [
    (["--sweep", "steps=8,9"], "FIELD one of"), (["--sweep", "num_steps=8,x"], "must be integers"),
    (["--sweep", "num_steps=0"], ">= 1"), (["--modes", "gap+warp"], "unknown mode")])
def test_sweep_and_modes_refuse_bad_input(tmp_path, capsys, flags, message):
    import json
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"costs": _costs(0.01, 0.01).__dict__, "workload": WL.__dict__,
                                "cluster": ONE_EACH.__dict__}))
    with pytest.raises(SystemExit) as exit_info:
        sim.main(["--costs", str(path), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _dealt_round_robin_passes(fragment_pairs, trainers, pack):
    """Naive reference for TSP packs that span fragments: deal the step's pairs one by one round-robin
    (trainer r gets pairs r, r + K, ...); after each fragment, the lockstep trainers run every pack all of
    them can fill; after the last, one more padded pack if anyone still holds pairs."""
    held, passes, out = [0] * trainers, 0, []
    for i, n in enumerate(fragment_pairs):
        start = sum(fragment_pairs[:i])
        for p in range(start, start + n):
            held[p % trainers] += 1
        passes += min(held) // pack
        held = [h - min(held) // pack * pack for h in held]
        if i == len(fragment_pairs) - 1 and max(held) > 0:
            passes += 1
        out.append(passes)
    return out


def test_spanning_passes_match_dealing_pairs_one_by_one():
    """Catches a spanning-pack count that pads per fragment, or trains a pack before every trainer can fill it
    (FSDP's lockstep would hang): the closed form against the naive round-robin deal, random fragments."""
    rng = random.Random(1)
    for _ in range(300):
        k, pack = rng.randint(1, 6), rng.choice([1, 2, 3, 4, 8])
        fragments = [rng.randint(1, 30) for _ in range(rng.randint(1, 6))]
        got = [sim.spanning_passes(sum(fragments[:i + 1]), k, pack, last=i == len(fragments) - 1)
               for i in range(len(fragments))]
        assert got == _dealt_round_robin_passes(fragments, k, pack), (k, pack, fragments)


def test_tsp_packs_that_span_fragments_by_hand():
    """Catches TSP padding counted per fragment when packs span fragments (or the reverse). By hand: 4 fragments of
    one group of 2 samples, T_train = 3: 6 pairs per fragment over K = 4 trainers. Per fragment (today) each trainer
    holds ceil(6/4) = 2 pairs, padded to one pack of 4: 4 passes of 4 pair slots per step = 0.16 s at 0.01 s per
    pair. Spanning: the step's 24 pairs are 6 per trainer = ceil(6/4) = 2 passes: 0.08 s. Generation is ~free and
    publish 0.05 s, so the step is training + publish."""
    costs = _costs(f=1e-7, b=0.01, publish=0.05)
    wl = sim.Workload(groups=4, group_size=2, num_steps=3, train_steps=3, tsp_pack=4, steps=8)
    cluster = sim.Cluster(nproc=5, rollout_ranks=1)
    today = sim.simulate("gap+tsp", costs, cluster, wl)
    span = sim.simulate("gap+tsp", costs, cluster, sim.Workload(**{**wl.__dict__, "tsp_span": True}))
    assert today.step_s == pytest.approx(4 * 1 * 4 * 0.01 + 0.05, abs=1e-4)
    assert span.step_s == pytest.approx(2 * 4 * 0.01 + 0.05, abs=1e-4)
    assert sim.spanning_passes(18, 4, 4, last=False) == 1  # a pack trains once full, before the step ends


def test_tag_by_trajectories_by_hand():
    """Catches TAG shares split by whole groups when the split is by trajectories (or the reverse). By hand: one
    group of G = 3 per step, K = 3 trainers, a rollout rank 100x slower: before each publish the leader claims the
    whole step (1 group; 3 trajectories). By groups one trainer generates all 3 (3 x T f = 0.6 s); by trajectories
    each generates one (T f = 0.2 s); then the 3 pairs train in one pass of 1 (0.01 s)."""
    costs = _costs(f=0.05, b=0.01, publish=0.0)
    wl = sim.Workload(groups=1, group_size=3, num_steps=4, train_steps=1, tsp_pack=1, steps=8)
    cluster = sim.Cluster(nproc=4, rollout_ranks=1, rank_speed={0: 0.01})
    groups = sim.simulate("gap+tsp+tag", costs, cluster, wl)
    traj = sim.simulate("gap+tsp+tag", costs, cluster, sim.Workload(**{**wl.__dict__, "tag_split": "trajectories"}))
    assert groups.step_s == pytest.approx(3 * 4 * 0.05 + 0.01)
    assert traj.step_s == pytest.approx(4 * 0.05 + 0.01)
    assert groups.tag_groups == traj.tag_groups == 1  # every step's group (step 0's claimed mid-step)
    # the runtime's TAG (whole-group claims, split by trajectories) splits like "trajectories" here
    runtime = sim.simulate("gap+tsp+tag", costs, cluster,
                           sim.Workload(**{**wl.__dict__, "tag_split": "group-claims"}))
    assert runtime.step_s == pytest.approx(traj.step_s) and runtime.tag_groups == 1


def test_tag_may_claim_part_of_a_group_by_hand():
    """Catches claims by trajectories rounded to whole groups, or a partial group trained before it is complete.
    By hand: one group of G = 3 per step, one rollout rank and one trainer of the same speed, 4 x 0.05 = 0.2 s per
    trajectory. By whole groups TAG cannot help: 0.6 s on either GPU, + 3 pairs x 0.001 s. By trajectories the
    predictor claims 1 (2 ties at the same predicted end; ties go to the smaller claim): the trainer generates it
    in 0.2 s while the rollout rank generates the other 2 (0.4 s), and the group trains once all 3 are in: 0.403 s
    (trained on the trainer's third alone, it would be 0.203 s)."""
    costs = _costs(f=0.05, b=0.001, publish=0.0)
    wl = sim.Workload(groups=1, group_size=3, num_steps=4, train_steps=1, tsp_pack=1, steps=8, tsp_span=True)
    one_each = sim.Cluster(nproc=2, rollout_ranks=1)
    groups = sim.simulate("gap+tsp+tag", costs, one_each, wl)
    traj = sim.simulate("gap+tsp+tag", costs, one_each, sim.Workload(**{**wl.__dict__, "tag_split": "trajectories"}))
    assert groups.step_s == pytest.approx(0.603) and groups.tag_groups == 0
    assert traj.step_s == pytest.approx(0.403) and traj.tag_groups == pytest.approx(1 / 3)
    # the runtime's TAG claims whole groups: it cannot help here either (catches group-claims that
    # claim trajectories)
    runtime = sim.simulate("gap+tsp+tag", costs, one_each,
                           sim.Workload(**{**wl.__dict__, "tag_split": "group-claims"}))
    assert runtime.step_s == pytest.approx(0.603) and runtime.tag_groups == 0


def test_the_disaggregated_floor_is_never_beaten_and_is_reached_by_hand():
    """sim_model.disaggregated_floor_s is what tools/paper_scale.py uses to say where no DigenRL configuration can
    beat a baseline, so it must be a true floor: no simulated TSP schedule (any TAG split, the unaligned what-if included)
    is faster. Catches a floor that forgets the padding per update, prices generation above its cheapest batch,
    or splits it unevenly. By hand: 1 rollout + 1 trainer, 2 groups of 2, T = 4 at 0.01 s per sample-step, 2
    pairs per trajectory at 0.02 s (pack 1): training is 8 pairs = 0.16 s plus 0.01 s optimizer; the trainer
    also generates x of the 4 trajectories (0.04 s each): 0.17 + 0.04 x = 0.04 (4 - x) gives x = -0.125, so 0:
    the step is max(0.16, 0.17) = 0.17 s."""
    costs = sim.Costs(forward_s={1: 0.01}, train_s={1: 0.02}, optimizer_s=0.01)
    wl = sim.Workload(groups=2, group_size=2, num_steps=4, train_steps=2, tsp_pack=1)
    assert sim_model.disaggregated_floor_s(costs, wl, ONE_EACH, packs=(1,)) == pytest.approx(0.17)
    rng = random.Random(1)
    closest = 0.0
    for _ in range(60):
        nproc = rng.randint(2, 5)
        cluster = sim.Cluster(nproc, rng.randint(1, nproc - 1), "a", "b", {"a": rng.choice([0.5, 1.0]), "b": 1.0})
        wl = sim.Workload(groups=rng.choice([2, 3, 4, 6]), group_size=rng.choice([2, 3, 4]), num_steps=rng.randint(2, 6),
                          train_steps=1, fragment_groups=1, max_stale=rng.randint(0, 3), tsp_pack=rng.choice([1, 2, 4]),
                          steps=7, tag_split=rng.choice(["group-claims", "trajectories"]),
                          tsp_span=rng.random() < 0.7, updates_per_batch=rng.choice([1, 2]))
        wl.train_steps = rng.randint(1, wl.num_steps)
        costs = sim.Costs(forward_s={1: rng.uniform(0.002, 0.02), 8: rng.uniform(0.002, 0.02)},
                          train_s={1: rng.uniform(0.002, 0.05), 4: rng.uniform(0.002, 0.05)},
                          transfer_s=rng.uniform(0, 0.005), publish_s=rng.uniform(0, 0.01),
                          optimizer_s=rng.uniform(0, 0.01), allreduce_s=rng.uniform(0, 0.01))
        floor = sim_model.disaggregated_floor_s(costs, wl, cluster)
        for mode in ("gap+tsp", "gap+tsp+tag", "digenrl"):
            rep = sim.simulate(mode, costs, cluster, wl)
            assert floor <= rep.step_s * (1 + 1e-9), (mode, cluster, wl, costs, floor, rep.step_s)
            closest = max(closest, floor / rep.step_s)
    assert closest > 0.9  # some schedules come close: the floor is not loose everywhere


def test_group_claims_are_whole_groups_and_the_unaligned_what_if_is_not():
    """The runtime's TAG ("group-claims") claims whole groups: one rollout rank and three fast trainers, every TAG
    claim here is made at the step boundary, 3 whole groups a step, while the unaligned what-if ("trajectories",
    claims anywhere) claims fractions of groups. Catches group-claims that claim trajectories. (What is left of
    test_part_claims_are_never_made_at_a_step_boundary: simulate.py's "part-groups", the runtime's
    --tag-part-groups, was removed.)"""
    costs = _costs(f=0.04, b=0.002, publish=0.0)
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=2, tsp_pack=1, steps=8, tsp_span=True)
    runs = {split: sim.simulate("digenrl", costs, sim.Cluster(4, 1), sim.Workload(**{**wl.__dict__, "tag_split": split}))
            for split in ("group-claims", "trajectories")}
    assert runs["group-claims"].tag_groups == 3.0
    assert runs["trajectories"].tag_groups % 1 != 0
