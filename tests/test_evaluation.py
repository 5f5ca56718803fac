"""What `eval_reward` measures and what the run directory shows of it: rollout.evaluate's paired held-out seeds,
infra/evaluation.py's metrics and captioned grids / before-after image, and the reward curve's legend."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

import models
import rewards
from infra import rundir
from infra.evaluation import Evaluator
from rollout import EVAL_SEED, SamplingConfig, evaluate

pytestmark = pytest.mark.timeout(300)

TRAIN, HELDOUT = rewards.color_prompts("train"), rewards.color_prompts("eval")


@pytest.fixture(scope="module")
def policy(tiny_cache):
    return models.load("flux", models.tiny_pipeline_path("flux"), max_sequence_length=16)


def test_a_model_that_ignores_the_prompt_scores_exactly_zero(policy, monkeypatch):
    """Every prompt is sampled from the same noises, so a prompt-blind model draws the same image for red, green
    and blue, whose colour rewards sum to 0. With a different noise per prompt (the old evaluation) the mean over
    3 images would be anything in [-1, 1]."""
    blind = policy.encode_prompts([""])
    monkeypatch.setattr(policy, "encode_prompts", lambda prompts: {k: v.expand(len(prompts), *v.shape[1:])
                                                                  for k, v in blind.items()})
    scores, images = evaluate(policy, TRAIN, SamplingConfig(num_steps=3), rewards.build_reward("color"),
                              seeds_per_prompt=4)
    assert images.shape == (12, 3, 32, 32)
    per_prompt = images.view(3, 4, 3, 32, 32)
    torch.testing.assert_close(per_prompt[1], per_prompt[0])
    torch.testing.assert_close(per_prompt[2], per_prompt[0])
    assert not torch.equal(per_prompt[0, 0], per_prompt[0, 1])  # the seeds differ within a prompt
    assert abs(float(scores["total"].mean())) < 1e-6


def test_evaluation_is_deterministic_and_uses_seeds_apart_from_training(policy):
    from fragment import fragment_spec

    cfg, reward = SamplingConfig(num_steps=3), rewards.build_reward("color")
    a = evaluate(policy, TRAIN[:1], cfg, reward, seeds_per_prompt=2)[1]
    b = evaluate(policy, TRAIN[:1], cfg, reward, seeds_per_prompt=2)[1]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # training noises of a long run at any small seed stay far below the evaluation's
    spec = fragment_spec(99, 10**5, 31, 3, 64, 64, 1)
    assert max(spec.init_seeds + spec.noise_seeds) < EVAL_SEED


def test_evaluator_writes_captioned_grids_and_a_before_after_image(policy, tmp_path):
    ev = Evaluator(TRAIN, HELDOUT, SamplingConfig(num_steps=3), rewards.build_reward("color"), seeds_per_prompt=3,
                   run_path=str(tmp_path))
    first = ev(policy, updates=0)
    assert set(first) == {"eval_reward", "eval_reward_heldout_prompts"}
    assert (tmp_path / "eval" / "step_000000.png").is_file() and not (tmp_path / "before_after.png").exists()
    with torch.no_grad():  # "train": move the policy so that after differs from before
        for p in policy.transformer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ev(policy, updates=7)
    grid = Image.open(tmp_path / "eval" / "step_000007.png")
    pair = Image.open(tmp_path / "before_after.png")
    # 6 rows (3 training + 3 held-out prompts) of 3 images at 2x; captions make each cell taller than the image
    cell = 32 * 2
    assert grid.height > 6 * cell + 6 * 12 and grid.width > 3 * cell + 100  # a prompt label column on the left
    assert pair.height < grid.height and pair.width > 2 * 3 * cell + 100  # training prompts only, two panels
    label_column = torch.from_numpy(np.array(grid.convert("RGB").crop((0, 30, 90, grid.height)))).reshape(-1, 3).int()
    assert int((label_column.sum(dim=1) < 200).sum()) > 50  # dark text pixels: the prompts are written there


def test_a_non_writer_rank_computes_but_writes_nothing(policy, tmp_path):
    ev = Evaluator(TRAIN[:1], None, SamplingConfig(num_steps=2), rewards.build_reward("color"), 1, str(tmp_path),
                   writer=False)
    assert set(ev(policy, 0)) == {"eval_reward"} and not os.listdir(tmp_path)


def test_reward_curve_points_and_legend(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s} for s in range(4)]
    rows[0].update(eval_reward_initial=0.0, eval_reward_heldout_prompts_initial=-0.1)
    rows[1].update(eval_reward=0.3, eval_reward_heldout_prompts=0.05)
    rows[3].update(eval_reward=0.6)
    assert rundir.eval_points(rows, "eval_reward") == ([0, 2, 4], [0.0, 0.3, 0.6])  # x = updates applied
    legend = rundir.plot_reward_curves({"": rows}, str(tmp_path / "curve.png"), eval_too=True)
    assert legend == ["train reward (mean of the step's samples)", "eval: training prompts, held-out seeds",
                      "eval: held-out prompts"]
    named = rundir.plot_reward_curves({"sync": rows, "tcss": rows}, str(tmp_path / "two.png"), eval_too=True)
    assert named[0] == "sync: train reward (mean of the step's samples)" and len(named) == 6
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_the_reward_curve_is_drawn_again_only_when_a_row_was_logged(tmp_path, monkeypatch):
    """A checkpoint draws the curve and the end of the run drew the same one again (~0.45 s of CPU each): it is
    redrawn only after a new row, and a resumed run's first drawing happens (a new RunDir has drawn nothing)."""
    drawn = []
    monkeypatch.setattr(rundir, "plot_reward_curves", lambda runs, path, **kw: drawn.append(len(runs[""])))
    run = rundir.RunDir(str(tmp_path / "run"), "{}")
    run.plot_rewards()  # no rows yet: nothing to draw
    run.log(0, {"reward_mean": 0.1})
    run.plot_rewards()
    run.plot_rewards()
    run.log(1, {"reward_mean": 0.2})
    run.plot_rewards()
    run.close()
    again = rundir.RunDir(str(tmp_path / "run"), "{}")
    again.plot_rewards()
    assert drawn == [1, 2, 2]


