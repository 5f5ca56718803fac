"""Bad input fails before any rank starts; resume continues exactly; a dead rank ends the whole job."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import main
import cli
from conftest import ROOT, checkpoint_weights, read_metrics, run_forked, run_main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def bad_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    partial = tmp_path / "partial_pipeline"
    partial.mkdir()
    (partial / "model_index.json").write_text('{"_class_name": "FluxPipeline", "transformer": ["diffusers", "X"]}')
    not_a_run = tmp_path / "not_a_run"
    not_a_run.mkdir()
    few = tmp_path / "few.txt"  # under 10 prompts: no held-out split
    few.write_text("a red image\na blue image\n")
    return {"empty": str(empty), "binary": str(binary), "partial": str(partial), "not_a_run": str(not_a_run),
            "few": str(few)}


BAD = [
    (["--model", "sdxl"], "unknown --model 'sdxl'; known models: flux"),
    (["--reward", "colour"], "colour"),
    (["--reward", "color=abc"], "abc"),
    (["--reward", ""], "reward"),
    (["--reward", "clip_score"], "--clip-path"),
    (["--reward", "remote", "--remote-url", "ftp://x"], "ftp://x"),
    (["--pretrained", "/nonexistent/flux"], "/nonexistent/flux"),
    (["--pretrained", "{partial}"], "missing the component"),
    (["--prompts-per-step", "3", "--fragment-groups", "2"], "--fragment-groups 2 must divide --prompts-per-step 3"),
    (["--group-size", "0"], "--group-size must be a positive integer, got 0"),
    (["--group-size", "1"], "--group-size must be >= 2"),
    (["--steps", "-1"], "--steps must be a positive integer"),
    (["--num-steps", "1"], "--num-steps must be >= 2"),
    (["--prompt-file", "/nonexistent/prompts.txt"], "/nonexistent/prompts.txt"),
    (["--prompt-file", "{empty}"], "has no prompts"),
    (["--prompt-file", "{binary}"], "cannot be read"),
    (["--placement", "disaggregated", "--rollout-ranks", "2", "--nproc", "2"], "--rollout-ranks 2 must be between 1 and 1"),
    (["--placement", "disaggregated", "--rollout-ranks", "0", "--nproc", "3"], "--rollout-ranks 0"),
    (["--mode", "naive", "--nproc", "1"], "at least 2 ranks"),
    (["--placement", "disaggregated", "--gap", "--fsdp"], "--fsdp needs --tsp"),
    (["--fsdp", "--nproc", "3", "--fragment-groups", "1"], "--fsdp with --tag needs --fragment-groups >= the 2 trainer"),
    (["--placement", "colocated", "--gap"], "need --placement disaggregated"),
    (["--placement", "disaggregated", "--tag"], "--tag needs --gap and --tsp"),
    (["--placement", "disaggregated", "--gap", "--tag"], "--tag needs --gap and --tsp"),
    (["--mode", "warp"], "--mode 'warp' is not one of"),
    (["--mode", "colocated", "--tsp"], "need --placement disaggregated"),
    (["--timestep-fraction", "1.5"], "--timestep-fraction must be in (0, 1]"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be a positive number"),
    (["--noise-level", "0"], "--noise-level must be > 0"),
    (["--resolution", "40"], "--resolution must be a multiple of 16"),
    (["--algo", "ppo"], "--algo 'ppo'"),
    (["--resume", "/nonexistent/run"], "--resume '/nonexistent/run' is not a directory"),
    (["--resume", "{not_a_run}"], "has no complete checkpoint"),
    (["--device", "tpu"], "--device 'tpu'"),
    # issue 39: batch sizes that cannot divide the work, Flow-GRPO's step's choices
    (["--sample-batch-size", "3"], "--sample-batch-size 3 does not divide a fragment's 8 trajectories "
                                   "(--fragment-groups 1 x --group-size 8)"),
    (["--sample-batch-size", "-1"], "--sample-batch-size must be >= 0"),
    (["--eval-batch-size", "-2"], "--eval-batch-size must be >= 0"),
    (["--kl-scale", "exact"], "--kl-scale 'exact' is not one of diffusion, step"),
    (["--minibatches", "random"], "--minibatches 'random' is not one of samples, groups"),
    (["--drop-zero-advantage"], "--drop-zero-advantage keeps the samples of nonzero batch advantage"),
    (["--seed", "-1"], "--seed must be an integer in [0, 4194303]"),
    (["--prompt-file", "{few}", "--eval-split", "test"], "--eval-split test, but the prompts (text file) have no "
                                                         "held-out split"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_input_is_refused_before_any_rank_starts(args, message, bad_files, monkeypatch, tiny_cache):
    args = [a.format(**bad_files) for a in args]
    spawned = []
    monkeypatch.setattr(main, "launch", lambda cfg: spawned.append(cfg) or 0)
    monkeypatch.setattr(main, "run_rank", lambda *a, **k: spawned.append(a))
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        cli.prepare(args)
    assert message in str(info.value)
    assert main.main(args) == 2
    assert not spawned


def test_unknown_flag_and_help_exit_cleanly():
    proc = subprocess.run([sys.executable, "main.py", "--model", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "known models" in proc.stderr


RESUMABLE = ["--mode", "colocated", "--nproc", "1", "--prompts-per-step", "2", "--group-size", "3", "--num-steps", "3",
             "--eval-every", "0", "--save-every", "1", "--seed", "5"]


@pytest.fixture(scope="module")
def straight_run(tiny_cache, tmp_path_factory):
    """Three steps of RESUMABLE in one go, a checkpoint after each: the resume test's reference, and the
    checkpoint the refusal test resumes with another config (one run for both: each is a whole job)."""
    out = tmp_path_factory.mktemp("straight")
    run_forked([*RESUMABLE, "--steps", "3"], out, "straight", tiny_cache)
    return out / "straight"


def test_resume_continues_with_the_same_metrics(straight_run, tiny_cache, tmp_path):
    run_forked([*RESUMABLE, "--steps", "2"], tmp_path, "stopped", tiny_cache)
    run_main([*RESUMABLE, "--steps", "3", "--resume", str(tmp_path / "stopped")], tmp_path, tiny_cache)
    straight, resumed = read_metrics(straight_run), read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [0, 1, 2]
    for key in ("reward_mean", "loss", "grad_norm"):
        assert resumed[2][key] == pytest.approx(straight[2][key], rel=1e-5, abs=1e-9), key
    assert resumed[2]["version"] == straight[2]["version"] == 3  # the trainer resumed at the checkpoint's version
    # the last step's update depends on the AdamW moments of the steps before the stop: restored, it is the same
    final, want = checkpoint_weights(tmp_path / "stopped", 3), checkpoint_weights(straight_run, 3)
    for key in want:
        torch.testing.assert_close(final[key], want[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_resume_refuses_a_checkpoint_of_another_config(straight_run):
    with pytest.raises(ValueError, match="different model or LoRA config: lora: checkpoint False vs now True"):
        cli.prepare([*RESUMABLE, "--steps", "3", "--lora", "--resume", str(straight_run)])


@pytest.mark.parametrize("victim", ["rollout", "trainer"])
def test_killing_a_rank_ends_the_job_with_a_message_naming_it(victim, tiny_cache, tmp_path, capfd):
    """A rank SIGKILLed in the loop (a rollout rank with a peer of its role left, or the only trainer): the job ends
    within 30 s and the launcher names the rank and its role. The launcher (infra/launch.py) runs in this process
    (stall_matrix.run_job, the ranks forked from this worker's forkserver); main.py's own non-zero exit on a
    failed rank is test_liveness's self-launched frozen-rank job."""
    import threading

    import stall_matrix

    rank = {"rollout": 0, "trainer": 2}[victim]  # --rollout-ranks 2: ranks 0 and 1 roll out, rank 2 trains
    killed = {}

    def kill_once_going() -> None:
        metrics, pid_file = tmp_path / "job" / "metrics.jsonl", tmp_path / "job.pids" / str(rank)
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2 and pid_file.exists()):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed["at"] = time.monotonic()

    killer = threading.Thread(target=kill_once_going, daemon=True)
    killer.start()
    job = stall_matrix.run_job(["--mode", "digenrl", "--nproc", "3", "--rollout-ranks", "2", "--steps", "500",
                                "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--eval-every",
                                "0", "--save-every", "0", "--timeout-s", "30"], tmp_path, "job", tiny_cache,
                               bound_s=300)
    ended = time.monotonic()
    killer.join(1)
    assert "at" in killed, f"the job never got going:\n{job.log[-3000:]}"
    assert job.code != 0 and not job.killed_by_test and ended - killed["at"] < 30, (job, job.log[-3000:])
    # the launcher reaps the rank and names the signal; on a loaded machine a peer's watchdog may see the process
    # gone first and end the job itself (infra/liveness.py): either report names the rank and its role
    err = capfd.readouterr().err
    assert re.search(rf"rank {rank} \({victim}\) (was killed by signal 9|died: its process is gone)", err), err


