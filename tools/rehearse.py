"""Rehearse a real run on a CPU: the program's own rank code, the released model at real size under
fake tensors, a world of up to 64 ranks, one full RL step and the next, evaluation, checkpoint,
resume and weight publishing; per rank and phase: peak device and host memory, bytes moved, and the
time an H200 would take (tools/profiles).

    python tools/rehearse.py --model flux --nproc 16 --rollout-ranks 8 --fsdp --no-lora
    python tools/rehearse.py --model wan --nproc 8 --rollout-ranks 4 --grad-ckpt --json wan.json
    python tools/rehearse.py --table docs/rehearsal_table.json     # the README's "what fits where"

Every flag of main.py is taken as main.py takes it (presets for real weights apply: the family's
native size and published settings); --steps is the rehearsal's (default 2: one step, then one
with the optimizer state of the first). How it works: docs/DESIGN.md section 8 and
tools/rehearsal/*.py (the stand-in GPU, the process groups, replayed calls, the seams). The ranks
rehearsed are rollout rank 0 (for all R rollout ranks), the trainer leader, and one other trainer
(for the other K - 1); colocated: ranks 0 and 1. A stand-in rank is symmetric to the rehearsed rank
of its role.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30
GPU_GIB = {"80 GB": 81559 / 1024, "141 GB": 143771 / 1024}  # what nvidia-smi reports (H100, H200)
RESERVE_GIB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation: not tracked
# what a real run runs and the rehearsal does not, and why
SKIPPED = {
    "reward model": "the reward is a function of the prompts (values real, no model): a reward "
                    "model's weights and activations are not counted",
    "text encoding": "the text encoders' weights are counted (one device allocation of their "
                     "size); their activations are not (embeddings of the released shapes appear)",
    "image grids": "the evaluation's PNG/GIF grids are not drawn (fake images have no pixels); "
                   "the images' host memory is counted",
    "SIGTERM stop": "a signal path, not a phase of a step (tests/test_run_life.py runs it)",
    "liveness watchdog": "heartbeats and stall detection are not run; the rehearsal reports a "
                         "deadlock of its own ranks instead",
    "TCSS generate-ahead": "exercised only when the rollout rank finishes claiming a step before "
                           "the next weights arrive (timing); its memory is a fragment's",
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--depth", type=float, default=1.0, help="share of the blocks built (tests)")
    p.add_argument("--no-replay", action="store_true", help="run every call (slow; a check)")
    p.add_argument("--table", default=None, metavar="JSON",
                   help="rehearse every family with LoRA and full fine-tuning; write the rows here")
    p.add_argument("--help", "-h", action="store_true")
    return p.parse_known_args(argv)


def resolve(rest: list[str]):
    """main.py's Config for these flags, as for real weights of the family (presets apply)."""
    import config
    import models

    parsed = config.parse_args(rest)
    if parsed.model is None:
        parsed.model = "flux"
    parsed.pretrained = f"released:{parsed.model}"  # presets.for_run(pretrained=True)
    if "--steps" not in " ".join(rest):
        parsed.steps = 2
    world = parsed.nproc
    cfg = config.resolve(parsed, world=world)
    resolve_id, check = models.resolve_pretrained, models.base.Family.check_pretrained
    models.resolve_pretrained = lambda name, path, local_only=False: path
    models.base.Family.check_pretrained = lambda self, path: None
    try:
        config.validate(cfg, world)
    finally:
        models.resolve_pretrained, models.base.Family.check_pretrained = resolve_id, check
    return cfg


def positions(cfg):
    from tools.rehearsal.groups import Position

    world = cfg.nproc
    if cfg.placement == "colocated":
        return [Position(0, "leader", [0])] + ([Position(1, "colocated", list(range(1, world)))]
                                               if world > 1 else [])
    r = cfg.rollout_ranks
    out = [Position(0, "rollout", list(range(r))), Position(r, "leader", [r])]
    if world - r >= 2:
        out.append(Position(r + 1, "trainer", list(range(r + 1, world))))
    return out


