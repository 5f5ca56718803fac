"""tools/plan.py: its commands pass cli.validate, its memory filter rejects what does not fit, and its best
configuration is never slower under the simulator than a fixed default one."""
import functools
import shlex

import pytest

import cli
import config
import models
from tools import plan, plan_memory
from tools.simulate import simulate

pytestmark = pytest.mark.timeout(900)

FAMILIES = ("flux", "qwenimage", "wan", "hunyuanvideo")


def _problem(family, gpus=16, **kw):
    return plan.Problem(plan_memory.settings(family)[0], family, gpus, **kw)


@functools.lru_cache(maxsize=None)
def _best(family: str):
    """plan.best(_problem(family), top=1), searched once per family for the tests that read it (seconds each)."""
    return plan.best(_problem(family), top=1)


def _main_args(command: str) -> tuple[list[str], int]:
    """main.py's arguments of a printed command and the world size torchrun gives it."""
    tokens = shlex.split(command)
    at = tokens.index("main.py")
    launcher = dict(t[2:].split("=", 1) for t in tokens[1:at] if "=" in t)
    return tokens[at + 1:], int(launcher.get("nnodes", 1)) * int(launcher["nproc_per_node"])


@pytest.mark.parametrize("family", FAMILIES)
def test_printed_command_passes_config_validate(family, tiny_cache):
    """Catches a planner whose command config refuses (e.g. --fsdp --tag with fragments smaller than K, a fragment
    size that does not divide the batch) or runs another configuration than the one predicted: the printed command
    is parsed with config's own parser, resolved and validated on its world size (the family's tiny pipeline stands
    in for the weights, as in test_presets), and its fields are the candidate's; the simulated workload is the
    command's (M updates per batch: main.py's own default is 2, the plan's 1) and the runtime's (TSP packs span
    fragments; TAG claims whole groups, split by trajectories: simulate.py's "group-claims", not the what-if
    "trajectories" of unaligned rollout claims)."""
    p = _problem(family)
    plans, _ = _best(family)
    c = plans[0].candidate
    args, world = _main_args(plan.command(p, c))
    assert world == 16
    args[args.index("--pretrained") + 1] = models.tiny_pipeline_path(family)
    cfg = config.resolve(config.parse_args(args), world)
    cli.validate(cfg, world)
    s = plan_memory.settings(family)[1]
    assert (cfg.model, cfg.rollout_ranks, cfg.fragment_groups, cfg.tsp_pack, cfg.tag, cfg.max_stale_fragments) == (
        family, c.rollout_ranks, c.fragment_groups, c.tsp_pack, c.tag, c.max_stale)
    assert (cfg.placement, cfg.gap, cfg.tsp, cfg.use_tcss, cfg.lora) == ("disaggregated", True, True, True, True)
    assert (cfg.group_size, cfg.num_steps, cfg.prompts_per_step) == (s["G"], s["T"], 32)
    wl = p.workload(c)  # the simulated workload is the command's: T_train = int(T f) (flow_grpo)
    assert int(cfg.num_steps * cfg.timestep_fraction) == wl.train_steps
    assert cfg.updates_per_batch == wl.updates_per_batch == plan.paper_settings()["updates_per_batch"]
    assert (wl.tsp_span, wl.tag_split) == (cfg.tsp_span, "group-claims")
    assert cfg.resolution == s["flags"]["resolution"] and cfg.grad_ckpt == s["grad_ckpt"]


def test_no_lora_plans_fsdp_and_respects_its_tag_rule():
    """Catches a full fine-tuning plan without FSDP (a 12B model's fp32 state does not fit one H200), with TAG and
    fragments smaller than K (cli.validate refuses it), or one that keeps TAG at any price (K <= 4 trainers, so
    that fragments of 4 groups are >= K, instead of TAG off)."""
    p = _problem("flux", lora=False)
    refused = plan.admissible(p, plan.Candidate(8, 1, 1, True, 8), plan_memory.load())
    assert refused[0] is False and "--fragment-groups >= K" in refused[2]
    plans, _ = plan.best(p, top=3)
    assert plans[0].report.efficiency > 0.8  # TAG off (or fragments >= K) rather than K <= 4 trainers
    for x in plans:
        args = plan.main_args(p, x.candidate, pretrained=None)
        assert "--fsdp" in args and "--no-lora" in args
        assert not x.candidate.tag or x.candidate.fragment_groups >= 16 - x.candidate.rollout_ranks
        plan.validate(p, x.candidate)


