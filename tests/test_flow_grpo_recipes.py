"""Flow-GRPO's published recipes as config files (configs/flow_grpo/*.json): every knob mapped from its own config.

Outside truth: the values of yifan123/flow_grpo config/grpo.py (commit 31c71b9) on config/base.py, re-typed below
under Flow-GRPO's own names (with its derived quantities computed by its formulas), mapped to digenrl's fields by
the README's name table; each file must equal that mapping, and must load with --config plus the user's paths and
validate on 3 ranks. Catches a recipe value typed wrong, a knob left out of a file, a renamed field, and a file that
no longer validates. Then each file runs end to end on the tiny pipeline of its family (sizes cut down, 2 steps,
colocated as written and as --mode digenrl) with evaluation on: the test split only, scored against each prompt's
own dataset row (GenEval's server sees every image with its prompt's row), and the KL metric is Flow-GRPO's
(kl_scale diffusion).

Run: python -m pytest -q tests/test_flow_grpo_recipes.py
"""
import json
import math
import os

import pytest

import cli
import config
import models

pytestmark = pytest.mark.timeout(300)
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "flow_grpo")

BASE = {  # config/base.py
    "seed": 42, "num_checkpoint_limit": 5, "use_lora": True, "num_epochs": 100000,
    "sample.noise_level": 0.7, "sample.global_std": True, "sample.eval_guidance_scale": 4.5,
    "train.learning_rate": 3e-4, "train.adam_weight_decay": 1e-4, "train.max_grad_norm": 1.0,
    "train.clip_range": 1e-4, "train.adv_clip_max": 5, "train.cfg": True, "train.beta": 0.0, "train.ema": False,
    "train.num_inner_epochs": 1, "per_prompt_stat_tracking": True,
}
SD3 = {"pretrained.model": "stabilityai/stable-diffusion-3.5-medium", "sample.num_steps": 10,
       "sample.eval_num_steps": 40, "sample.guidance_scale": 4.5, "resolution": 512, "sample.train_batch_size": 9,
       "sample.test_batch_size": 16,
       "sample.num_image_per_prompt": 24, "train.timestep_fraction": 0.99, "sample.global_std": True,
       "train.ema": True, "save_freq": 60, "eval_freq": 60, "gpu_number": 32}
FLOW_GRPO = {
    "sd3_pickscore": {**BASE, **SD3, "train.beta": 0.01, "reward_fn": {"pickscore": 1.0}},
    "sd3_geneval": {**BASE, **SD3, "train.beta": 0.04, "sample.test_batch_size": 14, "reward_fn": {"geneval": 1.0}},
    "flux_pickscore": {**BASE, "pretrained.model": "black-forest-labs/FLUX.1-dev", "sample.num_steps": 6,
                       "sample.eval_num_steps": 28, "sample.guidance_scale": 3.5, "resolution": 512,
                       "sample.train_batch_size": 3, "sample.test_batch_size": 16, "sample.num_image_per_prompt": 24,
                       "train.timestep_fraction": 0.99, "train.beta": 0, "sample.global_std": True, "train.ema": True,
                       "sample.noise_level": 0.9, "save_freq": 30, "eval_freq": 30, "gpu_number": 32,
                       "reward_fn": {"pickscore": 1.0}},
}
# scripts/train_sd3.py and train_flux.py: its training step (tests/test_flow_grpo_step.py re-types it): synchronous
# (colocated), every sample permuted before the minibatches, SD3's zero-advantage drop (train_sd3.py lines 796-817,
# not train_flux.py), the ratio against the rollout's log-prob, the KL over g^2, SD3's detached unconditional
# branch (line 190), ema.step per sampled sub-batch (gradient_accumulation_steps of them per update); LoraConfig(r, lora_alpha), max_sequence_length 128, EMAModuleWrapper(decay
# 0.9, update_step_interval 8), and evaluation at config.sample.guidance_scale.
SCRIPTS = {"sd3": {"r": 32, "lora_alpha": 64}, "flux": {"r": 64, "lora_alpha": 128}}
MODELS = {"stabilityai/stable-diffusion-3.5-medium": "sd3", "black-forest-labs/FLUX.1-dev": "flux"}
REWARDS = {"pickscore": {"reward": "pickscore"}, "geneval": {"reward": "remote", "remote_protocol": "flow_grpo"}}


