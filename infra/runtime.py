"""What every rank sets up before its loop and tears down after it (main.run_rank calls these in order).

    device, dtype = runtime.device_of(cfg, local_rank)
    job = runtime.connect(cfg, rank, world, local_rank, master, agent_store, report_silent, device, roles)
    policy = runtime.load_policy(cfg, device, dtype, groups, job.progress)
    ...the rank's loop...
    runtime.shutdown(job, cfg, groups, tracer, run_dir, device)

The store (sealed with the job's secret: infra/jobstore.py), liveness (infra/liveness.py: started first, so a
rank that never joins the process group is found), the default process group (comm.py chooses its backend) and
preemption (infra/preemption.py); at the end the trace and the last barrier. Every step of it is a named phase
for liveness' report, and a bump once done.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import sys

import torch
import torch.distributed as dist

import comm
import models
from infra.jobstore import SignedStore, job_key
from infra.launch import open_store
from infra.liveness import Liveness
from infra.preemption import Preemption
from infra.progress import STARTING, Progress
from infra.tracing import (Tracer, gather_spans, steps_window, write_chrome_trace,
                           write_timeline_png)


@dataclasses.dataclass
class Job:
    """This rank's connection to the job: None where the world is one rank."""

    store: SignedStore | None  # the job's store, sealed with its secret (infra/jobstore.py)
    watch: Liveness | None  # heartbeats: a dead or frozen peer ends the job, named
    progress: Progress  # what liveness watches (per forward, pack, fragment, tensor, step)
    preemption: Preemption  # the stop request the trainers agree on at a step's end

    def prefixed(self, name: str) -> SignedStore | None:
        return self.store.prefixed(name) if self.store is not None else None

    def phase(self, name: str, fn, *args, **kwargs):
        """fn(*args, **kwargs) inside the named phase liveness reports, then one unit of progress."""
        with self.progress.inside(name):
            result = fn(*args, **kwargs)
        self.progress.bump()
        return result

    def excused(self, name: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), which reports no progress of its own, excused for --excused-timeout-s
        (infra/progress.py), then one unit of progress."""
        with self.progress.excused(name):
            result = fn(*args, **kwargs)
        self.progress.bump()
        return result


def fp16_autocast(cfg, use_cuda: bool) -> bool:
    """--dtype fp16-autocast, or auto on CUDA for SD3 under Flow-GRPO (its base.py mixed_precision "fp16": the
    SD3 transformer and VAE stay float32 (train_sd3.py lines 377-415), accelerate runs the forward under fp16
    autocast, the text encoders in fp16)."""
    return cfg.dtype == "fp16-autocast" or (cfg.dtype == "auto" and use_cuda and cfg.model == "sd3"
                                            and cfg.algo == "flow_grpo")


def device_of(cfg, local_rank: int) -> tuple[str, torch.dtype]:
    """This rank's device (cuda:LOCAL_RANK mod GPUs, or cpu) and the policy dtype (float32 weights under
    fp16_autocast)."""
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.dtype, torch.bfloat16 if use_cuda else torch.float32)
    if fp16_autocast(cfg, use_cuda):
        dtype = torch.float32
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_cudnn_sdp(False)  # docs/DESIGN.md section 7: cuDNN SDPA backward crashed on H200
    return device, dtype


def name_process(name: str) -> None:
    """Set this process's name (Linux, 15 characters) so operators can tell the ranks apart."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def connect(cfg, rank: int, world: int, local_rank: int, master: tuple, agent_store: bool, report_silent,
            device: str, roles: list[str], store=None) -> Job:
    """The store (`store`, if this process opened it already), liveness and the default process group
    (world > 1), and preemption (always)."""
    watch, progress = None, Progress()
    if world > 1:
        if store is None:
            store = open_store(master, world, is_master=(rank == 0 and not agent_store), timeout_s=cfg.timeout_s)
        if not isinstance(store, SignedStore):  # infra/node_fetch.py's is sealed already
            store = SignedStore(store, job_key())  # only the job's ranks read and write it
        watch = Liveness(store.prefixed("liveness"), rank, roles, cfg.timeout_s, report_silent,
                         progress=progress, excused_timeout_s=cfg.excused_timeout_s,
                         stop_grace_s=cfg.stop_grace_s).start()
        with progress.inside("connect"):  # every rank: these wait (NO_DEADLINE) until all have joined
            store.check_peers(rank, world)
            hosts = comm.gather_hosts(store, rank, world)  # the first rank on each host checks it
            if hosts.index(hosts[rank]) == rank and (warning := comm.loopback_data_plane(os.environ, hosts)):
                print(f"[digenrl] warning: {warning}", file=sys.stderr, flush=True)
            use_cuda = device.startswith("cuda")
            gpus = comm.gather_device_identities(store, rank, world, comm.this_device_identity(device)) \
                if use_cuda else []
            backend, why = comm.choose_backend(use_cuda, [gpu for gpu, role in zip(gpus, roles) if role != "rollout"],
                                               cfg.backend)
            if rank == 0:
                print(f"[digenrl] compute plane: {backend} ({why})", flush=True)
            # a C++ PrefixStore over the Python one: torch's new_group asks the default group's store for what
            # only C++ stores implement
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                    timeout=comm.NO_DEADLINE)
        progress.bump()

    def urgent() -> str | None:  # SIGTERM with a peer dead already (torchrun's agent stops the others so)
        return "; ".join(f"{watch.describe(r)} died" for r in watch.dead_local_peers()) if watch else None

    # SIGTERM: stop after the current step with a checkpoint; at once when a peer is dead already, naming it
    preemption = Preemption(store.prefixed("preemption") if store is not None else None, rank, world,
                            urgent=urgent, finishing=watch.finishing if watch is not None else _nothing,
                            hosts_store=rank == 0 and not agent_store,
                            starting=lambda: progress.phase == STARTING,  # nothing to save yet: stop at once
                            on_request=watch.asked_to_stop if watch is not None else _nothing,
                            grace_s=cfg.stop_grace_s if watch is not None else None).start()
    return Job(store, watch, progress, preemption)