def test_memory_filter_rejects_a_config_that_does_not_fit():
    """Catches a planner that ignores the memory estimate: with a trainer peak that outgrows the H200 above 2 pairs
    per pack, no plan uses a bigger pack and those candidates are counted as rejected for memory; and the real
    cache's FLUX LoRA trainer at pack 8 is below the limit, at pack 16 above it (no such pack is planned)."""
    fake = {"flux lora": {"points": [
        {"fragment_samples": 12, "tsp_pack": 1, "trainers": 8, "rollout_gib": 30.0, "trainer_gib": 60.0, "params_b": 12},
        {"fragment_samples": 48, "tsp_pack": 8, "trainers": 8, "rollout_gib": 40.0, "trainer_gib": 340.0,
         "params_b": 12}]}}
    p = _problem("flux")
    plans, rejected = plan.search(p, fake)
    assert plans and rejected.get("memory", 0) > 0
    assert max(x.candidate.tsp_pack for x in plans) == 2  # 60 + 40 x (pack - 1) + 4 GiB <= 140.4 only for pack <= 2
    assert not plan_memory.fits(plan_memory.peaks("flux", True, 1, 4, 8, fake))
    real = plan_memory.load()
    assert plan_memory.fits(plan_memory.peaks("flux", True, 1, 8, 8, real))
    assert not plan_memory.fits(plan_memory.peaks("flux", True, 1, 16, 8, real))


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_best_plan_is_not_slower_than_a_fixed_baseline(family):
    """Catches a search that returns a worse configuration than the runtime's default one (R = K = 8, fragments of
    one group, the model's pack, TAG and j = R), e.g. a sort in the wrong order or a stage that drops the best R."""
    p = _problem(family)
    best = _best(family)[0][0]
    pack = plan.paper_settings()["models"][p.label]["pack"]
    base = plan.Candidate(8, 1, pack, True, 8)
    assert plan.admissible(p, base, plan_memory.load())[0]
    baseline = simulate("digenrl", p.costs(1), p.cluster(8), p.workload(base))
    assert best.report.step_s <= baseline.step_s + 1e-9


def test_paper_scale_digenrl_row_is_the_plans():
    """Catches a paper-scale table whose DigenRL row is not the planner's choice (the table and tools/plan.py would
    print different step times for the same model and cluster)."""
    from tools import paper_scale
    case = paper_scale.run_case("FLUX.1-dev-12B 512px", 16, paper_scale.paper_settings())
    best = _best("flux")[0][0]
    row = next(r for r in case["reports"] if r.mode == "digenrl")
    assert case["plan"] == best.candidate and row.step_s == pytest.approx(best.report.step_s)
    assert case["command"] == plan.command(_problem("flux"), best.candidate)


def test_updates_per_batch_feeds_the_prediction_and_the_command(capsys):
    """Catches --updates-per-batch that reaches the printed command but not the simulation (or the reverse), or an
    ideal colocated baseline simulated with another M than DigenRL."""
    p = _problem("flux", updates_per_batch=2)
    c = plan.Candidate(4, 1, 4, True, 4)
    args = plan.main_args(p, c, pretrained=None)
    assert args[args.index("--updates-per-batch") + 1] == "2" and p.workload(c).updates_per_batch == 2
    assert plan.ideal_colocated_s(p) > plan.ideal_colocated_s(_problem("flux"))  # an update more per step
    assert plan.main(["--model", "flux", "--gpus", "4", "--updates-per-batch", "2", "--top", "1"]) == 0
    printed = capsys.readouterr().out
    assert "M = 2 updates per batch" in printed
    args, _ = _main_args(next(line for line in printed.splitlines() if line.startswith("torchrun")))
    assert args[args.index("--updates-per-batch") + 1] == "2"


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "1"], "at least 2"), (["--gpus", "16", "--rollout-speed", "0"], "must be in"),
    (["--gpus", "16", "--rollout-gpus", "16"], "between 1"),
    (["--gpus", "16", "--updates-per-batch", "0"], "between 1 and the 32 groups")])
def test_bad_input_is_one_line(flags, message, capsys):
    """Catches a planner that crashes (or plans nonsense) on a cluster it cannot run."""
    with pytest.raises(SystemExit) as exit_info:
        plan.main(["--model", "flux", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