def test_a_config_saved_before_the_tcss_rename_still_loads(tmp_path):
    """use_async was renamed use_tcss: a config.json written before the rename keeps its TCSS setting."""
    import json

    import config
    from infra.saved_config import read_saved

    old = tmp_path / "config.json"
    old.write_text(json.dumps({"model": "flux", "use_async": False, "steps": 7}))
    assert read_saved(str(old), config.Config)["use_tcss"] is False
    assert config.from_dict({"use_async": True}).use_tcss is True
    assert config.from_dict({"use_async": True, "use_tcss": False}).use_tcss is False  # the new name wins


def test_a_run_saved_before_flow_grpos_training_step_resumes_with_its_own(tmp_path):
    """Catches a resume (or --config copy) of a run saved before issue 39 switching to today's training step: its
    KL scale, ratio reference, minibatches and evaluation stay what they were; a hand-written partial file (no
    `trace`: not a saved run) gets today's defaults."""
    import json

    import config
    from infra.saved_config import read_saved

    old = tmp_path / "config.json"
    old.write_text(json.dumps({"model": "sd3", "beta": 0.04, "trace": True, "steps": 7}))
    saved = read_saved(str(old), config.Config)
    assert (saved["kl_scale"], saved["old_log_prob"], saved["minibatches"], saved["detach_uncond"],
            saved["eval_split"]) == ("step", "fresh", "groups", False, "train+test")
    partial = tmp_path / "recipe.json"
    partial.write_text(json.dumps({"model": "sd3", "beta": 0.04}))
    assert "kl_scale" not in read_saved(str(partial), config.Config)