def _nothing() -> None:
    pass


def load_policy(cfg, device: str, dtype: torch.dtype, groups: comm.Groups, progress: Progress) -> models.Policy:
    """The policy on this rank: the pipeline, LoRA (same init on every rank) or full training, checkpointing.
    Loading reports no progress of its own (diffusers' from_pretrained): it is excused, for --excused-timeout-s."""
    with progress.excused("load the pipeline"):
        policy = _load_policy(cfg, device, dtype, groups, progress)
    progress.bump()
    return policy


def _load_policy(cfg, device: str, dtype: torch.dtype, groups: comm.Groups, progress: Progress) -> models.Policy:
    path = cfg.pretrained or models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
    policy = models.load(cfg.model, path, device, dtype, height=cfg.resolution or None, width=cfg.width or None,
                         frames=cfg.frames or None, max_sequence_length=cfg.text_len, guidance=cfg.guidance,
                         prompt_cache_size=cfg.prompt_cache_size)
    policy.on_forward = progress.bump  # every transformer forward is progress (generation, evaluation, training)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank (the leader also publishes version 0)
    if cfg.lora:
        models.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        if cfg.init_lora and not cfg.resume:  # every rank starts from the file (a resumed run: from its checkpoint)
            models.load_init_lora(policy.transformer, cfg.init_lora)
    else:
        models.enable_full_training(policy, fp32_master=cfg.fp32_master and groups.is_trainer,
                                    masters_after_sharding=cfg.fsdp)  # each trainer converts only its shard
    if cfg.grad_ckpt and groups.is_trainer:
        policy.transformer.enable_gradient_checkpointing()
    if fp16_autocast(cfg, policy.device.type == "cuda"):
        models.compute_in_fp16(policy)
    return policy


def freeze_heap() -> None:
    """The libraries' and the model's long-lived objects leave the collector's scans: shorter GC pauses, during
    which no thread (the liveness heartbeat included) can run."""
    gc.freeze()


def shutdown(job: Job, cfg, groups: comm.Groups, tracer: Tracer, run_dir, device: str) -> None:
    """After the loops joined their background threads; only the main threads talk from here on."""
    progress = job.progress
    progress.finish()
    if cfg.trace:
        with progress.inside("trace gather"):
            spans = gather_spans(tracer, group=groups.world_data, dst=groups.leader)
        progress.bump()
    else:
        spans = None
    if run_dir is not None:
        with progress.excused("write the trace"):  # the reward curve, the trace and its timeline: no progress
            run_dir.plot_rewards()
            run_dir.close()
            if spans is not None:
                write_chrome_trace(spans, os.path.join(run_dir.path, "trace.json"))
                write_timeline_png(spans, os.path.join(run_dir.path, "timeline.png"),
                                   title=f"{cfg.model} {cfg.mode}")
                few = steps_window(spans, 1, 3)  # after step 0's warm-up: which fragment trains
                if few is not None:              # while which is generated, readable
                    write_timeline_png(few, os.path.join(run_dir.path, "timeline_steps_1-3.png"),
                                       title=f"{cfg.model} {cfg.mode}: steps 1-3")
        progress.bump()
        print(f"[digenrl] done: {run_dir.path}", flush=True)
    if device.startswith("cuda"):
        print(f"[digenrl] rank {groups.rank} ({groups.role}) peak device memory "
              f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    if job.watch is not None:
        job.watch.finishing()
        with progress.inside("last barrier"):
            dist.barrier(group=groups.world_data)
        job.watch.stop()
        dist.destroy_process_group()
    job.preemption.close()
