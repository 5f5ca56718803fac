"""What comes from outside, parsed and checked: the command line (config.py's parser, a --config
file's or a --resume run's saved settings under it), every check of a Config (`validate`: a bad value
is refused with one line naming it and what is allowed, before any rank is spawned), the refusals
with the command to run instead, and the run-directory lock.

Validation lives here, not in config.py or a file of its own: config.py stays the options (the
fields, their help strings, the modes), and the one place that parses untrusted input is the one
that checks it. It is top level because it reads config.py, which nothing under infra/ may.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys

import torch

import comm
import config
import grpo
import models
import rewards
from flowgrpo import presets
from fragment import largest_seed
from infra import emulate, lifeline, rundir
from infra.launch import main_module, start_method_for
from infra.node_fetch import NodeFetch
from infra.runlock import RunLock, check_new_run
from infra.tracking import check_wandb_login
from models import lora
from rollout import SamplingConfig, num_train_timesteps

ONE_RANK = ("[digenrl] one rank: running colocated (generate, then train, on this rank); the disaggregated modes "
            "need 2+ ranks: torchrun --nproc_per_node=2 main.py ... or python main.py --nproc 2 ...")


def needs_two_ranks(argv, world: int) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
        command = "torchrun --nproc_per_node=2 main.py " + " ".join(args)
    else:
        for flag in ("--nproc",):  # drop the one-rank setting, then ask for two
            while flag in args and args.index(flag) + 1 < len(args):
                del args[args.index(flag):args.index(flag) + 2]
        args = [a for a in args if not a.startswith("--nproc=")]
        command = "python main.py " + " ".join([*args, "--nproc", "2"])
    return (f"the disaggregated placement needs at least 2 ranks (one rollout, one trainer); got {world}. Run: "
            f"{command.strip()} (or --mode colocated for one rank)")


def run_path(cfg) -> str:
    return cfg.resume or os.path.join(cfg.out_dir, cfg.run_name)


def leader_rank(cfg, world: int) -> int:
    """The rank that writes the run directory (comm.Groups.leader): the first trainer."""
    return 0 if cfg.placement == "colocated" or world == 1 else cfg.rollout_ranks


def lock_run_dir(cfg) -> RunLock:
    """One job per run directory, taken before anything is written (infra/runlock.py); a new run's directory must
    not hold a run already (checked again under the lock: two jobs may have asked for the same name at once)."""
    lock = RunLock.acquire(run_path(cfg))
    if cfg.resume is None:
        try:
            check_new_run(run_path(cfg))
        except ValueError:
            lock.release()
            raise
    return lock


def run_path_before_reading(argv) -> tuple[str | None, bool, bool]:
    """(the run directory the command line names, whether it asks for a dry run, whether it resumes), found
    without reading that directory: --resume RUN, or --out-dir/--run-name (a --config file's settings under the
    flags: that file is read, no run directory is); None for a new run's default name, made up later."""
    parser = config.build_parser()
    args = parser.parse_args(config.negative_numbers_joined(parser, list(sys.argv[1:] if argv is None else argv)))
    if args.resume is not None:
        return args.resume, bool(args.dry_run), True
    merged = config.parse_args(argv)
    check_run_name(merged.run_name)  # before a directory is made for it
    named = os.path.join(merged.out_dir, merged.run_name) if merged.run_name else None
    return named, bool(merged.dry_run), False


def prepare(argv=None, fetch=None) -> config.Config:
    """Parse, resolve and validate; raises ValueError/FileNotFoundError with a clear message on bad input.
    fetch(cfg) runs before validation (which reads --pretrained): under torchrun, infra/node_fetch.py's one
    download per node."""
    parsed = config.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", parsed.nproc))
    cfg = config.resolve(parsed, world=world)
    if fetch is not None:
        fetch(cfg)
    if cfg.placement == "disaggregated" and world < 2:  # asked for explicitly (the default falls back to colocated)
        raise ValueError(needs_two_ranks(argv, world))
    validate(cfg, world)
    if world == 1 and parsed.mode is None and parsed.placement is None:  # the default mode, on one rank
        print(ONE_RANK, file=sys.stderr, flush=True)
    if cfg.run_name is None and cfg.resume is None:
        cfg.run_name = rundir.default_run_name(cfg)
    return cfg


