"""The offline pre-training of the tiny pipelines (models/pretrain.py) and the demo it enables.

The default tiny FLUX pipeline (what `python main.py --model flux` uses) ships pre-trained in models/demo/ (its
build takes ~200 s on a core: tools/build_demo_pipeline.py); the tests check it is what the current files build,
that its samples are structured images whose colour varies with the seed but not with the colour word, and that a
short RL run on it starts following the colour word. The pre-training's code runs here in short seeded builds.
"""
import os

import pytest
import torch
from safetensors.torch import load_file

import models
import rewards
from models import pretrain
from conftest import read_metrics, run_forked
from rollout import SamplingConfig, evaluate

pytestmark = pytest.mark.timeout(600)

PROMPTS = rewards.color_prompts("train")


# --- the pieces, by hand ----------------------------------------------------------------------------
def test_latent_target_is_the_block_average_of_the_colours():
    image = torch.zeros(1, 3, 8, 8)
    image[0, 0, :4, :4] = 1.0  # a red top-left quarter on black
    target = pretrain.latent_target(image, channels=4, spatial=4)  # [1, 4, 2, 2]
    expected = -torch.ones(1, 4, 2, 2)
    expected[0, 0, 0, 0] = 1.0  # red channel of the red block: 2 * 1 - 1
    expected[0, 3] = 0.0  # the unused channel
    torch.testing.assert_close(target, expected)
    # subgrid 2: each latent pixel carries its 2 x 2 sub-blocks (pixel_unshuffle order: channel-major)
    fine = pretrain.latent_target(image, channels=12, spatial=4, subgrid=2)  # [1, 12, 2, 2]
    assert fine.shape == (1, 12, 2, 2) and bool((fine[0, :4, 0, 0] == 1).all()) and bool((fine[0, 4:, 0, 0] == -1).all())
    # videos: latent frame k is frame 4k (the causal VAEs' frame 0, then one per 4 frames)
    video = torch.stack([torch.full((3, 8, 8), f / 4) for f in range(5)])[None]  # [1, 5, 3, 8, 8]
    vt = pretrain.latent_target(video, channels=4, spatial=4)  # [1, 4, 2, 2, 2]
    assert vt.shape == (1, 4, 2, 2, 2)
    torch.testing.assert_close(vt[0, :3, 0], torch.full((3, 2, 2), -1.0))
    torch.testing.assert_close(vt[0, :3, 1], torch.full((3, 2, 2), 1.0))
    with pytest.raises(ValueError, match="needs 12 of the 4 latent channels"):
        pretrain.latent_target(image, channels=4, spatial=4, subgrid=2)


def test_synthetic_images_are_seeded_discs_of_two_palette_colours():
    a = pretrain.synthetic_images(16, torch.Generator().manual_seed(3), 32)
    b = pretrain.synthetic_images(16, torch.Generator().manual_seed(3), 32)
    assert a.shape == (16, 3, 32, 32) and torch.equal(a, b)
    for image in a:
        corners = image[:, [0, 0, -1, -1], [0, -1, 0, -1]].T  # background pixels
        assert any(torch.equal(c, p) for c in corners[:1] for p in pretrain.PALETTE)
        assert int((image != corners[0][:, None, None]).any(dim=0).sum()) > 20  # a disc of another colour
    video = pretrain.synthetic_images(4, torch.Generator().manual_seed(0), 32, frames=5)
    assert video.shape == (4, 5, 3, 32, 32) and not torch.equal(video[:, 0], video[:, -1])  # the disc moves


