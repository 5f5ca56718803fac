"""The central claims of GAP, TSP and TAG: the update after a step is the same in every placement, for any
cut of the batch into fragments, and whoever generates.

Each case runs main.py's job (its gloo ranks, launched as main.py launches them: conftest.run_forked, from
one forkserver of this process that imported main.py once, so a job costs its ranks' work, not two fresh
interpreters' imports) and compares the trained weights in the checkpoint (allclose, float32, same seed and batch).
The runs use `--optimizer sgd --lr 1`, so a weight moves by exactly minus its gradient: comparing weights compares
gradients. (AdamW's first step moves each
weight by about lr x sign(gradient), which amplifies float rounding in near-zero gradients.)
Run with DIGENRL_TEST_SEED=k to try another seed (the note reports seeds 0-4).

Two cases pin the runs to outside truths as well: the one-process update is minus the gradient of the plain
Flow-GRPO objective over the batch it generated (written out in tests/test_truth.py, autograd), and with
--max-grad-norm small enough to engage, a K=2 TSP run's update is the one-process update scaled to that norm
(clipping is of the global norm, after the all-reduce: clipping each rank's own gradient fails it).
Each case runs when a test first needs it, so `pytest -k` of one case costs that case and its reference.
"""
import os

import pytest
import torch

from conftest import checkpoint_weights, read_metrics, run_forked

pytestmark = pytest.mark.timeout(900)
SEED = os.environ.get("DIGENRL_TEST_SEED", "3")

COMMON = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--num-steps", "3", "--eval-every", "0",
          "--save-every", "1", "--seed", SEED, "--timeout-s", "60", "--optimizer", "sgd", "--lr", "1", "--no-trace",
          "--noise-level", "0.7",  # test_truth.NOISE_LEVEL, which the outside-truth test below writes out
          "--updates-per-batch", "2"]  # two updates per step: groups [0, 2), then [2, 4) against recorded log-probs
DISAGG = ["--placement", "disaggregated", "--gap"]
CASES = {  # name -> flags; --fragment-groups 1, 2 and 4 cut the same batch of 4 groups into 4, 2 and 1 fragments
    "one_process": ["--mode", "colocated", "--nproc", "1", "--fragment-groups", "1"],
    "one_process_m1": ["--mode", "colocated", "--nproc", "1", "--fragment-groups", "1", "--updates-per-batch", "1"],
    "one_process_fg4": ["--mode", "colocated", "--nproc", "1", "--fragment-groups", "4"],
    "colocated_2": ["--mode", "colocated", "--nproc", "2", "--fragment-groups", "2"],
    "naive_barrier": ["--mode", "naive", "--nproc", "2", "--fragment-groups", "1"],
    "gap": [*DISAGG, "--nproc", "2", "--fragment-groups", "4"],
    "gap_tsp_k1": [*DISAGG, "--tsp", "--tsp-pack", "4", "--nproc", "2", "--fragment-groups", "2"],
    "gap_tsp_k2": [*DISAGG, "--tsp", "--tsp-pack", "3", "--nproc", "3", "--fragment-groups", "1"],
    "gap_tsp_k2_per_fragment": [*DISAGG, "--tsp", "--tsp-pack", "3", "--nproc", "3", "--fragment-groups", "1",
                                "--no-tsp-span"],  # the reference packing: each fragment padded alone
    "gap_tsp_fsdp_k2": [*DISAGG, "--tsp", "--tsp-pack", "3", "--fsdp", "--nproc", "3", "--fragment-groups", "2"],
    "gap_tsp_fsdp_k3": [*DISAGG, "--tsp", "--tsp-pack", "3", "--fsdp", "--nproc", "4", "--fragment-groups", "1"],
    "dealt_k2": [*DISAGG, "--nproc", "3", "--fragment-groups", "1"],
}
MAX_NORM = 0.005  # --max-grad-norm well below the step's gradient norm (about 0.03 here): clipping engages
CLIPPED = {"gap_tsp_k2_clip": [*CASES["gap_tsp_k2"], "--max-grad-norm", str(MAX_NORM), "--updates-per-batch", "1"]}


def assert_same_update(weights, reference, initial, name, atol=1e-5, weight_ulps=1):
    """The updates (weights minus initial weights) agree to float32 rounding: `atol` is relative to the
    largest element of the reference update, plus `weight_ulps` float32 ulps of the tensor's largest weight:
    an update read back from stored float32 weights is only exact to about one ulp of the weight (seed 2:
    4.5e-8 apart on weights near 0.4, above 1e-5 of the largest update element)."""
    assert reference.keys() == weights.keys()
    scale = max(float((reference[k] - initial[k]).abs().max()) for k in reference)
    assert scale > 0, "the reference step changed nothing"
    eps = torch.finfo(torch.float32).eps
    for key in reference:
        tolerance = atol * scale + weight_ulps * eps * float(initial[key].abs().max())
        torch.testing.assert_close(weights[key] - initial[key], reference[key] - initial[key], rtol=1e-4,
                                   atol=tolerance, msg=lambda m: f"{name}: {key}: {m}")