def ours(fg: dict) -> dict:
    """Flow-GRPO's names -> digenrl's fields (the README's table), derived values by Flow-GRPO's own formulas."""
    num_batches = int(48 / (fg["gpu_number"] * fg["sample.train_batch_size"] / fg["sample.num_image_per_prompt"]))
    accumulation = num_batches // 2  # config/grpo.py: gradient_accumulation_steps = num_batches_per_epoch // 2
    groups = num_batches * fg["gpu_number"] * fg["sample.train_batch_size"] // fg["sample.num_image_per_prompt"]
    model = MODELS[fg["pretrained.model"]]
    (reward, _), = fg["reward_fn"].items()
    g = fg["sample.num_image_per_prompt"]
    fragment_groups = math.lcm(g, fg["sample.train_batch_size"]) // g  # whole forwards in a fragment
    out = {
        "model": model, "algo": "flow_grpo", "lora": fg["use_lora"], "lora_targets": "flow_grpo",
        "mode": "colocated", "minibatches": "samples", "old_log_prob": "rollout", "kl_scale": "diffusion",
        "drop_zero_advantage": model == "sd3", "ema_repeats": accumulation, "eval_split": "test",
        "sample_batch_size": fg["sample.train_batch_size"], "eval_batch_size": fg["sample.test_batch_size"],
        "fragment_groups": fragment_groups,
        "lora_rank": SCRIPTS[model]["r"], "lora_alpha": float(SCRIPTS[model]["lora_alpha"]),
        "resolution": fg["resolution"], "prompts_per_step": groups, "group_size": fg["sample.num_image_per_prompt"],
        "updates_per_batch": fg["train.num_inner_epochs"] * num_batches // accumulation,
        "num_steps": fg["sample.num_steps"], "eval_num_steps": fg["sample.eval_num_steps"],
        "guidance": fg["sample.guidance_scale"], "eval_guidance": fg["sample.guidance_scale"],
        "timestep_fraction": fg["train.timestep_fraction"], "noise_level": fg["sample.noise_level"],
        "lr": fg["train.learning_rate"], "weight_decay": fg["train.adam_weight_decay"],
        "clip_range": fg["train.clip_range"], "max_grad_norm": fg["train.max_grad_norm"],
        "adv_clip": float(fg["train.adv_clip_max"]), "beta": float(fg["train.beta"]),
        "per_prompt_stat_tracking": fg["per_prompt_stat_tracking"], "global_std": fg["sample.global_std"],
        "ema": fg["train.ema"], "ema_decay": 0.9, "ema_every": 8, "text_len": 128,
        "eval_every": fg["eval_freq"], "save_every": fg["save_freq"], "keep_checkpoints": fg["num_checkpoint_limit"],
        "seed": fg["seed"], "steps": fg["num_epochs"], "eval_prompts": 0, "eval_seeds": 1, **REWARDS[reward],
    }
    if models.get_family(model).uses_true_cfg:
        out["train_cfg"] = fg["train.cfg"]
        out["detach_uncond"] = True  # train_sd3.py line 190
    return out


