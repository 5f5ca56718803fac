"""The command line around main.py's ranks: refusals with the command to run instead, and the run-directory lock."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import comm
import config
import models
from flowgrpo import presets
from infra import lifeline, rundir
from infra.launch import main_module, start_method_for
from infra.node_fetch import NodeFetch
from infra.runlock import RunLock, check_new_run

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
    config.check_run_name(merged.run_name)  # before a directory is made for it
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
    config.validate(cfg, world)
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
