"""The one Config dataclass (every field has a help string stating its trade-off), argparse, and validation.

Validation runs before any rank is spawned: a bad value exits with a message naming it and what is
allowed. `python main.py --help` prints every field.
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from typing import Optional

MODES = {
    # mode: (placement, gap, tsp, tag, async)
    "digenrl": ("disaggregated", True, True, True, True),
    "colocated": ("colocated", False, False, False, False),
    "naive": ("disaggregated", False, False, False, False),
}
MECHANISM_FIELDS = ("placement", "gap", "tsp", "tag", "use_async")


def field(default, help_text, **kw):
    return dataclasses.field(default=default, metadata={"help": help_text, **kw})


@dataclasses.dataclass
class Config:
    # what to train
    model: str = field("flux", "model family: flux, qwenimage, wan, hunyuanvideo")
    pretrained: Optional[str] = field(None, "local diffusers pipeline directory; unset = the tiny offline pipeline (built once into the cache)")
    cache_dir: Optional[str] = field(None, "where tiny pipelines are built (default ~/.cache/digenrl or $DIGENRL_CACHE)")
    reward: str = field("color", "reward spec, name=weight list, e.g. color=1.0,jpeg_compressibility=0.1")
    clip_path: Optional[str] = field(None, "local CLIP directory for the clip_score reward")
    remote_url: Optional[str] = field(None, "http(s) URL of a reward server for the remote reward")
    prompt_file: Optional[str] = field(None, "text file, one training prompt per line; unset = the colour task's prompts")
    # placement and mechanisms
    mode: Optional[str] = field(None, "digenrl (all four mechanisms; the default), colocated, naive; explicit --placement/--gap/... flags instead give a custom mix")
    placement: Optional[str] = field(None, "colocated (every rank generates then trains) or disaggregated (separate rollout and trainer ranks)")
    nproc: int = field(2, "ranks to self-spawn when not under torchrun; more ranks = more throughput, more memory")
    rollout_ranks: int = field(1, "R: rollout ranks in the disaggregated placement; the other P - R ranks train")
    gap: Optional[bool] = field(None, "GAP: train fragments as they arrive instead of after the whole batch")
    tsp: Optional[bool] = field(None, "TSP: spread each fragment's (sample, timestep) pairs over all trainers in packed forwards")
    tsp_pack: Optional[int] = field(None, "pairs per forward under TSP: larger = fewer, bigger passes (less per-call "
                                    "overhead, better GPU use), more activation memory; unset = 4 with --pretrained, "
                                    "20 for the tiny pipelines (on a CPU per-call overhead dominates; 20 divides the "
                                    "default fragment's 40 pairs, so no padding pairs)")
    tag: Optional[bool] = field(None, "TAG: an idle trainer generates fragments itself when the predictor says the step ends sooner")
    use_async: Optional[bool] = field(None, "TCSS: rollout may generate the next batch with weights one version old", flag="async")
    max_stale_fragments: Optional[int] = field(None, "j: at most this many fragments per step generated one version stale (TCSS); "
                                               "unset = one per rollout rank. Larger hides more of the weight round trip, "
                                               "but more of each batch is trained off-policy")
    fsdp: bool = field(False, "shard the trainer transformer with FSDP2 over the trainer group (needs --tsp)")
    fragment_groups: int = field(1, "groups per fragment: smaller = finer pipelining, more messages and smaller forwards")
    # the RL problem size
    steps: int = field(200, "RL steps (optimizer steps)")
    prompts_per_step: int = field(3, "B: prompts (groups) per step")
    group_size: int = field(8, "G: samples per prompt; larger = better advantage estimates, more compute")
    num_steps: int = field(6, "T: SDE sampling steps per trajectory")
    timestep_fraction: float = field(1.0, "fraction of the sampling steps that are trained (T_train); smaller = cheaper training, noisier gradient")
    noise_level: Optional[float] = field(None, "SDE noise level a (Flow-GRPO) or eta (DanceGRPO): more exploration, "
                                         "lower image quality; unset = 0.7 (Flow-GRPO's) with --pretrained, 0.5 for the "
                                         "tiny pipelines (measured: at 0.7 the tiny video models barely learned the "
                                         "colour task in 200 steps, the added noise decides their colours)")
    algo: str = field("flow_grpo", "flow_grpo (default) or dance_grpo (constant eta, shared group noise, random timestep subset)")
    resolution: int = field(0, "image height = width in pixels; 0 = the family's tiny default (32)")
    frames: int = field(0, "video frames (video families); 0 = the family default")
    guidance: Optional[float] = field(None, "embedded guidance (FLUX, HunyuanVideo) or true-CFG scale (Qwen-Image, Wan); unset = family default")
    text_len: int = field(512, "max text tokens (capped by the tokenizer); longer = slower text encoding, more memory")
    # optimisation
    lr: float = field(3e-3, "AdamW learning rate (tiny full fine-tuning learns at 3e-3; real LoRA runs use ~1e-4)")
    clip_range: float = field(1e-2, "PPO clip range on the averaged log-prob ratio (Flow-GRPO uses 1e-4 on real models)")
    max_grad_norm: float = field(1.0, "gradient norm clip")
    beta: float = field(0.0, "KL weight to the reference policy; >0 costs one more forward per pair")
    adv_clip: float = field(5.0, "advantages are clipped to +-adv_clip")
    weight_decay: float = field(0.0, "AdamW weight decay")
    lora: Optional[bool] = field(None, "LoRA on the transformer (--no-lora trains all weights); unset = off for tiny pipelines, on for --pretrained")
    lora_rank: int = field(32, "LoRA rank: larger = more capacity and bigger weight publishes")
    lora_alpha: float = field(64.0, "LoRA alpha (scale = alpha / rank)")
    lora_targets: str = field("attention", "attention (Flow-GRPO's projections of the family) or all-linear (every linear in the blocks)")
    grad_ckpt: bool = field(False, "gradient checkpointing in the trainer: less memory, ~30%% more compute")
    max_bad_steps: int = field(3, "abort after this many optimizer steps in a row with a non-finite loss or gradient")
    # machine
    device: str = field("auto", "auto, cpu or cuda")
    dtype: str = field("auto", "auto (bfloat16 on cuda, float32 on cpu), float32 or bfloat16")
    threads: int = field(1, "torch CPU threads per rank")
    timeout_s: float = field(300.0, "bound on every blocking wait (collectives, store, receives): a dead peer ends the job within it")
    seed: int = field(0, "seed of prompts order and noise: the same seed gives the same trajectories in every mode")
    # run directory
    run_name: Optional[str] = field(None, "runs/<run_name>; unset = model-mode-timestamp")
    out_dir: str = field("runs", "parent folder of run directories")
    eval_every: int = field(10, "deterministic evaluation every N steps and before the first (0 = never); each costs "
                            "one generation of eval_seeds samples per training and held-out prompt")
    eval_seeds: int = field(8, "evaluation samples per prompt (the same held-out noises for every prompt): more = a "
                            "steadier eval_reward and wider eval grids, more time per evaluation")
    save_every: int = field(50, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = field(2, "keep the last N checkpoints")
    resume: Optional[str] = field(None, "run directory to resume from its last checkpoint")
    tensorboard: bool = field(False, "also log metrics to TensorBoard in the run directory")
    trace: Optional[bool] = field(None, "record per-rank spans -> trace.json + timeline.png; unset = on for runs of <= 200 steps")
    progress: bool = field(True, "tqdm progress bar on the leader")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="digenrl: disaggregated Flow-GRPO for diffusion models",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.metadata.get("flag", f.name).replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind in ("bool", "Optional[bool]"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            caster = {"int": int, "Optional[int]": int, "float": float, "Optional[float]": float}.get(kind, str)
            parser.add_argument(flag, dest=f.name, type=caster, default=f.default, help=f.metadata["help"])
    return parser


def parse_args(argv=None) -> Config:
    return Config(**vars(build_parser().parse_args(argv)))


def resolve(cfg: Config) -> Config:
    """Fill the derived defaults (mode -> mechanism flags, LoRA auto, trace auto); returns a new Config."""
    c = dataclasses.replace(cfg)
    given = {name: getattr(c, name) for name in MECHANISM_FIELDS if getattr(c, name) is not None}
    if c.mode is None and not any(given.values()):  # nothing, or only --no-X flags: DigenRL minus those
        c.mode = "digenrl"
    if c.mode is not None:
        if c.mode not in MODES:
            raise ValueError(f"--mode {c.mode!r} is not one of {', '.join(MODES)}")
        preset = dict(zip(MECHANISM_FIELDS, MODES[c.mode]))
        for name, value in {**preset, **given}.items():  # explicit flags override the mode's preset
            setattr(c, name, value)
        if any(preset[name] != value for name, value in given.items()):
            c.mode = "custom"  # e.g. --mode digenrl --no-async: label the run by what it really ran
    else:
        c.mode = "custom"
        c.placement = c.placement or "disaggregated"
        for name in MECHANISM_FIELDS[1:]:
            setattr(c, name, bool(getattr(c, name)))
    if c.lora is None:
        c.lora = c.pretrained is not None
    if c.tsp_pack is None:
        c.tsp_pack = 4 if c.pretrained is not None else 20
    if c.noise_level is None:
        c.noise_level = 0.7 if c.pretrained is not None else 0.5
    if c.max_stale_fragments is None:
        c.max_stale_fragments = c.rollout_ranks
    if c.trace is None:
        c.trace = c.steps <= 200
    return c


def _bad(message: str):
    raise ValueError(message)


def validate(c: Config, world_size: int) -> None:
    """Raise ValueError naming the first bad value. Cheap checks only; runs before spawning ranks."""
    import models
    import rewards

    models.get_family(c.model).check_frames(c.frames)
    for name in ("steps", "prompts_per_step", "group_size", "fragment_groups", "tsp_pack", "lora_rank", "threads",
                 "keep_checkpoints", "nproc", "eval_seeds"):
        if getattr(c, name) < 1:
            _bad(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(c, name)}")
    if c.group_size < 2:
        _bad(f"--group-size must be >= 2 (advantages compare samples within a group), got {c.group_size}")
    if c.num_steps < 2:
        _bad(f"--num-steps must be >= 2 sampling steps, got {c.num_steps}")
    if not 0 < c.timestep_fraction <= 1:
        _bad(f"--timestep-fraction must be in (0, 1], got {c.timestep_fraction}")
    for name in ("lr", "clip_range", "max_grad_norm", "timeout_s", "adv_clip"):
        value = getattr(c, name)
        if not (math.isfinite(value) and value > 0):
            _bad(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not (math.isfinite(c.noise_level) and c.noise_level > 0):
        _bad(f"--noise-level must be > 0 for training (the SDE needs noise), got {c.noise_level}")
    if c.beta < 0 or c.max_stale_fragments < 0 or c.eval_every < 0 or c.save_every < 0 or c.max_bad_steps < 1:
        _bad("--beta, --max-stale-fragments, --eval-every and --save-every must be >= 0 and --max-bad-steps >= 1")
    if c.algo not in ("flow_grpo", "dance_grpo"):
        _bad(f"--algo {c.algo!r} is not one of flow_grpo, dance_grpo")
    if c.lora_targets not in ("attention", "all-linear"):
        _bad(f"--lora-targets {c.lora_targets!r} is not one of attention, all-linear")
    if c.device not in ("auto", "cpu", "cuda"):
        _bad(f"--device {c.device!r} is not one of auto, cpu, cuda")
    if c.dtype not in ("auto", "float32", "bfloat16"):
        _bad(f"--dtype {c.dtype!r} is not one of auto, float32, bfloat16")
    if c.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            _bad("--device cuda was asked for but torch sees no CUDA device")
    if c.resolution and (c.resolution < 16 or c.resolution % 16):
        _bad(f"--resolution must be a multiple of 16 (>= 16), got {c.resolution}")
    if c.prompts_per_step % c.fragment_groups:
        _bad(f"--fragment-groups {c.fragment_groups} must divide --prompts-per-step {c.prompts_per_step} "
             "(a fragment is a whole number of groups and a step a whole number of fragments)")
    if c.placement not in ("colocated", "disaggregated"):
        _bad(f"--placement {c.placement!r} is not one of colocated, disaggregated")
    if c.placement == "disaggregated":
        if world_size < 2:
            _bad(f"the disaggregated placement needs at least 2 ranks (one rollout, one trainer); got {world_size}")
        if not 1 <= c.rollout_ranks < world_size:
            _bad(f"--rollout-ranks {c.rollout_ranks} must be between 1 and {world_size - 1} for {world_size} ranks "
                 "(at least one rank must train)")
    elif any((c.gap, c.tsp, c.tag, c.use_async)):
        _bad("--gap, --tsp, --tag and --async need --placement disaggregated (colocated ranks do both jobs)")
    if c.fsdp and not c.tsp:
        _bad("--fsdp needs --tsp: FSDP requires every trainer to run the same number of passes, which only TSP guarantees")
    trainers = world_size - c.rollout_ranks
    if c.fsdp and c.tag and c.fragment_groups < trainers:
        _bad(f"--fsdp with --tag needs --fragment-groups >= the {trainers} trainer ranks (got {c.fragment_groups}): "
             "every FSDP rank must run the same forwards, so each trainer generates at least one group of a TAG fragment")
    if c.tag and not (c.gap and c.tsp):
        _bad("--tag needs --gap and --tsp (the trainer group generates while it waits for streamed fragments, "
             "then trains them spread over all trainers)")
    spec = rewards.parse_reward_spec(c.reward)
    rewards.check_reward_options(c.reward, reward_options(c))
    if c.prompt_file is not None:
        load_prompts(c.prompt_file)
    if c.pretrained is not None:
        models.get_family(c.model).check_pretrained(c.pretrained)
    if c.resume is not None:
        from infra import rundir as runio
        runio.check_resume(c.resume, c)
    del spec


def reward_options(c: Config):
    import rewards
    return rewards.RewardOptions(clip_path=c.clip_path, remote_url=c.remote_url)


def load_prompts(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompt-file {path!r} cannot be read: {exc}") from exc
    if not prompts:
        raise ValueError(f"--prompt-file {path!r} has no prompts (one per line expected)")
    return prompts


def to_json(c: Config) -> str:
    return json.dumps(dataclasses.asdict(c), indent=1, sort_keys=True)


def from_dict(d: dict) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in d.items() if k in names})


def default_run_name(c: Config) -> str:
    import time
    return f"{c.model}-{c.mode}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
