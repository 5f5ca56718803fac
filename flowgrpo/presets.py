"""Default training settings: the tiny pipelines' own, and for real weights (--pretrained) the
published ones.

    preset = presets.for_run("flux", pretrained=True, algo="flow_grpo")
    # Setting(value=3e-4, source="Flow-GRPO config/base.py train.learning_rate")
    preset.values["lr"]
    # the startup line: which preset, each value and where it comes from
    presets.describe(cfg)

With --pretrained and no flag for them, resolution (the pipeline's native one), learning rate, clip
range, noise level, group size, timestep fraction, guidance, sampling steps, video frames, groups
per step, KL weight, weight decay, sample and evaluation batch sizes and the EMA's repeats come
from the family's published Flow-GRPO recipe (yifan123/flow_grpo, config/grpo.py at commit 31c71b9
and config/base.py; line numbers of base.py and of the SD3 recipes are those of commit ac4c86e,
where they are the same), or with --algo dance_grpo from DanceGRPO's (XueZeyue/DanceGRPO
scripts/finetune/*.sh and fastvideo/train_grpo_*.py). Each value names the file it was read from; a
family without a published recipe of that algorithm says whose values it borrows. Full fine-tuning
(--no-lora) takes the full-fine-tuning learning rate (no Flow-GRPO recipe trains every weight:
DanceGRPO's, which does). A flag given on the command line always wins. The tiny pipelines keep
settings measured on them (config.py's help strings say why).

Departures, stated where they apply: resolution is the pipeline's native one (what `pipe(prompt)`
draws), not the recipes' training resolution (Flow-GRPO trains FLUX, Qwen-Image and SD3.5 at 512 px,
Wan at 240 x 416); Flow-GRPO's Qwen-Image recipe trains a window of 2 SDE steps (sde_window_size 2)
at noise level 1.2, while digenrl has no SDE window and trains the first int(T x timestep_fraction)
steps. Flow-GRPO's SD3 scripts encode prompts with T5 at max_sequence_length 128
(scripts/train_sd3.py compute_text_embeddings), and SD3's joint attention sees the padding tokens,
so the sequence length changes the velocity: --text-len 128 matches them (the default 512 does not;
text_len is not a preset field).
"""
from __future__ import annotations

import dataclasses

FLOW_GRPO = "Flow-GRPO config/grpo.py"  # yifan123/flow_grpo @ 31c71b9
FLOW_GRPO_BASE = "Flow-GRPO config/base.py"
DANCE_FLUX = "DanceGRPO scripts/finetune/finetune_flux_grpo.sh"
DANCE_HUNYUAN = "DanceGRPO scripts/finetune/finetune_hunyuan_grpo.sh"
DANCE_FLUX_PY = "DanceGRPO fastvideo/train_grpo_flux.py"  # @ 22b85ef, as the script
# Flow-GRPO's recipes give their batch per GPU for 32 GPUs: num_batches_per_epoch = int(48 / (32 x
# train_batch_size / num_image_per_prompt)) sub-batches of train_batch_size samples per GPU, i.e. 48
# groups an epoch, and gradient_accumulation_steps = num_batches_per_epoch // 2 sub-batches per
# update (each one ema.step call: ema_repeats).


@dataclasses.dataclass(frozen=True)
class Setting:
    value: object
    source: str


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    values: dict  # Config field -> Setting


def _native(height: int, width: int, pipeline: str) -> dict:
    return {"resolution": Setting(height, f"{pipeline} native size"),
            "width": Setting(width, f"{pipeline} native size")}


_NATIVE = {
    "flux": _native(1024, 1024, "FluxPipeline default_sample_size 128 x vae_scale_factor 8:"),
    "qwenimage": _native(1024, 1024,
                         "QwenImagePipeline default_sample_size 128 x vae_scale_factor 8:"),
    "wan": _native(480, 832, "WanPipeline height 480, width 832:"),
    "hunyuanvideo": _native(720, 1280, "HunyuanVideoPipeline height 720, width 1280:"),
    "sd3": _native(1024, 1024,
                   "StableDiffusion3Pipeline default_sample_size 128 x vae_scale_factor 8:"),
}


def _s(**values) -> dict:
    return {k: Setting(*v) for k, v in values.items()}


