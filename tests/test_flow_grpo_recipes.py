"""Flow-GRPO's published recipes as config files (configs/flow_grpo/*.json): every knob mapped from its own config.

Outside truth: the values of yifan123/flow_grpo config/grpo.py (commit 31c71b9) on config/base.py, re-typed below
under Flow-GRPO's own names (with its derived quantities computed by its formulas), mapped to digenrl's fields by
the README's name table; each file must equal that mapping, and must load with --config plus the user's paths and
validate on 3 ranks. Catches a recipe value typed wrong, a knob left out of a file, a renamed field, and a file that
no longer validates.

Run: python -m pytest -q tests/test_flow_grpo_recipes.py
"""
import json
import os

import pytest

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
       "sample.num_image_per_prompt": 24, "train.timestep_fraction": 0.99, "sample.global_std": True,
       "train.ema": True, "save_freq": 60, "eval_freq": 60, "gpu_number": 32}
FLOW_GRPO = {
    "sd3_pickscore": {**BASE, **SD3, "train.beta": 0.01, "reward_fn": {"pickscore": 1.0}},
    "sd3_geneval": {**BASE, **SD3, "train.beta": 0.04, "reward_fn": {"geneval": 1.0}},
    "flux_pickscore": {**BASE, "pretrained.model": "black-forest-labs/FLUX.1-dev", "sample.num_steps": 6,
                       "sample.eval_num_steps": 28, "sample.guidance_scale": 3.5, "resolution": 512,
                       "sample.train_batch_size": 3, "sample.num_image_per_prompt": 24,
                       "train.timestep_fraction": 0.99, "train.beta": 0, "sample.global_std": True, "train.ema": True,
                       "sample.noise_level": 0.9, "save_freq": 30, "eval_freq": 30, "gpu_number": 32,
                       "reward_fn": {"pickscore": 1.0}},
}
# scripts/train_sd3.py and train_flux.py: LoraConfig(r, lora_alpha), max_sequence_length 128, EMAModuleWrapper(decay
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
    out = {
        "model": model, "algo": "flow_grpo", "lora": fg["use_lora"], "lora_targets": "flow_grpo",
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
        config.validate(cfg, 3)