def main(argv, run_rank, launch) -> int:
    """main.py's entry: lock the run directory the command line names (before reading any of it), validate (exit 2
    with one line on bad input), then run_rank here (torchrun, or one rank) or launch(run_rank, ...) to spawn
    --nproc ranks, which inherit the lock."""
    torchrun = "RANK" in os.environ
    if "TORCHELASTIC_RUN_ID" in os.environ:
        lifeline.die_with_parent()  # a rank of torchrun dies with its agent
    fetch = NodeFetch.under_torchrun(os.environ) if torchrun else None  # a Hub id: one download per node
    lock = None
    try:
        try:
            named, dry_run, resuming = run_path_before_reading(argv)
            if named is not None and (torchrun or dry_run):
                RunLock.check_free(named)  # takes nothing: a dry run writes nothing, torchrun's leader locks below
            elif named is not None:
                lock = RunLock.acquire(named, create=not resuming)
            cfg = prepare(argv, fetch)
            world = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc
            rank = int(os.environ["RANK"]) if torchrun else 0
            print(f"[digenrl] {presets.describe(cfg)}", flush=True)
            if cfg.dry_run:  # a dry run writes nothing (and took no lock)
                print(f"[digenrl] dry run, nothing started; config {rundir.to_json(cfg)}", flush=True)
                return 0
            if rank == leader_rank(cfg, world) or not torchrun:  # the process that writes the run directory
                lock = lock or lock_run_dir(cfg)
                room = rundir.checkpoint_bytes_estimate(cfg) * (cfg.keep_checkpoints + 1)  # + the one written
                rundir.check_free_space(run_path(cfg), room)
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if cfg.pretrained is None:  # build the tiny pipeline once, before ranks race for it
            models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
        if torchrun:
            return run_rank(cfg, rank, world, int(os.environ.get("LOCAL_RANK", 0)),
                            (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                            store=fetch.store)
        if cfg.nproc == 1:
            return run_rank(cfg, 0, 1, 0, ("127.0.0.1", 0), agent_store=False)
        role_of = functools.partial(comm.role_of, cfg.placement, cfg.rollout_ranks, world=cfg.nproc)
        preload = tuple(m for m in (main_module(), models.get_family(cfg.model).pipeline_module) if m)
        return launch(run_rank, dataclasses.asdict(cfg), cfg.nproc, threads=cfg.threads, role_of=role_of,
                      start_method=start_method_for(cfg.device), preload=preload, held_fd=lock.fd if lock else None)
    finally:
        if lock is not None:
            lock.release()


# --- validation: every check of a Config, before any rank is spawned --------------------------------

def _bad(message: str):
    raise ValueError(message)


def validate(c: config.Config, world_size: int) -> None:
    """Raise ValueError naming the first bad value. Cheap checks only; runs before spawning
    ranks."""
    family = models.get_family(c.model)
    family.check_frames(c.frames)
    _check_numbers(c)
    _check_choices(c)
    _check_advantages(c)
    _check_batches(c)
    _check_model(c, family)
    _check_logging(c)
    _check_placement(c, world_size)
    _check_inputs(c, family, world_size)


MAX_LR = 1.0  # AdamW and SGD steps beyond the weights' own scale are no training
MIN_TIMEOUT_S = 1.0  # liveness beats every timeout / 5 s: below ~1 s a GIL pause reads as a freeze
MAX_SIDE = 4096  # pixels: native sizes are at most 1280 (a 65536 px reward probe was 96 GiB)
MAX_FRAMES = 1025  # video frames (Wan 81, HunyuanVideo 129 at most in their releases)
RANKS_PER_CORE = 8  # self-spawned ranks are processes on this host, each with its own model
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


def _check_numbers(c: config.Config) -> None:
    for name in (("steps", "prompts_per_step", "group_size", "fragment_groups", "tsp_pack",
                  "threads", "keep_checkpoints", "nproc", "eval_seeds", "text_len")
                 + (("lora_rank",) if c.lora else ())):
        if getattr(c, name) < 1:
            _bad(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(c, name)}")
    cores = os.cpu_count() or 1
    if c.threads > cores:
        _bad(f"--threads {c.threads}: at most the {cores} CPU cores of this host (torch threads "
             "per rank)")
    if c.nproc > RANKS_PER_CORE * cores:
        _bad(f"--nproc {c.nproc}: at most {RANKS_PER_CORE * cores} ranks ({RANKS_PER_CORE} per CPU "
             "core of this host) are spawned here; for more ranks use torchrun on several hosts")
    if not (math.isfinite(c.weight_decay) and c.weight_decay >= 0):
        _bad(f"--weight-decay must be a finite number >= 0, got {c.weight_decay}")
    if c.lr > MAX_LR:
        _bad(f"--lr must be a positive number <= {MAX_LR:g}, got {c.lr}")
    # every seed derived from it stays an int64 and below the held-out evaluation seeds
    largest = min(largest_seed(c.steps, c.prompts_per_step * c.group_size),
                  SEED_LIMIT - 1)
    if not 0 <= c.seed <= largest:
        _bad(f"--seed must be an integer in [0, {largest}] (every seed derived from it stays an "
             f"int64 over {c.steps} steps and below the held-out evaluation seeds), "
             f"got {c.seed}")
    for name in ("resolution", "width"):
        if getattr(c, name) > MAX_SIDE:
            _bad(f"--{name} must be at most {MAX_SIDE} pixels, got {getattr(c, name)}")
    if c.frames > MAX_FRAMES:
        _bad(f"--frames must be at most {MAX_FRAMES}, got {c.frames}")
    if c.group_size < 2:
        _bad("--group-size must be >= 2 (advantages compare samples within a group), "
             f"got {c.group_size}")
    if c.num_steps < 2:
        _bad(f"--num-steps must be >= 2 sampling steps, got {c.num_steps}")
    if not 0 < c.timestep_fraction <= 1:
        _bad(f"--timestep-fraction must be in (0, 1], got {c.timestep_fraction}")
    num_train_timesteps(SamplingConfig(num_steps=c.num_steps, noise_level=c.noise_level,
                                       timestep_fraction=c.timestep_fraction,
                                       algo=c.algo))  # T_train >= 1
    for name in ("lr", "clip_range", "max_grad_norm", "timeout_s", "adv_clip", "stop_grace_s",
                 *(["excused_timeout_s"] if c.excused_timeout_s is not None else [])):
        value = getattr(c, name)
        if not (math.isfinite(value) and value > 0):
            _bad(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if c.timeout_s < MIN_TIMEOUT_S:
        _bad(f"--timeout-s must be at least {MIN_TIMEOUT_S:g} s (it must exceed one forward or "
             f"pack), got {c.timeout_s}")
    if not (math.isfinite(c.noise_level) and c.noise_level > 0):
        _bad(f"--noise-level must be > 0 for training (the SDE needs noise), got {c.noise_level}")
    if not 1 <= c.updates_per_batch <= c.prompts_per_step:
        _bad(f"--updates-per-batch must be between 1 and --prompts-per-step {c.prompts_per_step} "
             f"(a minibatch is whole groups), got {c.updates_per_batch}")
    if c.prompt_cache_size < 0:
        _bad(f"--prompt-cache-size must be >= 0 (0 = no cache), got {c.prompt_cache_size}")
    if not 0 <= c.ema_decay < 1 or c.ema_every < 1:
        _bad(f"--ema-decay {c.ema_decay} must be in [0, 1) and --ema-every {c.ema_every} >= 1")
    if c.eval_num_steps is not None and c.eval_num_steps < 1:
        _bad(f"--eval-num-steps {c.eval_num_steps} must be >= 1 (or unset: --num-steps)")
    if c.eval_guidance is not None and not c.eval_guidance >= 0:
        _bad(f"--eval-guidance {c.eval_guidance} must be >= 0 (or unset: the training guidance)")
    if (c.beta < 0 or c.max_stale_fragments < 0 or c.eval_every < 0 or c.save_every < 0
            or c.max_bad_steps < 1):
        _bad("--beta, --max-stale-fragments, --eval-every and --save-every must be >= 0 and "
             "--max-bad-steps >= 1")


def _check_choices(c: config.Config) -> None:
    if c.optimizer not in ("adamw", "sgd"):
        _bad(f"--optimizer {c.optimizer!r} is not one of adamw, sgd")
    if c.algo not in ("flow_grpo", "dance_grpo"):
        _bad(f"--algo {c.algo!r} is not one of flow_grpo, dance_grpo")
    if c.backend not in ("auto", "nccl", "gloo"):
        _bad(f"--backend {c.backend!r} is not one of auto, nccl, gloo")
    if c.backend == "nccl" and c.device == "cpu":
        _bad("--backend nccl needs CUDA tensors; with --device cpu use --backend gloo (or auto)")
    if c.device not in ("auto", "cpu", "cuda"):
        _bad(f"--device {c.device!r} is not one of auto, cpu, cuda")
    if c.dtype not in ("auto", "float32", "bfloat16", "fp16-autocast"):
        _bad(f"--dtype {c.dtype!r} is not one of auto, float32, bfloat16, fp16-autocast")
    if c.device == "cuda":
        if not torch.cuda.is_available():
            _bad("--device cuda was asked for but torch sees no CUDA device")


def _check_advantages(c: config.Config) -> None:
    if c.global_std and c.per_prompt_stat_tracking is not True:
        state = ("unset (per-group statistics)" if c.per_prompt_stat_tracking is None
                 else "off (the std is the batch's already)")
        _bad(f"--global-std needs --per-prompt-stat-tracking (Flow-GRPO's tracker option); "
             f"it is {state}")
    if not (math.isfinite(c.collapsed_std) and c.collapsed_std >= 0):
        _bad(f"--collapsed-std must be a number >= 0 (0 = only all-equal groups), "
             f"got {c.collapsed_std}")
    if c.collapsed_groups not in ("drop", "floor"):
        _bad(f"--collapsed-groups {c.collapsed_groups!r} is not one of drop, floor")
    if c.collapsed_groups == "floor" and c.collapsed_std == 0:
        _bad("--collapsed-groups floor with --collapsed-std 0 floors nothing: give the floor, "
             "e.g. --collapsed-std 0.01")


SEED_LIMIT = 2**22  # trajectory seeds stay below rollout.EVAL_SEED (tests/test_evaluation.py)
STEPS_LIMIT = 2**28


def _check_batches(c: config.Config) -> None:
    """The Flow-GRPO training-step choices, and the sample and evaluation batch sizes."""
    for name, value, allowed in (("kl-scale", c.kl_scale, grpo.KL_SCALES),
                                 ("old-log-prob", c.old_log_prob, ("rollout", "fresh")),
                                 ("minibatches", c.minibatches, ("samples", "groups")),
                                 ("eval-split", c.eval_split, ("test", "train+test"))):
        if value not in allowed:
            _bad(f"--{name} {value!r} is not one of {', '.join(allowed)}")
    if c.drop_zero_advantage and (c.minibatches != "samples" or c.per_prompt_stat_tracking is None):
        _bad("--drop-zero-advantage keeps the samples of nonzero batch advantage and re-divides "
             "them into the minibatches: it needs --minibatches samples and batch statistics "
             f"(--[no-]per-prompt-stat-tracking); got --minibatches {c.minibatches}, "
             f"--per-prompt-stat-tracking {c.per_prompt_stat_tracking}")
    if not c.steps < STEPS_LIMIT:
        _bad(f"--steps {c.steps} must be below {STEPS_LIMIT}: training noise seeds then never "
             "reach the held-out evaluation ones")
    if c.ema_repeats < 1 or c.weight_decay < 0:
        _bad(f"--ema-repeats {c.ema_repeats} must be >= 1 and --weight-decay {c.weight_decay} "
             ">= 0")
    for name in ("sample_batch_size", "eval_batch_size"):
        if getattr(c, name) < 0:
            _bad(f"--{name.replace('_', '-')} must be >= 0 (0 = all at once), got "
                 f"{getattr(c, name)}")
    call = c.fragment_groups * c.group_size  # the trajectories a rollout rank generates per call
    if c.sample_batch_size and call % c.sample_batch_size:
        fits = [d for d in range(1, call + 1) if call % d == 0]
        _bad(f"--sample-batch-size {c.sample_batch_size} does not divide a fragment's {call} "
             f"trajectories (--fragment-groups {c.fragment_groups} x --group-size {c.group_size}): "
             f"every forward would not be full; use one of {fits}, or change --fragment-groups")


def _check_model(c: config.Config, family) -> None:
    lora.check_targets_spec(c.lora_targets)
    if c.eval_prompts < 0:
        _bad(f"--eval-prompts must be >= 0 (0 = all), got {c.eval_prompts}")
    if c.init_lora is not None and c.resume is None:  # a resumed run starts from its checkpoint
        path = (models.resolve_pretrained(c.model, c.pretrained) if c.pretrained
                else models.tiny_pipeline_path(c.model, c.cache_dir))
        lora.check_init_lora(c.init_lora, c.lora, c.lora_rank, c.lora_alpha, family, path,
                             c.lora_targets)
    if c.resolution and (c.resolution < 16 or c.resolution % 16):
        _bad(f"--resolution must be a multiple of 16 (>= 16), got {c.resolution}")
    if not c.train_cfg and not family.uses_true_cfg:
        _bad(f"--no-train-cfg: {c.model} is guidance-distilled (one branch, guidance embedded), so "
             "there is no CFG to drop in training; it applies to sd3, qwenimage and wan")
    if c.width and (c.width < 16 or c.width % 16):
        _bad(f"--width must be a multiple of 16 (>= 16), got {c.width}")
    if c.width and c.width != (c.resolution or family.tiny_resolution) and not family.is_video:
        _bad(f"--width {c.width} differs from the height {c.resolution or family.tiny_resolution}: "
             f"{c.model} images are square here (use --resolution alone)")
    named = models.family_of_pipeline(c.pretrained)
    if named is not None and named != c.model:
        _bad(f"--model {c.model} but --pretrained {c.pretrained!r} is a {named} pipeline (its "
             f"model_index.json); pass --model {named} or leave --model out")


def _check_logging(c: config.Config) -> None:
    for flag in ("tensorboard", "wandb"):  # optional integrations: flag = package
        if getattr(c, flag) and importlib.util.find_spec(flag) is None:
            _bad(f"--{flag} needs the {flag} package: pip install -r requirements-extras.txt")
    if c.wandb:
        check_wandb_login()


def _check_placement(c: config.Config, world_size: int) -> None:
    if c.prompts_per_step % c.fragment_groups:
        _bad(f"--fragment-groups {c.fragment_groups} must divide --prompts-per-step "
             f"{c.prompts_per_step} (a fragment is a whole number of groups and a step a whole "
             "number of fragments)")
    if c.placement not in ("colocated", "disaggregated"):
        _bad(f"--placement {c.placement!r} is not one of colocated, disaggregated")
    if c.placement == "disaggregated":
        if world_size < 2:
            _bad("the disaggregated placement needs at least 2 ranks (one rollout, one trainer); "
                 f"got {world_size}")
        if not 1 <= c.rollout_ranks < world_size:
            _bad(f"--rollout-ranks {c.rollout_ranks} must be between 1 and {world_size - 1} for "
                 f"{world_size} ranks (at least one rank must train)")
    elif any((c.gap, c.tsp, c.tag, c.use_tcss)):
        _bad("--gap, --tsp, --tag and --tcss need --placement disaggregated (colocated ranks do "
             "both jobs)")
    if c.fsdp and not c.tsp:
        _bad("--fsdp needs --tsp: FSDP requires every trainer to run the same number of passes, "
             "which only TSP guarantees")
    trainers = world_size - c.rollout_ranks
    if c.fsdp and c.tag and c.fragment_groups < trainers:
        _bad(f"--fsdp with --tag needs --fragment-groups >= the {trainers} trainer ranks "
             f"(got {c.fragment_groups}): every FSDP rank must run the same forwards, so each "
             "trainer generates at least one group of a TAG fragment")
    if c.tag and not (c.gap and c.tsp):
        _bad("--tag needs --gap and --tsp (the trainer group generates while it waits for streamed "
             "fragments, then trains them spread over all trainers)")


def _check_inputs(c: config.Config, family, world_size: int) -> None:
    """--rank-speed, rewards and prompts (a remote reward server gets one request), --pretrained,
    the run dir."""
    emulate.check_rank_speed(c.rank_speed, world_size)
    options = rewards.RewardOptions.of(c)
    rewards.check_reward_options(c.reward, options)
    source = rewards.prompt_source(c)
    if c.eval_every and c.eval_split == "test" and not source.eval:
        _bad(f"--eval-split test, but the prompts ({source.kind}) have no held-out split: "
             f"{source.note or 'give a dataset folder with a test split'}; or --eval-split "
             "train+test (the training prompts from held-out noises)")
    rewards.check_prompts(c.reward, source.train, "the training prompts")
    rewards.check_prompts(c.reward, source.eval, "the evaluation prompts")
    probe = rewards.reward_probe(c, source)  # built once: at Wan's native size, 316 MB of pixels
    rewards.check_custom_rewards(c.reward, probe)
    rewards.check_remote_servers(c.reward, options, probe)  # one request each
    if c.pretrained is not None:
        family.check_pretrained(models.resolve_pretrained(c.model, c.pretrained))
    if c.resume is None:
        check_run_name(c.run_name)
    if c.resume is not None:
        rundir.check_resume(c.resume, c)
    elif c.run_name is not None:
        # a new run must not overwrite one (main.py checks again under the run lock)
        check_new_run(os.path.join(c.out_dir, c.run_name))


def check_run_name(name: str | None) -> None:
    if name is not None and not RUN_NAME.fullmatch(name):
        _bad(f"--run-name {name!r} must be a plain name (letters, digits, '.', '_', '+', '-'; not "
             "starting with '.' or '-'): the run directory is --out-dir/NAME, never outside it")