@pytest.fixture(scope="module")
def initial(tiny_cache):
    import models
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    return {k: v.detach().clone() for k, v in policy.transformer.named_parameters()}


@pytest.fixture(scope="module")
def run_case(tiny_cache, tmp_path_factory):
    """run_case(name) -> (weights after the step, metrics rows); each case runs once per module, when first asked."""
    out = tmp_path_factory.mktemp("placements")
    done = {}

    def run(name):
        if name not in done:
            run_forked([*COMMON, *{**CASES, **CLIPPED}[name]], out, name, tiny_cache)
            done[name] = (checkpoint_weights(os.path.join(out, name), 1), read_metrics(os.path.join(out, name)))
        return done[name]
    return run


@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("one_process")] + ["one_process_fg4"])
def test_update_equals_the_single_process_update(run_case, initial, name):
    reference, ref_metrics = run_case("one_process")
    weights, metrics = run_case(name)
    assert_same_update(weights, reference, initial, name)
    # the same trajectories were trained: rewards and the number of pairs agree, each trajectory counted once
    assert metrics[0]["reward_mean"] == pytest.approx(ref_metrics[0]["reward_mean"], abs=1e-6)
    assert metrics[0]["pairs"] == ref_metrics[0]["pairs"] == 4 * 2 * 2
    assert metrics[0]["trajectories"] == ref_metrics[0]["trajectories"] == 4 * 2
    assert metrics[0]["staleness_mean"] == 0


@pytest.mark.parametrize("name, updates", [("one_process_m1", 1), ("one_process", 2)])
def test_the_one_process_update_is_minus_the_gradient_of_the_plain_objective(run_case, initial, name, updates):
    """Outside truth for the whole path (spec, generation, reward, advantages, loss weights, optimizer):
    the batch regenerated here, the objective written out in test_truth.py, autograd; sgd lr 1. With two
    updates (Flow-GRPO's inner updates): minus the gradient of minibatch [0, 2)'s mean objective, then minus
    that of [2, 4)'s at the moved weights, its ratio against the log-probs the rollout recorded."""
    import config
    import grpo
    import models
    import rewards
    from fragment import fragment_spec
    from rollout import SamplingConfig, generate_fragment
    from test_truth import NOISE_LEVEL, plain_flow_grpo_loss

    weights, metrics = run_case(name)
    cfg = config.resolve(config.parse_args([*COMMON, *CASES[name]]))
    assert (cfg.noise_level, cfg.max_grad_norm, cfg.num_steps, cfg.updates_per_batch) == (NOISE_LEVEL, 1.0, 3,
                                                                                           updates)
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32,
                         max_sequence_length=cfg.text_len)
    models.enable_full_training(policy)
    params = dict(policy.transformer.named_parameters())
    assert all(torch.equal(params[k].detach(), initial[k]) for k in weights)
    prompts = rewards.prompt_source(cfg).train
    spec = fragment_spec(cfg.seed, 0, 0, 4, len(prompts), 4, 2)  # the whole batch: 4 groups of 2
    sampling = SamplingConfig(num_steps=3, noise_level=NOISE_LEVEL)  # T_train = int(3 * 0.99) = 2
    fragment = generate_fragment(policy, spec, prompts, sampling, rewards.build_reward("color"), 0, 0)
    assert float(fragment.rewards.mean()) == pytest.approx(metrics[0]["reward_mean"], abs=1e-6)
    expected = {k: initial[k].clone() for k in weights}
    for j, (lo, hi) in enumerate(grpo.minibatch_bounds(4, updates)):
        part = grpo.groups_of(fragment, lo, hi)
        loss = plain_flow_grpo_loss(policy, part, part.log_probs if j else None, cfg.clip_range,
                                    total_pairs=(hi - lo) * 2 * 2)
        gradient = dict(zip(weights, torch.autograd.grad(loss, [params[k] for k in weights])))
        assert sum(float((g ** 2).sum()) for g in gradient.values()) ** 0.5 < cfg.max_grad_norm  # no clipping
        with torch.no_grad():
            for k, g in gradient.items():
                expected[k] -= g
                params[k].copy_(expected[k])  # the next minibatch's gradient is at the moved weights
    assert metrics[0]["updates"] == updates and metrics[0]["update_kl"] > 0
    assert_same_update(weights, expected, initial, "plain objective")