_PUBLISHED = {
    ("flux", "flow_grpo"): _s(
        lr=(3e-4, f"{FLOW_GRPO_BASE} train.learning_rate (pickscore_flux keeps it)"),
        clip_range=(1e-4, f"{FLOW_GRPO_BASE} train.clip_range"),
        noise_level=(0.9, f"{FLOW_GRPO} pickscore_flux sample.noise_level"),
        group_size=(24, f"{FLOW_GRPO} pickscore_flux sample.num_image_per_prompt"),
        timestep_fraction=(0.99, f"{FLOW_GRPO} pickscore_flux train.timestep_fraction"),
        guidance=(3.5, f"{FLOW_GRPO} pickscore_flux sample.guidance_scale"),
        num_steps=(6, f"{FLOW_GRPO} pickscore_flux sample.num_steps"),
        prompts_per_step=(48, f"{FLOW_GRPO} pickscore_flux num_batches_per_epoch = int(48 / ...): "
                              "48 groups an epoch"),
        beta=(0.0, f"{FLOW_GRPO} pickscore_flux train.beta = 0"),
        weight_decay=(1e-4, f"{FLOW_GRPO_BASE} line 69 train.adam_weight_decay"),
        sample_batch_size=(3, f"{FLOW_GRPO} pickscore_flux sample.train_batch_size"),
        eval_batch_size=(16, f"{FLOW_GRPO} pickscore_flux sample.test_batch_size"),
        ema_repeats=(6, f"{FLOW_GRPO} pickscore_flux gradient_accumulation_steps = 12 // 2 at its "
                        "32 GPUs (an ema.step per sampled sub-batch)")),
    ("qwenimage", "flow_grpo"): _s(
        lr=(3e-4, f"{FLOW_GRPO_BASE} train.learning_rate (pickscore_qwenimage keeps it)"),
        clip_range=(1e-4, f"{FLOW_GRPO_BASE} train.clip_range"),
        noise_level=(1.2, f"{FLOW_GRPO} pickscore_qwenimage sample.noise_level (there inside a "
                          "2-step SDE window)"),
        group_size=(16, f"{FLOW_GRPO} pickscore_qwenimage sample.num_image_per_prompt"),
        timestep_fraction=(0.99, f"{FLOW_GRPO} (pickscore_qwenimage trains its SDE window instead: "
                                 "all but the last step, as its other recipes)"),
        guidance=(4.0, f"{FLOW_GRPO} pickscore_qwenimage sample.guidance_scale (true CFG)"),
        num_steps=(10, f"{FLOW_GRPO} pickscore_qwenimage sample.num_steps"),
        prompts_per_step=(32, f"{FLOW_GRPO} pickscore_qwenimage num_batches_per_epoch = "
                              "int(32 / ...): 32 groups an epoch"),
        beta=(0.0, f"{FLOW_GRPO} pickscore_qwenimage train.beta = 0"),
        weight_decay=(1e-4, f"{FLOW_GRPO_BASE} line 69 train.adam_weight_decay"),
        sample_batch_size=(4, f"{FLOW_GRPO} pickscore_qwenimage sample.train_batch_size"),
        eval_batch_size=(4, f"{FLOW_GRPO} pickscore_qwenimage sample.test_batch_size"),
        ema_repeats=(2, f"{FLOW_GRPO} pickscore_qwenimage gradient_accumulation_steps = 4 // 2 "
                        "(its train.ema is off)")),
    ("wan", "flow_grpo"): _s(
        lr=(1e-4, f"{FLOW_GRPO} general_ocr_wan2_1 train.learning_rate"),
        clip_range=(1e-3, f"{FLOW_GRPO} general_ocr_wan2_1 train.clip_range"),
        noise_level=(0.7, f"{FLOW_GRPO_BASE} sample.noise_level (general_ocr_wan2_1 keeps it)"),
        group_size=(4, f"{FLOW_GRPO} general_ocr_wan2_1 sample.num_image_per_prompt"),
        timestep_fraction=(0.99, f"{FLOW_GRPO} general_ocr_wan2_1 train.timestep_fraction"),
        guidance=(4.5, f"{FLOW_GRPO} general_ocr_wan2_1 sample.guidance_scale (true CFG)"),
        num_steps=(20, f"{FLOW_GRPO} general_ocr_wan2_1 sample.num_steps"),
        frames=(33, f"{FLOW_GRPO} general_ocr_wan2_1 frames"),
        prompts_per_step=(32, f"{FLOW_GRPO} general_ocr_wan2_1 num_batches_per_epoch 2 x "
                              "train_batch_size 8 / num_image_per_prompt 4 = 4 groups per GPU, "
                              "on 8 GPUs (it fixes no GPU count)"),
        beta=(0.004, f"{FLOW_GRPO} general_ocr_wan2_1 train.beta"),
        weight_decay=(1e-4, f"{FLOW_GRPO_BASE} line 69 train.adam_weight_decay"),
        sample_batch_size=(4, f"{FLOW_GRPO} general_ocr_wan2_1 sample.train_batch_size 8, here one "
                              "group of 4 (a batch must divide a fragment's trajectories)"),
        eval_batch_size=(2, f"{FLOW_GRPO} general_ocr_wan2_1 sample.test_batch_size"),
        ema_repeats=(1, f"{FLOW_GRPO} general_ocr_wan2_1 gradient_accumulation_steps = "
                        "2 * 1 // 2")),
    ("sd3", "flow_grpo"): _s(
        lr=(3e-4, f"{FLOW_GRPO_BASE} train.learning_rate (pickscore_sd3 keeps it)"),
        clip_range=(1e-4, f"{FLOW_GRPO_BASE} train.clip_range (pickscore_sd3 keeps it)"),
        noise_level=(0.7, f"{FLOW_GRPO_BASE} sample.noise_level (pickscore_sd3 keeps it)"),
        group_size=(24, f"{FLOW_GRPO} pickscore_sd3 sample.num_image_per_prompt"),
        timestep_fraction=(0.99, f"{FLOW_GRPO} pickscore_sd3 train.timestep_fraction"),
        guidance=(4.5, f"{FLOW_GRPO} pickscore_sd3 sample.guidance_scale (true CFG)"),
        num_steps=(10, f"{FLOW_GRPO} pickscore_sd3 sample.num_steps"),
        prompts_per_step=(48, f"{FLOW_GRPO} line 120 pickscore_sd3 num_batches_per_epoch = "
                              "int(48 / ...): 48 groups an epoch"),
        beta=(0.01, f"{FLOW_GRPO} line 128 pickscore_sd3 train.beta"),
        weight_decay=(1e-4, f"{FLOW_GRPO_BASE} line 69 train.adam_weight_decay"),
        sample_batch_size=(8, f"{FLOW_GRPO} line 118 pickscore_sd3 sample.train_batch_size 9, here "
                              "8: the largest that divides a 24-trajectory fragment (or 9 with "
                              "--fragment-groups 3, as configs/flow_grpo/sd3_*.json)"),
        eval_batch_size=(16, f"{FLOW_GRPO} line 122 pickscore_sd3 sample.test_batch_size"),
        ema_repeats=(2, f"{FLOW_GRPO} line 125 pickscore_sd3 gradient_accumulation_steps = 4 // 2 "
                        "at its 32 GPUs (an ema.step per sampled sub-batch)")),
    # Flow-GRPO publishes no HunyuanVideo recipe: its base settings, DanceGRPO's HunyuanVideo batch
    # shape.
    ("hunyuanvideo", "flow_grpo"): _s(
        lr=(3e-4, f"{FLOW_GRPO_BASE} train.learning_rate (no Flow-GRPO HunyuanVideo recipe)"),
        clip_range=(1e-4, f"{FLOW_GRPO_BASE} train.clip_range"),
        noise_level=(0.7, f"{FLOW_GRPO_BASE} sample.noise_level"),
        group_size=(24, f"{DANCE_HUNYUAN} --num_generations (no Flow-GRPO HunyuanVideo recipe)"),
        timestep_fraction=(0.99, f"{FLOW_GRPO} (every recipe there: all but the last step)"),
        guidance=(6.018, "DanceGRPO fastvideo/train_grpo_hunyuan.py guidance 6018 (= 6.018 x 1000 "
                         "embedded)"),
        num_steps=(16, f"{DANCE_HUNYUAN} --sampling_steps"),
        frames=(53, f"{DANCE_HUNYUAN} --t"),
        prompts_per_step=(48, f"{FLOW_GRPO} (no HunyuanVideo recipe: its image recipes' 48 "
                              "groups)"),
        beta=(0.0, f"{FLOW_GRPO_BASE} line 91 train.beta"),
        weight_decay=(1e-4, f"{FLOW_GRPO_BASE} line 69 train.adam_weight_decay"),
        sample_batch_size=(1, f"{DANCE_FLUX_PY} sample_reference_model batch_size = 1 (no "
                              "Flow-GRPO HunyuanVideo recipe: one video per forward, as DanceGRPO "
                              "samples)"),
        eval_batch_size=(1, "one video per forward (no published HunyuanVideo evaluation)"),
        ema_repeats=(1, f"{FLOW_GRPO_BASE} (no HunyuanVideo recipe): one ema.step per update")),
    ("flux", "dance_grpo"): _s(
        lr=(1e-5, f"{DANCE_FLUX} --learning_rate"),
        clip_range=(1e-4, f"{DANCE_FLUX} --clip_range"),
        noise_level=(0.3, f"{DANCE_FLUX} --eta"),
        group_size=(12, f"{DANCE_FLUX} --num_generations"),
        timestep_fraction=(0.6, f"{DANCE_FLUX} --timestep_fraction"),
        guidance=(3.5, "DanceGRPO fastvideo/train_grpo_flux.py guidance [3.5]"),
        num_steps=(16, f"{DANCE_FLUX} --sampling_steps"),
        prompts_per_step=(16, f"{DANCE_FLUX} lines 21 and 29: 2 nodes x 8 GPUs x "
                              "--train_batch_size 1 prompt each"),
        beta=(0.0, f"{DANCE_FLUX_PY} train_one_step: its loss has no KL term"),
        weight_decay=(1e-4, f"{DANCE_FLUX} line 50 --weight_decay"),
        sample_batch_size=(1, f"{DANCE_FLUX_PY} sample_reference_model batch_size = 1"),
        eval_batch_size=(1, "one image per forward, as DanceGRPO samples (it evaluates nothing)"),
        ema_repeats=(1, "one EMA update per optimizer update (DanceGRPO's ema_handler)")),
    ("hunyuanvideo", "dance_grpo"): _s(
        lr=(1e-5, f"{DANCE_HUNYUAN} --learning_rate"),
        clip_range=(1e-4, "DanceGRPO fastvideo/train_grpo_hunyuan.py clip_range = 1e-4"),
        noise_level=(0.25, f"{DANCE_HUNYUAN} --eta"),
        group_size=(24, f"{DANCE_HUNYUAN} --num_generations"),
        timestep_fraction=(0.6, f"{DANCE_HUNYUAN} --timestep_fraction"),
        guidance=(6.018, "DanceGRPO fastvideo/train_grpo_hunyuan.py guidance 6018 (= 6.018 x 1000 "
                         "embedded)"),
        num_steps=(16, f"{DANCE_HUNYUAN} --sampling_steps"),
        frames=(53, f"{DANCE_HUNYUAN} --t"),
        prompts_per_step=(16, f"{DANCE_FLUX} lines 21 and 29 (16 GPUs x 1 prompt; its FLUX "
                              "script's)"),
        beta=(0.0, f"{DANCE_FLUX_PY} train_one_step: its loss has no KL term"),
        weight_decay=(1e-4, f"{DANCE_FLUX} line 50 --weight_decay (its FLUX script's)"),
        sample_batch_size=(1, f"{DANCE_FLUX_PY} sample_reference_model batch_size = 1"),
        eval_batch_size=(1, "one video per forward, as DanceGRPO samples (it evaluates nothing)"),
        ema_repeats=(1, "one EMA update per optimizer update (DanceGRPO's ema_handler)")),
}
def _borrowed(recipe: dict, note: str, guidance: Setting) -> dict:
    return {**{k: Setting(v.value, f"{v.source} ({note})") for k, v in recipe.items()},
            "guidance": guidance}


