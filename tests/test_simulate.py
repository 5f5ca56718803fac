"""simulate.py: hand-computed step times for tiny synthetic cases, and the bound is never beaten."""
import random

import pytest

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
    assert expected == pytest.approx(max(3 * g, 3 * t) + min(3 * g, 3 * t) / 3 + 0.05)  # DESIGN.md section 5's formula
    for mode in ("gap", "gap+tsp"):  # with K = 1, TSP changes nothing
        assert sim.simulate(mode, _costs(f, b), ONE_EACH, WL).step_s == pytest.approx(expected)


def test_colocated_by_hand():
    wl = sim.Workload(groups=4, group_size=4, num_steps=5, train_steps=3, steps=6)
    costs = _costs(f=0.01, b=0.02, optimizer=0.01, switch_s=0.1)
    rep = sim.simulate("colocated", costs, sim.Cluster(nproc=2), wl)
    assert rep.step_s == pytest.approx(0.1 + 2 * (4 * 5 * 0.01 + 4 * 3 * 0.02) + 0.01)  # 2 fragments per rank


def test_async_training_bound_hides_generation():
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


def test_tsp_passes_match_tsp_py():
    tsp = pytest.importorskip("tsp")
    for m in (1, 3, 4, 12):
        for t_train in (1, 5, 7):
            for k in (1, 2, 3, 8):
                for pack in (1, 4):
                    assert sim.tsp_passes(m, t_train, k, pack) == tsp.num_passes(m, t_train, k, pack)


def test_bound_is_never_beaten():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(120):
        nproc = rng.randint(2, 6)
        cluster = sim.Cluster(nproc, rng.randint(1, nproc - 1), "a", "b", {"a": rng.choice([0.5, 1.0, 2.0]), "b": 1.0})
        groups = rng.choice([1, 2, 3, 4, 6])
        wl = sim.Workload(groups=groups, group_size=rng.choice([2, 4]), num_steps=rng.randint(2, 8), train_steps=1,
                          fragment_groups=rng.choice([g for g in (1, 2, 3) if groups % g == 0]),
                          max_stale=rng.randint(0, 3), tsp_pack=rng.choice([1, 2, 4]), steps=7)
        wl.train_steps = rng.randint(1, wl.num_steps)
        maybe = lambda: rng.choice([0.0, rng.uniform(0, 0.02)])  # noqa: E731
        costs = sim.Costs(forward_s={1: rng.uniform(0.001, 0.02), 8: rng.uniform(0.001, 0.02)},
                          train_s={1: rng.uniform(0.001, 0.05), 4: rng.uniform(0.001, 0.05)}, decode_s=maybe(),
                          reward_s=maybe(), transfer_s=maybe(), publish_s=maybe(), optimizer_s=maybe(),
                          step_overhead_s=maybe(), weights_latency_s=maybe(), switch_s=maybe(), true_cfg=rng.random() < 0.3)
        for mode in sim.MODES:
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