def test_clipping_scales_the_global_gradient_across_two_trainers(run_case, initial):
    """One update (M = 1): with two, the second gradient is taken at clipped-step weights, not a scaling."""
    reference, ref_metrics = run_case("one_process_m1")
    weights, metrics = run_case("gap_tsp_k2_clip")
    norm = ref_metrics[0]["grad_norm"]
    assert norm > 3 * MAX_NORM, "clipping would not engage: this test would prove nothing"
    assert metrics[0]["grad_norm"] == pytest.approx(norm, rel=1e-4)  # the logged norm is the global one, unclipped
    scale = MAX_NORM / (norm + 1e-6)  # clip_grad_norm_'s coefficient for the global norm
    clipped = {k: initial[k] + (reference[k] - initial[k]) * scale for k in reference}
    assert_same_update(weights, clipped, initial, "gap_tsp_k2_clip", weight_ulps=2)
    moved = sum(float(((weights[k] - initial[k]) ** 2).sum()) for k in weights) ** 0.5
    assert moved == pytest.approx(MAX_NORM, rel=1e-3)  # sgd lr 1: the weights moved by exactly the clipped norm


def test_the_step_changed_the_weights(run_case, initial):
    weights, _ = run_case("one_process")
    assert any(not torch.equal(initial[k], v) for k, v in weights.items())


# TAG and TCSS at scripted moments (tests/inject/scripted_schedule.py): TAG's predictor gets scripted times and
# decides at each step boundary, TCSS's generate-ahead is awaited; so TAG and stale fragments occur whatever the
# machine's speed (they used to depend on timing: many sampling steps, few trained, and luck).
TAG_COMMON = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "2", "--num-steps", "3",
              "--fragment-groups", "2", "--eval-every", "0", "--save-every", "3", "--seed", SEED, "--timeout-s", "60",
              "--optimizer", "sgd", "--lr", "1", "--no-trace", "--updates-per-batch", "2"]


def test_tag_acts_and_the_update_is_unchanged(tiny_cache, tmp_path, initial):
    """TAG changes who generates, never what: catches TAG fragments of other trajectories, of the wrong weights
    version, counted twice or trained with other weights than the rollout's would be."""
    run_forked([*TAG_COMMON, "--mode", "colocated", "--nproc", "1"], tmp_path, "reference", tiny_cache)
    run_forked([*TAG_COMMON, *DISAGG, "--tsp", "--tag", "--nproc", "2"], tmp_path, "tag", tiny_cache, scripted=True)
    rows, ref_rows = read_metrics(tmp_path / "tag"), read_metrics(tmp_path / "reference")
    assert [r["tag_fragments"] for r in rows] == [0, 1, 1], "scripted: TAG generates steps 1 and 2 whole"
    assert all(r["trajectories"] == 8 for r in rows)  # TAG changes who generates, not how much
    # without TCSS nothing is ever stale, TAG's fragments included (test_tcss_staleness_... checks TCSS's bound)
    assert all(r["staleness_mean"] == 0 and r["stale_fragments"] == 0 for r in rows), rows
    for row, ref in zip(rows, ref_rows):
        assert row["reward_mean"] == pytest.approx(ref["reward_mean"], abs=1e-6)
    # three steps at lr 1: the later gradients are taken at weights that already differ by rounding
    assert_same_update(checkpoint_weights(tmp_path / "tag", 3), checkpoint_weights(tmp_path / "reference", 3),
                       initial, "tag", atol=1e-4)