# DanceGRPO publishes no Qwen-Image, SD3 or Wan recipe: the image families borrow its FLUX one, the
# video family its HunyuanVideo one; guidance stays the family's Flow-GRPO value (true CFG scales,
# not FLUX's embedded guidance).
_PUBLISHED[("qwenimage", "dance_grpo")] = _borrowed(
    _PUBLISHED[("flux", "dance_grpo")], "no DanceGRPO Qwen-Image recipe: its FLUX one",
    Setting(4.0, f"{FLOW_GRPO} pickscore_qwenimage sample.guidance_scale (true CFG)"))
_PUBLISHED[("sd3", "dance_grpo")] = _borrowed(
    _PUBLISHED[("flux", "dance_grpo")], "no DanceGRPO SD3 recipe: its FLUX one",
    Setting(4.5, f"{FLOW_GRPO} pickscore_sd3 sample.guidance_scale (true CFG)"))
_PUBLISHED[("wan", "dance_grpo")] = _borrowed(
    _PUBLISHED[("hunyuanvideo", "dance_grpo")], "no DanceGRPO Wan recipe: its HunyuanVideo one",
    Setting(4.5, f"{FLOW_GRPO} general_ocr_wan2_1 sample.guidance_scale (true CFG)"))

_TINY = _s(
    lr=(3e-3, "tiny pipelines: measured (config.py --lr)"),
    clip_range=(1e-2, "tiny pipelines (config.py --clip-range)"),
    noise_level=(0.5, "tiny pipelines: measured (config.py --noise-level)"),
    group_size=(8, "tiny pipelines (config.py --group-size)"),
    num_steps=(6, "tiny pipelines (config.py --num-steps)"),
    prompts_per_step=(3, "tiny pipelines: the colour task's 3 prompts"),
    beta=(0.0, "tiny pipelines (config.py --beta)"),
    weight_decay=(0.0, "tiny pipelines (config.py --weight-decay)"),
    sample_batch_size=(0, "tiny pipelines: a whole fragment per forward"),
    eval_batch_size=(0, "tiny pipelines: a rank's whole evaluation share per forward"),
    ema_repeats=(1, "tiny pipelines: one EMA update per trigger"))
