"""Reuse a run's saved configuration: `--config runs/x/config.json` (a new run) and `--resume runs/x` (the same run).

    python main.py --config runs/x/config.json --steps 500      # every setting of x, 500 steps, a new run directory
    python main.py --resume runs/x                             # continue x exactly as it was configured
    python main.py --resume runs/x --steps 400 --eval-every 5  # allowed: changes what is run, not what is learned

The saved config.json is the resolved Config a run wrote. Flags given on the command line override it:
- with --config, any flag (the file is a starting point; its run name and resume path are dropped);
- with --resume, only the fields in SAFE_ON_RESUME (how long, how often, where to log, how many ranks, timeouts); a
  flag that changes what the checkpoint's weights and optimizer state mean (model, LoRA config, learning rate,
  batch shape, rewards, prompts, ...) is refused with a message, and each accepted override is printed.
Flags are compared after `resolve`, so repeating the original flags (e.g. --mode digenrl --no-tcss) is no change.

A saved configuration is data from outside (a shared run folder, a file someone sent): every value is checked to have
its field's type, and reward code it names (`--reward my.py:fn`) is neither imported nor run unless the command line
gives that --reward too (`refuse_code_named_by_file`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

SAFE_ON_RESUME = ("steps", "eval_every", "save_every", "keep_checkpoints", "timeout_s", "excused_timeout_s",
                  "stop_grace_s", "progress", "trace",
                  "tensorboard", "wandb", "wandb_project", "wandb_name", "threads", "nproc", "rollout_ranks",
                  "max_stale_fragments", "fsdp", "tsp_pack", "grad_ckpt", "max_bad_steps", "remote_url",
                  "remote_timeout_s", "remote_retries", "remote_batch_size", "eval_prompts", "eval_num_steps",
                  "eval_guidance", "ema", "ema_decay", "ema_every", "cache_dir", "out_dir", "run_name",
                  "sample_batch_size", "eval_batch_size", "eval_split", "ema_repeats")
IDENTITY = ("model", "pretrained", "lora", "lora_rank", "lora_alpha", "lora_targets")  # as infra.rundir.IDENTITY_FIELDS
NOT_SAVED = ("resume", "config", "dry_run")  # describe the invocation, not the run
_UNSET = object()


def given_flags(parser: argparse.ArgumentParser, argv) -> dict:
    """dest -> value of the flags present in argv (argparse leaves attributes already on the namespace alone)."""
    namespace = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})
    parser.parse_args(argv, namespace=namespace)
    return {k: v for k, v in vars(namespace).items() if v is not _UNSET}


def read_saved(path: str, config_cls) -> dict:
    """A config.json as Config keyword arguments (a resolved "custom" mode becomes None: its flags are explicit)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the saved configuration {path!r}: {exc}") from exc
    if not isinstance(saved, dict):
        raise ValueError(f"{path!r} is not a saved configuration (a JSON object of Config fields)")
    names = {f.name for f in dataclasses.fields(config_cls)}
    saved = renamed_fields({k: v for k, v in saved.items() if not k.startswith("_")})  # "_comment" keys: notes
    unknown = sorted(set(saved) - names)
    if unknown:
        print(f"[digenrl] {path}: ignoring fields this version does not have: {', '.join(unknown)}", file=sys.stderr)
    saved = {k: v for k, v in saved.items() if k in names and k not in NOT_SAVED}
    for key in ("remote_url", "remote_protocol", "remote_score_key"):  # several remote rewards as a JSON object
        if isinstance(saved.get(key), dict):  # {"geneval": "http://...", "deqa": "http://..."} -> NAME=VALUE,...
            saved[key] = ",".join(f"{name}={value}" for name, value in saved[key].items())
    if saved.get("mode") == "custom":
        saved["mode"] = None
    _check_types(saved, config_cls, path)
    if "trace" in saved and "kl_scale" not in saved:  # a run saved before issue 39: its training step as it ran
        saved = {**BEFORE_FLOW_GRPO_STEP, **saved}
    return saved


# A run saved before the fields of Flow-GRPO's training step existed (config.json holds every field of its day,
# `trace` among them) ran with these; its resume or copy keeps them, not today's defaults.
BEFORE_FLOW_GRPO_STEP = {"kl_scale": "step", "old_log_prob": "fresh", "minibatches": "groups",
                         "drop_zero_advantage": False, "detach_uncond": False, "ema_repeats": 1,
                         "eval_split": "train+test", "sample_batch_size": 0, "eval_batch_size": 0}


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _check_types(saved: dict, config_cls, path: str) -> None:
    """Each saved value of the type its Config field has (null where it is Optional): a file is data from outside,
    and a 2.5 for "nproc" or "5" for "steps" used to fail later with a traceback."""
    for f in dataclasses.fields(config_cls):
        if f.name not in saved:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        optional = kind.startswith("Optional[")
        kind = kind[len("Optional["):-1] if optional else kind
        value = saved[f.name]
        if value is None and optional:
            continue
        ok = isinstance(value, _TYPES[kind]) and (kind == "bool" or not isinstance(value, bool))
        if not ok:
            allowed = _TYPE_NAMES[kind] + (" or null" if optional else "")
            raise ValueError(f"{path!r}: {f.name!r} must be {allowed}, got {json.dumps(value)[:80]}")


