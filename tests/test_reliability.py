"""Reliability: clear errors for bad custom rewards, NaN rewards skip the step (and too many in a row
abort the run), and a SIGKILL at a random moment followed by --resume reproduces the uninterrupted run.

Run: python -m pytest -q tests/test_reliability.py --timeout 900
The kill moment is random; a failure names its seed, and DIGENRL_KILL_SEED=<seed> replays it.
The end-to-end runs use the default DigenRL mode on 2 gloo ranks (1 rollout, 1 trainer).
"""
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import main
import rewards
from fragment import fragment_spec
from infra import rundir as runio
from conftest import ROOT, checkpoint_weights, rank_pids, read_metrics, run_forked

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- custom reward specs (unit)

REWARD_FILE = '''
import torch

def brightness(images, prompts):  # [B, 3, H, W] or [B, F, 3, H, W] -> [B]
    return images.reshape(images.shape[0], -1).mean(dim=1)

def as_list(images, prompts):
    return [0.5] * images.shape[0]

def wrong_shape(images, prompts):
    return torch.zeros(images.shape[0], 2)

def one_arg(images):
    return images

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_custom_spec_parses_without_importing(tmp_path):
    # parse_reward_spec checks the syntax only; the file need not exist yet.
    missing = str(tmp_path / "later.py")
    assert rewards.parse_reward_spec(f"{missing}:aesthetic=0.5,color=1") == {f"{missing}:aesthetic": 0.5, "color": 1.0}
    assert rewards.parse_reward_spec("pkg.mod:fn") == {"pkg.mod:fn": 1.0}


@pytest.mark.parametrize("name", ["my.py:", ":fn", "my.py:1fn", "my.py:a-b"])
def test_custom_spec_bad_syntax(name):
    with pytest.raises(ValueError, match="bad custom reward") as caught:
        rewards.parse_reward_spec(name)
    assert name in str(caught.value) and "package.module:function" in str(caught.value)


@pytest.mark.parametrize("function,message", [
    ("missing", r"has no attribute 'missing'; functions defined there: \['as_list', 'brightness', 'one_arg', "),
    ("NOT_A_FUNCTION", "is not callable"),
    ("one_arg", r"one_arg\(images\) cannot be called as fn\(images, prompts\)"),
])
def test_custom_reward_bad_attribute(reward_file, function, message):
    with pytest.raises(ValueError, match=message) as caught:
        rewards.check_reward_options(f"{reward_file}:{function}", rewards.RewardOptions())
    assert reward_file in str(caught.value)


def test_custom_reward_missing_or_broken_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(ValueError, match="does not exist") as caught:
        rewards.check_reward_options(f"{missing}:fn", rewards.RewardOptions())
    assert missing in str(caught.value)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ValueError, match="importing .*broken.py.* failed: RuntimeError: no GPU here"):
        rewards.check_reward_options(f"{broken}:fn", rewards.RewardOptions())
    with pytest.raises(ValueError, match="no module 'no_such_package.rewards'"):
        rewards.check_reward_options("no_such_package.rewards:fn", rewards.RewardOptions())


def test_custom_reward_from_file_and_module(reward_file, tmp_path, monkeypatch):
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    combined = rewards.build_reward(f"{reward_file}:brightness=2,color=1")
    scores = combined(images, ["a red image", "a blue image"])
    torch.testing.assert_close(scores["my_rewards_brightness"], images.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(scores["total"], 2 * images.mean(dim=(1, 2, 3)) + scores["color"])
    # Videos are passed as they are; lists are accepted and made float32 [B].
    video = torch.rand(2, 4, 3, 8, 8)
    torch.testing.assert_close(rewards.make_reward(f"{reward_file}:brightness")(video, ["", ""]),
                               video.mean(dim=(1, 2, 3, 4)))
    assert rewards.make_reward(f"{reward_file}:as_list")(images, ["", ""]).tolist() == [0.5, 0.5]
    # The package.module form goes through sys.path.
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module_fn = rewards.make_reward("my_rewards:brightness")
        torch.testing.assert_close(module_fn(images, ["", ""]), images.mean(dim=(1, 2, 3)))
    finally:
        sys.modules.pop("my_rewards", None)  # the next test's my_rewards.py is another file


def test_custom_reward_keeps_shape_checks_and_passes_nan(reward_file, tmp_path):
    with pytest.raises(RuntimeError, match=r"returned shape \(2, 2\), expected \(2,\)"):
        rewards.make_reward(f"{reward_file}:wrong_shape")(torch.rand(2, 3, 8, 8), ["", ""])
    with pytest.raises(ValueError, match="2 prompts for a batch of 1"):
        rewards.make_reward(f"{reward_file}:brightness")(torch.rand(1, 3, 8, 8), ["", ""])
    # NaN is not an error and not zeroed here: the trainer skips the step (tests below).
    nan_file = tmp_path / "nan_reward.py"
    nan_file.write_text("import torch\ndef score(images, prompts):\n    return torch.tensor([1.0, float('nan')])\n")
    assert rewards.make_reward(f"{nan_file}:score")(torch.rand(2, 3, 8, 8), ["", ""]).isnan().tolist() == [False, True]


def test_nan_reward_reaches_the_loss_so_the_trainer_sees_it():
    # A NaN poisons its whole group's advantages (mean and std) and nothing else; the clamp keeps NaN,
    # so the loss is NaN and Trainer.step skips the update instead of training on the other groups alone.
    import grpo
    advantages = grpo.group_advantages(torch.tensor([0.1, float("nan"), 0.3, 0.1, 0.2, 0.3]), group_size=3)
    assert advantages[:3].isnan().all() and advantages[3:].isfinite().all()
    loss, _ = grpo.policy_loss(torch.zeros(6), torch.zeros(6), advantages, 0.01, torch.full((6,), 1 / 6))
    assert loss.isnan()


@pytest.mark.parametrize("spec,message", [("{dir}/nope.py:f", "nope.py"), ("{dir}/my_rewards.py:nope", "'nope'"),
                                          ("{dir}/my_rewards.py:", "bad custom reward")])
def test_cli_refuses_bad_custom_reward_before_spawning(spec, message, reward_file, monkeypatch, capsys):
    spawned = []
    monkeypatch.setattr(main, "launch", lambda cfg: spawned.append(cfg) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a))
    spec = spec.format(dir=os.path.dirname(reward_file))
    assert main.main(["--reward", f"{spec}=0.5,color=1"]) == 2
    assert message in capsys.readouterr().err and not spawned


# ---------------------------------------------------------------- end-to-end runs (2 ranks, DigenRL)

# The reward is NaN for the prompt "poison" and the mean pixel otherwise; the seed is chosen so that
# only step POISONED_STEP draws it, which makes the bad step deterministic in every mode and on resume.
POISON_FILE = '''
import torch

