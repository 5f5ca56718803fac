"""LoRA as Flow-GRPO users have it, and reusing a run's configuration.

- `--lora-targets all-linear` adapts exactly the linear layers of the blocks (it used to name `0` / `2`, whole
  blocks) and trains one RL step on every family; the saved diffusers LoRA file carries alpha as metadata and
  `pipe.load_lora_weights` reproduces the trained velocity (a file without alpha would not);
- the family presets are Flow-GRPO's published lists; `--init-lora` starts from a LoRA file (rank and alpha read from
  it), and a file that does not fit is refused before any rank starts;
- `--resume RUN` alone continues a LoRA run from its saved config.json; `--config run.json` starts a new run from it;
  unsafe overrides on resume are refused; `--pretrained org/name` offline says how to point at a local copy.
"""
import json
import os
import re
import shutil

import pytest
import torch

import models
from conftest import checkpoint_weights, read_metrics, run_forked, run_main

pytestmark = pytest.mark.timeout(600)
FAMILIES = ["flux", "qwenimage", "wan", "hunyuanvideo", "sd3"]
PROMPTS = ["a red image", "a blue image"]


def one_rl_step(policy):
    """Generate one group of 2 and take one optimizer step (the public rollout / trainer APIs)."""
    import rewards
    import tsp
    from fragment import fragment_spec
    from rollout import SamplingConfig, generate_fragment
    from trainer import TrainConfig, Trainer

    spec = fragment_spec(0, 0, 0, 1, len(PROMPTS), 1, 2)
    reward = rewards.build_reward("color,jpeg_compressibility=0.1")  # two terms: the group's scores differ
    fragment = generate_fragment(policy, spec, PROMPTS, SamplingConfig(num_steps=2), reward, 0, 0)
    trainer = Trainer(policy, TrainConfig(lr=1e-2))
    packs = tsp.per_timestep_packs(*fragment.latents.shape[:2])
    trainer.accumulate(fragment, packs, [[1.0] * len(p) for p in packs], total_pairs=2 * len(packs))
    return trainer.step(reward.names)


@pytest.mark.parametrize("name", FAMILIES)
def test_all_linear_one_step_and_the_saved_file_reloads_with_its_alpha(name, tiny_cache, tmp_path):
    policy = models.load(name, models.tiny_pipeline_path(name), "cpu", torch.float32, max_sequence_length=16)
    block_linears = {n for n, m in policy.transformer.named_modules()
                     if isinstance(m, torch.nn.Linear) and re.search(r"blocks\.\d+\.", n)}
    torch.manual_seed(0)
    models.add_lora(policy, 8, 16.0, "all-linear")  # scale 2: a loader that ignored alpha would be off by 2x
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A." in n}
    assert adapted == block_linears and adapted  # every linear of the blocks, nothing else (no whole block)
    metrics = one_rl_step(policy)
    assert metrics["grad_norm"] > 0 and metrics["skipped_step"] == 0

    x = torch.stack([policy.noise(torch.Generator().manual_seed(s)) for s in (0, 1)])
    sigma, cond = torch.tensor([0.9, 0.5]), policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        trained = policy.velocity(x, sigma, cond)
        with policy.reference() as ref:
            assert float((policy.velocity(x, sigma, cond, transformer=ref) - trained).abs().max()) > 1e-5
    state, meta = models.lora_state_for_diffusers(policy.transformer), models.lora_metadata(policy.transformer)
    pipeline_class = policy.family.pipeline_class()
    pipeline_class.save_lora_weights(tmp_path / "with", transformer_lora_layers=state,
                                     transformer_lora_adapter_metadata=meta)
    pipeline_class.save_lora_weights(tmp_path / "without", transformer_lora_layers=state)

    fresh = models.load(name, models.tiny_pipeline_path(name), "cpu", torch.float32, max_sequence_length=16)
    fresh.pipe.load_lora_weights(tmp_path / "with")
    (config,) = fresh.transformer.peft_config.values()
    assert (config.r, config.lora_alpha) == (8, 16.0)  # read back from the file's metadata
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), trained, rtol=1e-5, atol=1e-6)
    blind = models.load(name, models.tiny_pipeline_path(name), "cpu", torch.float32, max_sequence_length=16)
    blind.pipe.load_lora_weights(tmp_path / "without")  # no alpha in the file: the loader assumes alpha = rank
    with torch.no_grad():
        assert float((blind.velocity(x, sigma, cond) - trained).abs().max()) > 1e-6