def read(name: str) -> dict:
    with open(os.path.join(CONFIGS, f"{name}.json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


@pytest.mark.parametrize("name", sorted(FLOW_GRPO))
def test_recipe_file_is_flow_grpos_config_mapped(name):
    assert read(name) == ours(FLOW_GRPO[name])
    assert sorted(f[:-5] for f in os.listdir(CONFIGS)) == sorted(FLOW_GRPO)


def write_dataset(folder):
    os.makedirs(folder)
    for split in ("train", "test"):
        with open(os.path.join(folder, f"{split}_metadata.jsonl"), "w") as f:
            for thing in ("apple", "car", "kite"):
                f.write(json.dumps({"tag": "single_object", "include": [{"class": thing, "count": 1}],
                                    "prompt": f"a photo of a {thing}"}) + "\n")
    return str(folder)


@pytest.mark.parametrize("name", sorted(FLOW_GRPO))
def test_recipe_loads_with_the_users_paths_and_validates(name, tiny_cache, tmp_path, monkeypatch):
    """`--config configs/flow_grpo/NAME.json --pretrained DIR --prompt-file DATASET ...` (the tiny pipeline of the
    family standing in for the real weights) keeps every value of the file and validates on 3 ranks."""
    from test_compat_remote import geneval_answer, pickle_server
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recipe = read(name)
    pickscore = tmp_path / "pickscore"
    pickscore.mkdir()
    argv = ["--config", os.path.join(CONFIGS, f"{name}.json"), "--pretrained", models.tiny_pipeline_path(recipe["model"]),
            "--prompt-file", write_dataset(tmp_path / "dataset"), "--nproc", "3", "--out-dir", str(tmp_path / "runs")]
    with pickle_server(geneval_answer) as (url, _):
        extra = ["--remote-url", url] if recipe["reward"] == "remote" else ["--pickscore-path", str(pickscore)]
        cfg = config.resolve(config.parse_args(argv + extra), world=3)
        assert {k: getattr(cfg, k) for k in recipe} == recipe
        cli.validate(cfg, 3)


def _cut_down(name, dataset, url, clip):
    """The recipe's file plus what makes it run on the tiny pipeline in seconds: its reward's endpoint (the tiny
    CLIP as PickScore, a GenEval-shaped server), 2 steps of 2 groups of 4 at 32 px, T = 3, batches of 2."""
    recipe = read(name)
    reward = ["--remote-url", url] if recipe["reward"] == "remote" else \
        ["--pickscore-path", clip, "--pickscore-processor-path", clip]
    return ["--config", os.path.join(CONFIGS, f"{name}.json"), "--pretrained", models.tiny_pipeline_path(recipe["model"]),
            "--prompt-file", dataset, *reward, "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--fragment-groups", "1", "--sample-batch-size", "2", "--eval-batch-size", "2", "--eval-every", "2",
            "--eval-seeds", "2", "--num-steps", "3", "--eval-num-steps", "3", "--resolution", "32", "--text-len", "16",
            "--nproc", "2", "--save-every", "0", "--lora-rank", "4", "--lora-alpha", "8", "--timeout-s", "120"]


TEST_THINGS = ("bench", "cow", "vase")  # the test split's objects: none is a training prompt's


@pytest.mark.parametrize("name,mode", [("sd3_geneval", "colocated"), ("sd3_geneval", "digenrl"),
                                       ("flux_pickscore", "colocated"), ("flux_pickscore", "digenrl")])
def test_recipe_runs_end_to_end_with_evaluation_of_the_test_split(name, mode, tiny_cache, tmp_path, monkeypatch):
    """Catches a recipe that cannot run (a knob the runtime refuses or ignores), an evaluation of the training
    prompts (the dataset's test rows name other things) or of one rank's share only, a sample scored against
    another prompt's row, and a KL metric over the step variance."""
    from conftest import read_metrics, run_forked
    from test_compat_remote import geneval_answer, pickle_server
    from test_rewards import _write_tiny_clip
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    clip = tmp_path / "clip"
    clip.mkdir()
    _write_tiny_clip(clip)
    dataset = write_dataset(tmp_path / "dataset")
    with open(os.path.join(dataset, "test_metadata.jsonl"), "w") as f:
        for thing in TEST_THINGS:
            f.write(json.dumps({"tag": "single_object", "include": [{"class": thing, "count": 1}],
                                "prompt": f"a photo of a {thing}"}) + "\n")
    with pickle_server(geneval_answer) as (url, log):
        args = _cut_down(name, dataset, url, str(clip)) + (["--mode", mode] if mode != "colocated" else [])
        run_forked(args, tmp_path / "runs", "r", tiny_cache, env={"no_proxy": "127.0.0.1,localhost"})
    run = tmp_path / "runs" / "r"
    rows = read_metrics(run)
    saved = json.load(open(run / "config.json"))
    assert (saved["mode"], saved["kl_scale"], saved["eval_split"]) == (mode, "diffusion", "test")
    assert [r["step"] for r in rows] == [0, 1] and "eval_reward" in rows[1]
    assert "eval_reward_initial" in rows[0] and "eval_reward_heldout_prompts" not in rows[0]
    if saved["beta"] > 0:
        assert all(r["kl"] >= 0 for r in rows) and rows[1]["kl"] > 0
    if name == "sd3_geneval":  # every image the server scored came with its own prompt's row
        requests = [payload for payload, _ in log[1:]]  # after validation's one check request
        assert requests and all(m["prompt"] == p for payload in requests
                                for p, m in zip(payload["prompts"], payload["meta_datas"]))
        evaluated = [p for payload in requests for p in payload["prompts"] if p.split()[-1] in TEST_THINGS]
        # 2 evaluations (before the first step, after the last) of every test prompt from 2 seeds, over both
        # ranks (colocated) or the one trainer
        assert sorted(evaluated) == sorted(f"a photo of a {t}" for t in TEST_THINGS for _ in range(2 * 2))