def test_tag_by_trajectories_splits_a_group_over_fsdp_trainers_and_the_update_is_unchanged(
        tiny_cache, tmp_path, initial):
    """TAG by trajectories under FSDP: at step 1 the scripted leader claims all 3 groups of 3, and
    the K = 2 trainers generate 4 and 5 of the 9 trajectories (group 1 by both; FSDP needs the same
    number of forward calls, not the same batch sizes). Catches a part generated from other seeds or
    prompts, advantages computed per part (or not at all), parts joined out of order, a split by
    whole groups, unequal forward calls (a hang), and (per-prompt statistics) a share posted to the
    batch statistics as if it were whole groups (it raised before issue 25's fix)."""
    import json

    args = ["--steps", "2", "--prompts-per-step", "3", "--group-size", "3", "--num-steps", "3",
            "--fragment-groups", "3", "--eval-every", "0", "--save-every", "2", "--seed", SEED,
            "--timeout-s", "60", "--optimizer", "sgd", "--lr", "1",
            "--per-prompt-stat-tracking"]  # a share (part of a group) must not be posted as whole groups
    run_forked([*args, "--mode", "colocated", "--nproc", "1", "--no-trace"], tmp_path, "reference", tiny_cache)
    run_forked([*args, *DISAGG, "--tsp", "--tsp-pack", "3", "--tag", "--fsdp", "--nproc", "3"], tmp_path, "split",
            tiny_cache, scripted=True)
    rows, ref_rows = read_metrics(tmp_path / "split"), read_metrics(tmp_path / "reference")
    assert [r["tag_fragments"] for r in rows] == [0, 1], "scripted: TAG generates step 1"
    events = json.loads((tmp_path / "split" / "trace.json").read_text())["traceEvents"]
    shares = sorted((e["tid"], e["args"]["samples"]) for e in events
                    if e["ph"] == "X" and e["name"] == "tag" and e["args"].get("step") == 1)
    assert shares == [(1, 4), (2, 5)], shares  # trajectories 0-3 and 4-8: group 1 (3-5) by both
    assert all(r["trajectories"] == 9 for r in rows)
    for row, ref in zip(rows, ref_rows):
        assert row["reward_mean"] == pytest.approx(ref["reward_mean"], abs=1e-6)
    assert_same_update(checkpoint_weights(tmp_path / "split", 2),
                       checkpoint_weights(tmp_path / "reference", 2), initial,
                       "tag by trajectories", atol=1e-4)


def test_tcss_staleness_is_zero_or_one_and_bounded(tiny_cache, tmp_path):
    steps = ["--steps", "4", "--prompts-per-step", "3", "--group-size", "3", "--num-steps", "3", "--eval-every", "0",
             "--save-every", "0", "--timeout-s", "60", "--nproc", "2", "--no-trace", "--updates-per-batch", "2"]
    run_forked([*steps, "--mode", "digenrl", "--max-stale-fragments", "1"], tmp_path, "tcss", tiny_cache,
            scripted=True)  # a stale fragment in every step after the first, whatever the timing
    # (that a synchronous run is never stale: test_tag_acts_..., whose GAP + TSP + TAG run has no TCSS)
    rows = read_metrics(tmp_path / "tcss")
    assert all(0 <= r["staleness_mean"] <= 1 for r in rows)
    assert all(r["stale_fragments"] <= 1 for r in rows)
    assert rows[0]["stale_fragments"] == 0  # nothing can be stale before the first update
    assert [r["stale_fragments"] for r in rows] == [0, 1, 1, 1], "scripted: one stale fragment per step after 0"
    # Steps 1-3: the stale fragment (group 0) is minibatch 0; after its update TAG generates the claimed groups
    # 1-2 (minibatch 1) with the updated weights, so their pairs' ratio is exactly 1 (tag.py's departure with
    # M > 1). Catches a claim generated with other weights than the trainer's current ones (a kept copy of the
    # batch's version, the rollout's), or its recorded log-probs replaced by others.
    assert [r["tag_fragments"] for r in rows] == [0, 1, 1, 1], rows
    for r in rows[1:]:
        assert r["ratio_min_later"] == pytest.approx(1, abs=1e-5) and r["ratio_max_later"] == pytest.approx(1, abs=1e-5)
        assert r["ratio_min_stale"] < 0.999, r  # the stale pairs are one version behind


@pytest.mark.parametrize("slow,acts", [("0=0.2", True), ("1=0.2", False)])
def test_digenrl_tag_acts_exactly_when_the_trainers_would_idle(tiny_cache, tmp_path, slow, acts):
    """The real predictor (no script), DigenRL mode with TCSS: with the rollout rank at a fifth of its speed
    (--rank-speed, benchmark emulation) the trainer would idle most of every step, so TAG claims groups in
    most steps; with the trainer at a fifth, training is the bottleneck and TAG never claims. Catches a
    predictor that never claims next to TCSS (e.g. deciding only when nothing is in flight, or only at the
    head of a step) and one that claims when it only delays training."""
    args = ["--mode", "digenrl", "--nproc", "2", "--steps", "6", "--prompts-per-step", "4", "--group-size", "2",
            "--num-steps", "6", "--fragment-groups", "1", "--eval-every", "0", "--save-every", "0",
            "--timeout-s", "60", "--no-trace", "--rank-speed", slow]
    run_forked(args, tmp_path, "run", tiny_cache)
    claims = [r["tag_fragments"] for r in read_metrics(tmp_path / "run")][1:]  # step 0 measures the costs
    if acts:
        assert sum(c > 0 for c in claims) >= len(claims) // 2, claims
    else:
        assert sum(claims) == 0, claims