def test_evaluation_settings_apart_from_training(policy, monkeypatch):
    """Catches --eval-guidance ignored or leaking into training (issue 24): the evaluator sets it on the policy
    only while it samples, and --eval-num-steps reaches the evaluation's sampler while training keeps --num-steps."""
    import types

    import config
    import cli
    from infra.bookkeeping import Bookkeeping

    seen = []
    velocity = policy.velocity
    monkeypatch.setattr(policy, "velocity", lambda *a, **k: (seen.append(policy.guidance), velocity(*a, **k))[1])
    training = policy.guidance
    Evaluator(TRAIN[:1], None, SamplingConfig(num_steps=2), rewards.build_reward("color"), 1, None,
              guidance=training + 2.5)(policy, 0)
    assert seen == [training + 2.5] * 2 and policy.guidance == training
    seen.clear()
    Evaluator(TRAIN[:1], None, SamplingConfig(num_steps=2), rewards.build_reward("color"), 1, None)(policy, 0)
    assert seen == [training] * 2

    cfg = config.Config(eval_num_steps=5, eval_guidance=1.5)
    source = types.SimpleNamespace(train=TRAIN, eval=HELDOUT, train_metadata=[{}] * 3, eval_metadata=[{}] * 3)
    books = Bookkeeping(cfg, range(1), None, policy, source, SamplingConfig(num_steps=3), None, ["total"], None,
                        None, leader=False)
    assert books.evaluator.sampling.num_steps == 5 and books.evaluator.guidance == 1.5
    for bad, match in ((["--eval-num-steps", "0"], "--eval-num-steps 0 must be >= 1"),
                       (["--eval-guidance", "-1"], "--eval-guidance -1.0 must be >= 0")):
        with pytest.raises(ValueError, match=match):
            cli.prepare(bad)