def rehearse(cfg, depth: float = 1.0, replay: bool = True) -> dict:
    """The run (cfg.steps steps, checkpoint at the end), then its resume; the report."""
    import torch.distributed as dist

    from tools.rehearsal import groups, pipeline, ranks

    ranks.install()
    pipeline.classes(cfg.model)
    disk, out = ranks.Disk(), {"jobs": {}}
    run_dir = tempfile.mkdtemp(prefix="rehearsal_")
    run = dataclasses.replace(cfg, out_dir=run_dir, run_name="run", progress=False, wandb=False,
                              tensorboard=False)
    resumed = dataclasses.replace(run, resume=os.path.join(run_dir, "run"), eval_every=0)
    for name, job_cfg in (("run", run), ("resume", resumed)):
        where = positions(job_cfg)
        exchange = groups.Exchange(where, job_cfg.nproc)
        groups.install(exchange)
        trainers = job_cfg.nproc - (0 if job_cfg.placement == "colocated" else job_cfg.rollout_ranks)
        job = ranks.Job(job_cfg, job_cfg.nproc, where, exchange, dist.HashStore(), disk, depth,
                        replay, tag_claims=job_cfg.tag and trainers <= 2)
        start = time.perf_counter()
        contexts = ranks.run_job(job)
        out["jobs"][name] = report_job(job, contexts, time.perf_counter() - start)
        if out["jobs"][name]["failed"]:
            break
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def report_job(job, contexts, seconds: float) -> dict:
    from tools.rehearsal import groups, timing

    rows, failed = {}, []
    cfg = job.cfg
    for p in job.positions:
        ctx = contexts.get(p.rank)
        if ctx is None or ctx.error:
            failed.append({"rank": p.rank, "role": p.role,
                           "error": ctx.error if ctx else "did not finish"})
            continue
        h, traffic = ctx.holdings, job.exchange.traffic[p.rank]
        packs = [d for (_, what, d) in ctx.replay.calls if what == "forward" and d[2]]
        rows[p.rank] = {
            "role": p.role, "stands_for": _ranges(p.represents),
            "peak_device_gib": h.peak["device"] / GIB, "peak_host_gib": h.peak["host"] / GIB,
            "phases": {k: {kind: v / GIB for kind, v in peaks.items()}
                       for k, peaks in sorted(h.phase_peaks.items())},
            "traffic_bytes": _traffic(traffic),
            "checkpoint_bytes_written": job.disk.written.get(p.rank, 0),
            "calls": {" ".join(map(str, (phase, *d[1:]))): n
                      for (phase, what, d), n in sorted(ctx.replay.calls.items(), key=str)},
            "replayed": sum(ctx.replay.replayed.values()),
            "blind_reads": dict(ctx.mode.blind_reads),
            "h200": timing.predict(cfg.model, ctx.replay.calls, traffic, cfg.lora, cfg.grad_ckpt,
                                   packs[0][1] if packs else None)}
    if not failed and job.exchange.failed is not None:
        failed.append({"rank": None, "error": str(job.exchange.failed)})
    trainers = [p.rank for p in job.positions if p.role in ("leader", "trainer", "colocated")]
    if not failed and len(trainers) > 1:
        try:
            groups.check_lockstep(job.exchange, trainers)
        except groups.RehearsalError as error:
            failed.append({"rank": None, "error": str(error)})
    return {"ranks": rows, "failed": failed, "seconds": seconds,
            "world": job.world, "tag_claimed": job.tag_claimed}


def _traffic(counter) -> dict:
    """{"plane what": bytes} over phases, and the publish and fragment bytes apart."""
    out: dict[str, int] = {}
    for (phase, plane, what), n in counter.items():
        out[f"{plane} {what}"] = out.get(f"{plane} {what}", 0) + n
        if phase in ("publish", "send", "recv", "thread weight-mailbox"):
            out[f"{phase} {what}"] = out.get(f"{phase} {what}", 0) + n
    return dict(sorted(out.items()))


def summary(out: dict) -> str:
    """The report as text: per rank and job, memory against the GPUs, the phases' peaks, the
    bytes, the predicted H200 seconds."""
    lines = []
    for name, job in out["jobs"].items():
        lines.append(f"== {name}: world {job['world']}, rehearsed in {job['seconds']:.0f} s"
                     f"{', TAG claimed' if job['tag_claimed'] else ''}")
        for rank, row in job["ranks"].items():
            fits = " / ".join("yes" if row["peak_device_gib"] + RESERVE_GIB <= cap else "no"
                              for cap in GPU_GIB.values())
            lines.append(f"rank {rank} ({row['role']}, stands for ranks {row['stands_for']}): "
                         f"peak device {row['peak_device_gib']:.1f} GiB (fits 80 GB / 141 GB: "
                         f"{fits}), peak host {row['peak_host_gib']:.1f} GiB")
            for phase, peaks in row["phases"].items():
                lines.append(f"    {phase:28s} device {peaks['device']:8.2f}  host "
                             f"{peaks['host']:8.2f} GiB")
            lines.append("    bytes: " + ", ".join(f"{k} {v / 1e9:.3f} GB"
                                                   for k, v in row["traffic_bytes"].items()))
            h200 = row["h200"]
            if "seconds_by_phase" in h200:
                lines.append("    H200 seconds: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in h200["seconds_by_phase"].items())
                    + (f" ({'; '.join(h200['notes'])})" if h200["notes"] else ""))
            else:
                lines.append(f"    H200 seconds: {h200['note']}")
            if row["blind_reads"]:
                lines.append("    device values read as 0 (metrics only): "
                             + ", ".join(f"{k} x{v}" for k, v in row["blind_reads"].items()))
        for f in job["failed"]:
            lines.append(f"FAILED rank {f['rank']}: {f['error'][-4000:]}")
    lines.append("not rehearsed: " + "; ".join(f"{k}: {v}" for k, v in out["skipped"].items()))
    return "\n".join(lines)


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def main(argv=None) -> int:
    args, rest = parse(sys.argv[1:] if argv is None else argv)
    if args.help:
        print(__doc__)
        return 0
    try:
        cfg = resolve(rest)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = rehearse(cfg, args.depth, not args.no_replay)
    out["config"] = dataclasses.asdict(cfg)
    out["skipped"] = SKIPPED
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(summary(out))
    return 1 if any(job["failed"] for job in out["jobs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