def test_presets_are_flow_grpos_published_settings(tiny_cache):
    from models import lora

    flux = lora.preset("flux")
    assert (flux.rank, flux.alpha) == (64, 128.0) and "Flow-GRPO" in flux.source
    assert {"ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "attn.to_add_out"} <= set(
        flux.targets)  # scripts/train_flux.py adapts attention AND feed-forward layers
    assert (lora.preset("wan").rank, lora.preset("wan").alpha) == (32, 64.0)
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32, max_sequence_length=16)
    models.add_lora(policy, 4, 8.0)  # the default is the flow_grpo preset
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.transformer.named_parameters() if ".lora_A." in n}
    assert "transformer_blocks.0.ff.net.2" in adapted and "transformer_blocks.0.norm1.linear" not in adapted
    with pytest.raises(ValueError, match="not an nn.Linear"):
        lora.resolve_targets(policy.transformer, policy.family, "attn.to_out")  # a ModuleList, not a layer


# ------------------------------------------------------------------ end to end: a LoRA run, --init-lora, --resume

LORA_RUN = ["--model", "flux", "--mode", "colocated", "--nproc", "1", "--lora", "--lora-targets", "all-linear",
            "--lora-rank", "8", "--lora-alpha", "16", "--prompts-per-step", "2", "--group-size", "2",
            "--num-steps", "3", "--text-len", "16", "--eval-every", "0", "--save-every", "1", "--seed", "0",
            "--timeout-s", "60", "--no-trace"]


@pytest.fixture(scope="module")
def lora_run(tiny_cache, tmp_path_factory):
    """A 2-step LoRA run (all-linear, r 8, alpha 16) with a checkpoint after each step."""
    models.tiny_pipeline_path("flux")
    out = tmp_path_factory.mktemp("lora_run")
    run_forked([*LORA_RUN, "--steps", "2"], out, "x", tiny_cache)
    return out / "x"


def test_resume_alone_continues_a_lora_run(lora_run, tiny_cache, tmp_path):
    run = tmp_path / "x"
    shutil.copytree(lora_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000002")  # as if killed after step 1's checkpoint
    run_main(["--resume", str(run)], tmp_path, tiny_cache)  # nothing else: the saved config.json says the rest
    assert [r["step"] for r in read_metrics(run)] == [0, 1]
    resumed, straight = checkpoint_weights(run, 2), checkpoint_weights(lora_run, 2)
    assert resumed.keys() == straight.keys()
    for key in resumed:  # the same LoRA config, lr, seed and data: the same second step
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-5, atol=1e-7)
    assert json.loads((run / "config.json").read_text())["lora_alpha"] == 16.0


def test_init_lora_starts_from_the_file_with_its_rank_and_alpha(lora_run, tiny_cache, tmp_path):
    start = lora_run / "checkpoints" / "step_000001"
    # lr 1e-12: Adam's first step moves each weight by ~lr, so the run's weights are the file's (if it loaded it).
    run_forked(["--model", "flux", "--mode", "colocated", "--nproc", "1", "--init-lora", str(start), "--lora-targets",
                "all-linear", "--lr", "1e-12", "--steps", "1", "--save-every", "1", "--eval-every", "0",
                "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3", "--text-len", "16", "--no-trace"],
               tmp_path, "y", tiny_cache)
    config = json.loads((tmp_path / "y" / "config.json").read_text())
    assert (config["lora"], config["lora_rank"], config["lora_alpha"]) == (True, 8, 16.0)  # from the file
    started, theirs = checkpoint_weights(tmp_path / "y", 1), checkpoint_weights(lora_run, 1)
    assert started.keys() == theirs.keys()
    assert any(theirs[k].abs().max() > 1e-4 for k in theirs if "lora_B" in k)  # not a fresh LoRA (B = 0)
    for key in started:
        torch.testing.assert_close(started[key], theirs[key], rtol=0, atol=1e-9)