def _custom_reward_names(spec) -> list[str]:
    """The custom reward functions (file.py:fn, package.module:fn) a reward spec names, without importing them."""
    from rewards.custom import is_custom
    if not isinstance(spec, str):
        return []
    return [n for n in (item.partition("=")[0].strip() for item in spec.split(",")) if is_custom(n)]


def refuse_code_named_by_file(saved: dict, given: dict, where: str) -> None:
    """A saved configuration (a run folder's config.json, a --config file) is data: the reward code it names (a
    custom reward imports its file or module, running its Python) runs only when the command line names it too.
    A folder or file someone else can write to would otherwise choose the code this job runs."""
    asked = set(_custom_reward_names(given.get("reward")))
    missing = [n for n in _custom_reward_names(saved.get("reward")) if n not in asked]
    if missing:
        raise ValueError(f"{where} names reward code {', '.join(map(repr, missing))} (a custom reward runs that "
                         f"file's or module's Python): a saved configuration does not choose code to run; give "
                         f"--reward {saved['reward']!r} on the command line to run it")


RENAMED = {"use_async": "use_tcss"}  # old config.json key -> today's field (runs saved before the rename)


def renamed_fields(saved: dict) -> dict:
    """A saved config with its old field names mapped to today's (a value under the new name wins)."""
    out = dict(saved)
    for old, new in RENAMED.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out


def _flag(name: str) -> str:
    return "--" + {"use_tcss": "tcss"}.get(name, name).replace("_", "-")


def merge(parser, argv, config_cls, resolve):
    """Config from argv, on top of --resume RUN's or --config FILE's saved configuration when one is given."""
    args = parser.parse_args(argv)
    if args.resume is None and args.config is None:
        return config_cls(**vars(args))
    given = given_flags(parser, argv)
    if args.resume is not None and args.config is not None:
        raise ValueError("give --resume RUN (which reuses RUN/config.json) or --config FILE, not both")
    if args.config is not None:
        saved = read_saved(args.config, config_cls)
        refuse_code_named_by_file(saved, given, f"--config {args.config!r}")
        saved.pop("run_name", None)  # a new run: a fresh directory, not the saved run's
        return config_cls(**{**saved, **given})
    path = os.path.join(args.resume, "config.json")
    from infra import rundir
    if not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume!r} is not a directory")
    if not rundir.list_checkpoints(args.resume):
        raise ValueError(f"--resume {args.resume!r} has no complete checkpoint under checkpoints/")
    if not os.path.isfile(path):
        raise ValueError(f"--resume {args.resume!r} has no config.json (is it a run directory?)")
    saved = read_saved(path, config_cls)
    refuse_code_named_by_file(saved, given, f"--resume {args.resume!r} (its config.json)")
    before, after = resolve(config_cls(**saved)), resolve(config_cls(**{**saved, **given}))
    changed = [f.name for f in dataclasses.fields(config_cls) if f.name not in NOT_SAVED
               and getattr(before, f.name) != getattr(after, f.name)]
    identity = [k for k in changed if k in IDENTITY]
    if identity:  # the same words as infra.rundir.check_resume
        raise ValueError(f"--resume {args.resume!r} was made with a different model or LoRA config: "
                         + ", ".join(f"{k}: checkpoint {getattr(before, k)!r} vs now {getattr(after, k)!r}"
                                     for k in identity))
    unsafe = [k for k in changed if k not in SAFE_ON_RESUME]
    if unsafe:
        raise ValueError(f"--resume {args.resume!r}: {', '.join(_flag(k) for k in unsafe)} cannot change on resume ("
                         + ", ".join(f"{k}: run {getattr(before, k)!r}, asked {getattr(after, k)!r}" for k in unsafe)
                         + "); it would change what the checkpoint's weights and optimizer state mean. Safe to "
                         f"change: {', '.join(_flag(k) for k in SAFE_ON_RESUME)}. For a new run from these settings: "
                         f"--config {path} plus the new flags")
    for k in changed:
        print(f"[digenrl] --resume: {_flag(k)} {getattr(before, k)!r} -> {getattr(after, k)!r} (from the command line)",
              file=sys.stderr)
    return config_cls(**{**saved, **given, "resume": args.resume})