def test_decode_unclamped_is_decode_before_its_clamp():
    """Wan's VAE clamps its output; pre-training must see the values before the clamp, and only the clamp differs."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4, dim_mult=[1, 1, 1],
                           num_res_blocks=1, temperal_downsample=[True, True], scale_factor_spatial=4)
    z = torch.randn(2, 4, 2, 4, 4) * 30  # large latents drive the output past [-1, 1]
    with torch.no_grad():
        raw = pretrain.decode_unclamped(vae, z)  # [2, 3, 5, 16, 16]
        clamped = vae.decode(z).sample
    assert raw.shape == clamped.shape == (2, 3, 5, 16, 16)
    assert float(raw.abs().max()) > 1  # the clamp would have cut these
    torch.testing.assert_close(raw.clamp(-1, 1), clamped)


def test_pretraining_is_seeded_and_reaches_every_component(tmp_path):
    """Two builds with the same seed are identical file for file; the VAE and the transformer moved."""
    cfg = pretrain.PretrainConfig(vae_steps=3, flow_steps=3, log=False)
    family = models.get_family("flux")
    for name, config in (("a", cfg), ("b", cfg), ("random", False)):
        family.build_tiny(str(tmp_path / name), seed=0, pretrain_config=config)
    for component in ("transformer", "vae"):
        files = [f for f in os.listdir(tmp_path / "a" / component) if f.endswith(".safetensors")]
        weights = {run: load_file(str(tmp_path / run / component / files[0])) for run in ("a", "b", "random")}
        assert weights["a"].keys() == weights["b"].keys()
        assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"]), component
        assert any(not torch.equal(weights["a"][k], weights["random"][k]) for k in weights["a"]), component


def test_variant_from_the_environment(monkeypatch):
    family = models.get_family("wan")
    monkeypatch.setenv("DIGENRL_TINY_PRETRAIN", "quick")
    assert pretrain.variant_from_env() == "quick"
    quick = pretrain.variant_config(family, "quick")
    assert quick.vae_steps < 50 and quick.vae_batch == family.pretrain_overrides["vae_batch"]
    assert pretrain.variant_config(family, "none") is False
    monkeypatch.setenv("DIGENRL_TINY_PRETRAIN", "fast")
    with pytest.raises(ValueError, match="'fast' is not one of full, quick, none"):
        pretrain.variant_from_env()


# --- the default demo's pipeline ------------------------------------------------------------------
def test_the_shipped_demo_pipeline_is_what_the_current_files_build():
    """models/demo/ ships the demo's pre-trained pipeline (its build takes ~200 s on a core) with the key of what
    built it (models.build_inputs_key: models/pretrain.py, models/tiny_text.py, models/flux.py, the libraries).
    Catches an edit to those files without rebuilding it: `python main.py` would quietly pre-train again on every
    fresh cache (and so would this suite). Rebuild: `python tools/build_demo_pipeline.py` (and check a rebuild is
    the shipped files byte for byte: `--check`)."""
    with open(os.path.join(models.SHIPPED_DIR, "tiny-flux-v3.key")) as f:
        shipped = f.read().strip()
    assert shipped == models.build_inputs_key("flux"), \
        "models/demo/tiny-flux-v3 is stale: run `python tools/build_demo_pipeline.py` and commit models/demo/"
    assert models.shipped_pipeline_path("flux") is not None


def test_a_changed_build_input_makes_the_shipped_pipeline_unused(tmp_path, monkeypatch):
    """Another key (an edited pretrain.py, other library releases) -> the pipeline is built into the cache, as
    every other tiny pipeline; with the key unchanged the shipped folder is used and nothing is built."""
    monkeypatch.setenv("DIGENRL_TINY_PRETRAIN", "full")
    assert models.tiny_pipeline_path("flux", str(tmp_path)) == models.shipped_pipeline_path("flux")
    assert not os.listdir(tmp_path)
    monkeypatch.setattr(models, "build_inputs_key", lambda name: "0" * 16)
    assert models.shipped_pipeline_path("flux") is None
    built = []
    monkeypatch.setattr(models.get_family("flux"), "build_tiny",
                        lambda path, pretrain_config=None: (built.append(pretrain_config), os.makedirs(path),
                                                            open(os.path.join(path, "model_index.json"), "w").close()))
    path = models.tiny_pipeline_path("flux", str(tmp_path))
    assert path == str(tmp_path / "tiny-flux-v3") and len(built) == 1 and built[0].flow_steps == 1000


@pytest.fixture(scope="module")
def demo_pipeline(tiny_cache, tmp_path_factory):
    """The default (fully pre-trained) tiny FLUX pipeline where `python main.py` finds it (the shipped one:
    test_the_shipped_demo_pipeline_is_what_the_current_files_build), and a random one."""
    cache = str(tmp_path_factory.mktemp("demo-cache"))
    previous = os.environ.get("DIGENRL_TINY_PRETRAIN")
    os.environ["DIGENRL_TINY_PRETRAIN"] = "full"
    try:
        paths = {"cache": cache, "pretrained": models.tiny_pipeline_path("flux", cache)}
    finally:
        os.environ["DIGENRL_TINY_PRETRAIN"] = previous if previous is not None else ""
        if previous is None:
            del os.environ["DIGENRL_TINY_PRETRAIN"]
    paths["random"] = str(tmp_path_factory.mktemp("random") / "pipeline")
    models.get_family("flux").build_tiny(paths["random"], seed=0, pretrain_config=False)
    return paths


def _sample_stats(path):
    policy = models.load("flux", path)
    scores, images = evaluate(policy, PROMPTS, SamplingConfig(), rewards.build_reward("color"), seeds_per_prompt=8)
    images = images.view(len(PROMPTS), 8, 3, 32, 32)  # [prompt, seed, 3, H, W]
    high_freq = ((images[..., 1:, :] - images[..., :-1, :]).abs().mean()
                 + (images[..., :, 1:] - images[..., :, :-1]).abs().mean()) / 2
    return {"eval_reward": float(scores["total"].mean()),
            "high_freq": float(high_freq),  # mean |neighbour difference|: noise is high, flat regions low
            "colour_spread": float(images[0].mean(dim=(2, 3)).std(dim=0).mean()),  # does the colour vary with the seed
            "pixel_std": float(images.std(dim=(3, 4)).mean()),  # not one flat colour: there is a shape
            "prompt_effect": float((images - images[:1]).abs().mean())}  # same seed, another colour word


def test_default_demo_pipeline_draws_structured_images_of_random_colours(demo_pipeline):
    """Measured: pre-trained high_freq 0.03, colour_spread 0.39; random 0.095 and 0.006 (coloured noise)."""
    trained, random = _sample_stats(demo_pipeline["pretrained"]), _sample_stats(demo_pipeline["random"])
    assert trained["high_freq"] < 0.06 < random["high_freq"], (trained, random)  # smooth regions, not noise
    assert trained["colour_spread"] > 0.2 > random["colour_spread"], (trained, random)  # colour depends on the seed
    assert trained["pixel_std"] > 0.1, trained  # a disc on a background, not a flat fill
    # ... and hardly on the colour word: the base model leaves the colour task to RL.
    assert trained["prompt_effect"] < 0.05 and abs(trained["eval_reward"]) < 0.05, trained


def test_the_default_demo_learns_the_colour_task(demo_pipeline, tmp_path):
    """`python main.py --model flux` (DigenRL, 2 ranks, every default) for 80 of its 200 steps: the evaluation
    on held-out seeds starts near 0 and passes 0.3. Measured over 3 seeds (tools/learning_bench.py): 10-step
    train reward >= 0.5 after 7.6-9.9 s of training (steps ~45-60); eval 0.45 at step 50 (seed 0). Only the
    demo's own path is checked here: the synchronous modes learned this task less reliably (README).
    The best of four evaluations, not the last: TAG's and TCSS's choices follow the machine's timing, and in one
    whole-suite run on 2 loaded cores (2026-12-04) the train reward reached 0.68 at step 70 and fell to 0.08 by
    step 79 (evaluations 0.10 at step 40, 0.09 at 80; 13 TAG claims against 1 alone, where the evaluation was
    0.54 at step 80)."""
    run_forked(["--model", "flux", "--steps", "80", "--eval-every", "20", "--save-every", "0"], tmp_path, "demo",
               demo_pipeline["cache"], env={"DIGENRL_TINY_PRETRAIN": "full"})
    rows = read_metrics(tmp_path / "demo")
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    assert abs(rows[0]["eval_reward_initial"]) < 0.05 and len(evals) == 4, rows[0]
    assert max(evals) > 0.3, evals


def test_concurrent_builders_of_a_tiny_pipeline_build_it_once(tmp_path):
    """Two processes asking for the same uncached tiny pipeline at once (two jobs, or two pytest-xdist workers on
    one cache) used to build and pre-train it twice, the loser's copy thrown away; the build lock makes one of
    them build while the other waits and reuses it. Both get a complete pipeline."""
    import subprocess
    import sys

    from conftest import ROOT
    code = "import sys, models; print('PATH', models.tiny_pipeline_path('flux', sys.argv[1]))"
    env = dict(os.environ, DIGENRL_TINY_PRETRAIN="quick", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(out.count("pre-training the tiny pipeline") for out in outs) == 1, outs
    paths = {line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("PATH ")}
    assert len(paths) == 1 and os.path.isfile(os.path.join(paths.pop(), "model_index.json"))