def score(images, prompts):
    value = images.reshape(images.shape[0], -1).mean(dim=1)
    poisoned = torch.tensor(["poison" in p for p in prompts])
    return torch.where(poisoned, torch.full_like(value, float("nan")), value)

def always_nan(images, prompts):
    return torch.full((images.shape[0],), float("nan"))
'''
PROMPTS = ["a red image", "a green image", "a blue image", "poison"]
STEPS, POISONED_STEP, PROMPTS_PER_STEP = 6, 2, 2


def poisoning_seed() -> int:
    """The first seed whose prompt order puts the poison prompt in step POISONED_STEP and no other."""
    poison = PROMPTS.index("poison")
    for seed in range(10_000):
        hit = [poison in fragment_spec(seed, step, 0, PROMPTS_PER_STEP, len(PROMPTS), PROMPTS_PER_STEP, 3).prompt_ids
               for step in range(STEPS)]
        if hit == [step == POISONED_STEP for step in range(STEPS)]:
            return seed
    raise AssertionError("no seed poisons exactly one step")


TINY = ["--nproc", "2", "--steps", str(STEPS), "--prompts-per-step", str(PROMPTS_PER_STEP), "--group-size", "3",
        "--num-steps", "3", "--eval-every", "0", "--save-every", "1", "--keep-checkpoints", str(STEPS),
        "--timeout-s", "60", "--no-trace",  # --no-trace: the timeline PNG costs seconds and is not tested here
        "--updates-per-batch", "1"]  # one update per step: the poisoned step is skipped whole, bit for bit


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_cache):
    folder = tmp_path_factory.mktemp("reliability")
    (folder / "poison.py").write_text(POISON_FILE)
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    args = [*TINY, "--prompt-file", str(folder / "prompts.txt"), "--seed", str(poisoning_seed())]
    return {"folder": folder, "args": args, "cache": tiny_cache,
            "score": ["--reward", f"{folder / 'poison.py'}:score"],
            "always_nan": ["--reward", f"{folder / 'poison.py'}:always_nan"]}


def test_nan_reward_skips_the_step_and_training_continues(setup):
    folder = setup["folder"]
    run_forked(["--mode", "digenrl", *setup["args"], *setup["score"]], folder, "poisoned", setup["cache"])
    run = folder / "poisoned"
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["skipped_step"] for r in rows] == [float(s == POISONED_STEP) for s in range(STEPS)]
    assert [r["bad_steps_in_a_row"] for r in rows] == [float(s == POISONED_STEP) for s in range(STEPS)]
    bad = rows[POISONED_STEP]
    assert all(v != v for v in (bad["reward_mean"], bad["loss"], bad["grad_norm"])), bad  # NaN, reported as such
    # Checkpoint k holds the weights after k steps: the skipped step left every weight (bit for bit) as it was,
    # while the steps before and after it changed them.
    weights = {k: checkpoint_weights(run, k) for k in range(POISONED_STEP, POISONED_STEP + 3)}
    before, after = weights[POISONED_STEP], weights[POISONED_STEP + 1]
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "the skipped step changed the weights"
    assert any(not torch.equal(after[k], v) for k, v in weights[POISONED_STEP + 2].items()), "no training after the skip"
    assert any(not torch.equal(before[k], v) for k, v in checkpoint_weights(run, POISONED_STEP - 1).items())
    # The step's optimizer state was not touched either (AdamW's step count did not advance).
    states = [runio.load_state(str(run / "checkpoints" / f"step_{k:06d}"))["optimizer"]["state"]
              for k in (POISONED_STEP, POISONED_STEP + 1)]
    assert [s["step"] for s in states[0].values()] == [s["step"] for s in states[1].values()]


@pytest.mark.timeout(120)
def test_always_nan_reward_aborts_after_max_bad_steps(setup, capsys):
    """The job is main.py's ranks under infra.launch.launch in this process (stall_matrix.run_job, what
    conftest.run_forked runs): the abort and the launcher's message are what it checks; main.py's own exit status
    for a failed rank is tests/test_liveness.py's (a real launch)."""
    import stall_matrix

    folder = setup["folder"]
    job = stall_matrix.run_job(["--mode", "digenrl", *setup["args"], *setup["always_nan"], "--max-bad-steps", "2"],
                               folder, "always_nan", setup["cache"], bound_s=600)
    launcher = capsys.readouterr().err
    assert job.code == 1 and not job.killed_by_test, f"{job.code}\n{launcher[-2000:]}\n{job.log[-2000:]}"
    # The launcher names the failing rank (rank 1 is the trainer with one rollout rank) and the limit.
    assert re.search(r"rank 1 \(trainer\) failed: FloatingPointError: 2 optimizer steps in a row .*--max-bad-steps 2",
                     launcher), launcher[-2000:]
    rows = read_metrics(folder / "always_nan")
    assert len(rows) < STEPS and all(r["skipped_step"] == 1 for r in rows)


def _wait_dead(pid: int, timeout_s: float = 10.0) -> None:
    """Until `pid` is gone or a zombie (a SIGKILLed orphan may wait for its reaper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still alive {timeout_s}s after SIGKILL")


def _start(args, name, folder, cache) -> subprocess.Popen:
    """main.py as run_main starts it, but in the background (output in <folder>/<name>.log)."""
    env = dict(os.environ, DIGENRL_CACHE=cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.join(ROOT, "main.py"), *args, "--run-name", name, "--out-dir", str(folder),
           "--no-progress", "--threads", "1"]
    with open(folder / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_sigkill_at_a_random_moment_then_resume_matches_the_uninterrupted_run(setup):
    folder, cache = setup["folder"], setup["cache"]
    # DigenRL minus TAG and TCSS: which fragment the trainer generates itself (TAG) and which are one version
    # stale (TCSS) depend on timing, and so does the order gradients add up in; the loss (a sum that nearly
    # cancels) then differs beyond test_cli's 1e-5 between two uninterrupted runs already. GAP + TSP streams
    # fragments in a fixed order, so a run is a function of its seed and a resumed run must reproduce it.
    # The poison reward stays: a resumed run must also skip the same step.
    args = ["--placement", "disaggregated", "--gap", "--tsp", *setup["args"], *setup["score"]]
    # A fixed seed (not the clock): a failure can be rerun with the same kill moment, and every run of the suite
    # tests the same fraction of a step; DIGENRL_KILL_SEED=k tries others.
    seed = int(os.environ.get("DIGENRL_KILL_SEED", "0"))
    rng = random.Random(seed)
    run = folder / "killed"
    launcher = _start(args, "killed", folder, cache)
    try:
        # Wait for a checkpoint and a step time (row 1; row 0 includes the start-up), then a random
        # fraction of a step, so the kill lands anywhere in a step: generation, training, checkpointing.
        deadline = time.monotonic() + 120
        while not (runio.list_checkpoints(str(run)) and (run / "metrics.jsonl").exists()
                   and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert launcher.poll() is None, (folder / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run made no checkpoint in 120 s"
            time.sleep(0.01)
        step_time = read_metrics(run)[1]["step_time_s"]
        delay = rng.random() * step_time
        time.sleep(delay)
        assert launcher.poll() is None, f"the run ended before the kill (seed {seed}, delay {delay:.3f}s)"
        pids = [pid for pid, _ in rank_pids(launcher.pid, 2).values()]
        launcher.kill()  # first, so that it cannot react to its ranks dying
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        launcher.wait(10)
        for pid in pids:
            _wait_dead(pid)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    run_forked(args, folder, "uninterrupted", cache)  # the reference: what the job computes, no kill
    where = (f"kill seed {seed} (DIGENRL_KILL_SEED), delay {delay:.3f}s of a {step_time:.3f}s step, "
             f"checkpoints at the kill {sorted(os.listdir(run / 'checkpoints'))}")

    run_forked([*args, "--resume", str(run)], folder, "resumed", cache)  # what it computes: the launcher's is above

    rows, expected = read_metrics(run), read_metrics(folder / "uninterrupted")
    assert [r["step"] for r in rows] == list(range(STEPS)), where
    # Same tolerance as tests/test_cli.py's resume test; NaN (the poisoned step) must be NaN in both.
    for row, ref in zip(rows, expected):
        for key in ("reward_mean", "loss", "grad_norm", "skipped_step"):
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-9, nan_ok=True), f"step {row['step']} {key}; {where}"
    # Checkpoints are all complete (atomic: no .partial left, every one loads and is the step it says).
    names = sorted(os.listdir(run / "checkpoints"))
    assert names and all(re.fullmatch(r"step_\d{6}", n) for n in names), f"{names}; {where}"
    assert [os.path.basename(p) for p in runio.list_checkpoints(str(run))] == names, where
    for name in names:
        state = runio.load_state(str(run / "checkpoints" / name))
        assert state["step"] == int(name[len("step_"):]), where
    final, uninterrupted = checkpoint_weights(run, STEPS), checkpoint_weights(folder / "uninterrupted", STEPS)
    for key in uninterrupted:
        torch.testing.assert_close(final[key], uninterrupted[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{m}\n{where}")