# --no-lora with real weights: no Flow-GRPO recipe trains every weight; DanceGRPO's does
_FULL_LR = {"flow_grpo": Setting(1e-5, f"{DANCE_FLUX} line 36 --learning_rate (full fine-tuning; "
                                       "no Flow-GRPO recipe trains every weight)")}
_TINY_FRACTION = {"flow_grpo": Setting(0.99, "Flow-GRPO's configs: all but the last step"),
                  "dance_grpo": Setting(0.6, f"{DANCE_FLUX} --timestep_fraction")}

FIELDS = ("resolution", "width", "frames", "lr", "clip_range", "noise_level", "group_size",
          "timestep_fraction", "guidance", "num_steps", "prompts_per_step", "beta", "weight_decay",
          "sample_batch_size", "eval_batch_size", "ema_repeats")


def for_run(model: str, pretrained: bool, algo: str, lora: bool = True) -> Preset:
    """The defaults of a run: the published recipe of `model` and `algo` for real weights (with
    `lora` False the full-fine-tuning learning rate), else the tiny ones. Fields a preset leaves out
    (tiny: resolution, frames, guidance) keep the family's own defaults."""
    if not pretrained:
        return Preset("tiny", {**_TINY, "timestep_fraction":
                               _TINY_FRACTION.get(algo, _TINY_FRACTION["flow_grpo"])})
    recipe = _PUBLISHED.get((model, algo))
    if recipe is None:
        raise ValueError(f"no published {algo} settings for --model {model!r}; known: "
                         + ", ".join(f"{m} ({a})" for m, a in sorted(_PUBLISHED)))
    who = "Flow-GRPO" if algo == "flow_grpo" else "DanceGRPO"
    full = {} if lora or algo not in _FULL_LR else {"lr": _FULL_LR[algo]}
    return Preset(f"{who} {model}" + ("" if lora else " (full fine-tuning)"),
                  {**_NATIVE[model], **recipe, **full})


def describe(cfg) -> str:
    """One line: the preset in force and, per value, where it comes from (or that a flag set it)."""
    preset = for_run(cfg.model, cfg.pretrained is not None, cfg.algo, bool(cfg.lora))
    parts = []
    for name in FIELDS:
        setting = preset.values.get(name)
        if setting is None:
            continue
        value = getattr(cfg, name)
        if name == "width" and not value:
            continue  # square: --resolution given
        where = setting.source if value == setting.value else "given"
        parts.append(f"{name} {value:g} [{where}]")
    kind = "real weights (--pretrained)" if cfg.pretrained is not None else "the tiny pipeline"
    return f"preset: {preset.name} for {kind}: " + "; ".join(parts)