def test_init_lora_that_does_not_fit_is_refused_before_spawn(lora_run, tiny_cache):
    import cli

    start = str(lora_run / "checkpoints" / "step_000001")
    # Trained on all-linear, asked the default preset: the file has more modules than the preset selects.
    with pytest.raises(ValueError, match="adapts other modules than --lora-targets flow_grpo: .* has .*proj_mlp"):
        cli.prepare(["--model", "flux", "--init-lora", start])
    with pytest.raises(ValueError, match="--lora-rank 4 differs from --init-lora .* rank 8"):
        cli.prepare(["--model", "flux", "--init-lora", start, "--lora-targets", "all-linear", "--lora-rank", "4"])
    with pytest.raises(ValueError, match="--lora-alpha 8 differs .* alpha 16 \\(metadata\\)"):
        cli.prepare(["--model", "flux", "--init-lora", start, "--lora-targets", "all-linear", "--lora-alpha", "8"])
    with pytest.raises(ValueError, match="holds neither pytorch_lora_weights.safetensors"):
        cli.prepare(["--model", "flux", "--init-lora", str(lora_run / "checkpoints")])
    with pytest.raises(ValueError, match="LoRA is off"):
        cli.prepare(["--model", "flux", "--init-lora", start, "--no-lora"])


def test_config_file_and_resume_overrides(lora_run, tiny_cache, capsys):
    import dataclasses

    import config as config_lib
    import cli

    saved = json.loads((lora_run / "config.json").read_text())
    fresh = dataclasses.asdict(cli.prepare(["--config", str(lora_run / "config.json"), "--steps", "7"]))
    differs = {k for k in saved if saved[k] != fresh[k]}
    assert differs == {"steps", "run_name", "config"} and fresh["steps"] == 7  # a new run (new name) from x's settings
    resumed = cli.prepare(["--resume", str(lora_run), "--steps", "5", "--eval-every", "2"])
    assert (resumed.steps, resumed.eval_every, resumed.lora_rank, resumed.lora_targets) == (5, 2, 8, "all-linear")
    err = capsys.readouterr().err
    assert "--steps 2 -> 5" in err and "--eval-every 0 -> 2" in err
    cli.prepare(["--resume", str(lora_run), *LORA_RUN])  # repeating the original flags changes nothing
    with pytest.raises(ValueError, match="--lr cannot change on resume .*run 0.003, asked 0.1.*--config"):
        cli.prepare(["--resume", str(lora_run), "--lr", "0.1"])
    with pytest.raises(ValueError, match="--prompts-per-step, --group-size cannot change on resume"):
        cli.prepare(["--resume", str(lora_run), "--prompts-per-step", "4", "--group-size", "4"])
    with pytest.raises(ValueError, match="different model or LoRA config: lora_targets: checkpoint 'all-linear'"):
        cli.prepare(["--resume", str(lora_run), "--lora-targets", "attention"])
    assert config_lib.parse_args(["--config", str(lora_run / "config.json")]).mode == "colocated"


HUB_SCRIPT = """
import sys, models
import cli
for repo_id in sys.argv[1:]:
    try:
        cfg = cli.prepare(["--model", "flux", "--pretrained", repo_id])
    except FileNotFoundError as error:
        print("REFUSED", error)
    else:
        print("LOADED", type(models.load("flux", cfg.pretrained, max_sequence_length=16).transformer).__name__)
"""


def test_pretrained_hub_id_from_the_cache_or_a_clear_refusal(tiny_cache, tmp_path):
    """--pretrained org/name offline, in a fresh process (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it
    is imported): an id whose snapshot is in the cache loads (what from_pretrained(id) finds); one that is not is
    refused, saying how to point at a local copy."""
    import subprocess
    import sys

    import cli
    from conftest import ROOT
    repo = tmp_path / "hf" / "hub" / "models--digenrl-test--tiny-flux"
    commit = "0" * 40
    shutil.copytree(models.tiny_pipeline_path("flux"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", DIGENRL_CACHE=tiny_cache,
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, "digenrl-test/tiny-flux", "digenrl-test/no-such-model"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded, refused = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "LOADED FluxTransformer2DModel"
    assert refused.startswith("REFUSED --pretrained 'digenrl-test/no-such-model' is not a local directory")
    assert "could not be fetched" in refused and "--local-dir DIR" in refused and "--pretrained DIR" in refused
    missing = tmp_path / "models" / "FLUX.1-dev"  # an absolute path that does not exist (not the README's example
    with pytest.raises(FileNotFoundError, match="does not exist"):  # path, which is real on GPU machines): a path,
        cli.prepare(["--model", "flux", "--pretrained", str(missing)])  # not an id: the old message
