"""The command line around main.py's ranks: refusals with the command to run instead, and the run-directory lock."""
from __future__ import annotations

import os
import sys

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
