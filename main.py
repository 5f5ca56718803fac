"""digenrl: disaggregated Flow-GRPO for diffusion / flow-matching generators. The CLI and the wiring.

    python main.py --model flux                      # tiny FLUX, colour task, DigenRL mode on 2 CPU ranks
    python main.py --mode colocated --nproc 2        # the colocated baseline
    python main.py --mode naive                      # disaggregated with the full-batch barrier
    torchrun --nproc_per_node=8 main.py --pretrained /models/FLUX.1-dev --rollout-ranks 4 ...

Started as one process it spawns --nproc ranks itself (and watches them: if one dies, all stop and the
exit message names the rank and its role); under torchrun each process is a rank. Every input is
validated before any rank starts. See config.py for every option and README.md for the mechanisms.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time

import config as config_lib


# --- one rank ----------------------------------------------------------------------------------
def run_rank(cfg: config_lib.Config, rank: int, world: int, local_rank: int, master: tuple[str, int], agent_store: bool) -> None:
    import torch
    import torch.distributed as dist

    import gap
    import models
    import rewards
    from infra import rundir as runio
    import runtime
    from rollout import SamplingConfig
    from infra.evaluation import Evaluator
    from infra.tracing import Tracer, gather_spans, write_chrome_trace, write_timeline_png
    from trainer import TrainConfig, Trainer

    torch.set_num_threads(cfg.threads)
    run_path = cfg.resume or os.path.join(cfg.out_dir, cfg.run_name or config_lib.default_run_name(cfg))
    os.makedirs(os.path.join(run_path, "pids"), exist_ok=True)  # so operators (and tests) can find each rank
    with open(os.path.join(run_path, "pids", f"rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()} {role_of(cfg, rank, world)}\n")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.dtype, torch.bfloat16 if use_cuda else torch.float32)
    # NCCL needs one GPU per rank (DESIGN.md section 7); otherwise gloo with host-staged transfers.
    nccl = use_cuda and torch.cuda.device_count() >= world
    comm_device = device if nccl else "cpu"
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_cudnn_sdp(False)  # DESIGN.md section 7: cuDNN SDPA backward crashed on H200
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = None
    if world > 1:
        store = dist.TCPStore(master[0], master[1], world, is_master=(rank == 0 and not agent_store), timeout=timeout)
        dist.init_process_group("nccl" if nccl else "gloo", store=dist.PrefixStore("pg", store),
                                rank=rank, world_size=world, timeout=timeout)
    groups = runtime.build_groups(rank, world, cfg.placement, cfg.rollout_ranks, timeout)
    tracer = Tracer(rank, groups.role, enabled=cfg.trace)
    tracer.align()

    path = cfg.pretrained or models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
    policy = models.load(cfg.model, path, device, dtype, height=cfg.resolution or None, frames=cfg.frames or None,
                         max_sequence_length=cfg.text_len, guidance=cfg.guidance)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank (the leader also publishes version 0)
    if cfg.lora:
        targets = None if cfg.lora_targets == "attention" else _all_linear_targets(policy.transformer)
        models.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, targets)
    else:
        models.enable_full_training(policy)
    if cfg.grad_ckpt and groups.is_trainer:
        policy.transformer.enable_gradient_checkpointing()
    params = [p for p in policy.transformer.parameters() if p.requires_grad]

    reward_fn = rewards.build_reward(cfg.reward, config_lib.reward_options(cfg))
    prompts = config_lib.load_prompts(cfg.prompt_file) if cfg.prompt_file else rewards.color_prompts("train")
    sampling = SamplingConfig(cfg.num_steps, cfg.noise_level, cfg.timestep_fraction, cfg.algo, cfg.adv_clip)
    evaluator = Evaluator(prompts[:8], rewards.color_prompts("eval") if cfg.prompt_file is None else None, sampling,
                          reward_fn, cfg.eval_seeds, run_path, writer=(rank == groups.leader))
    m = cfg.prompts_per_step // cfg.fragment_groups
    queue = gap.FragmentQueue(dist.PrefixStore("queue", store), m, cfg.timeout_s) if store is not None else None
    job = runtime.Job(cfg, groups, policy, prompts, sampling, reward_fn, reward_fn.names, queue, tracer, comm_device)

    trainer = None
    if groups.is_trainer:
        if cfg.fsdp:
            _shard(policy, groups, keep_reference=cfg.beta > 0 and not cfg.lora)
        trainer = Trainer(policy, TrainConfig(cfg.lr, cfg.weight_decay, 1e-8, cfg.clip_range, cfg.max_grad_norm, cfg.beta,
                                              cfg.noise_level, cfg.algo, cfg.max_bad_steps),
                          group=groups.trainer, comm_device=comm_device, sharded=cfg.fsdp)
    if cfg.resume:
        ckpt = runio.check_resume(cfg.resume, cfg)
        state = torch.load(os.path.join(ckpt, "state.pt"), map_location="cpu", weights_only=False)
        job.start_step = state["step"]
        if trainer is not None:  # rollout ranks get the weights from the leader's first publish
            trainer.load_checkpoint_state(state)  # re-shards under FSDP
            trainer.version = state["step"]
        runio.set_rng_state(state["rng"])

    run_dir, bar = None, None
    if rank == groups.leader:
        run_dir = runio.RunDir(run_path, config_lib.to_json(cfg), cfg.tensorboard, cfg.keep_checkpoints)
        if cfg.resume:
            run_dir.truncate_metrics(job.start_step)
        print(f"[digenrl] run dir {run_path}\n[digenrl] config {json.dumps(dataclasses.asdict(cfg), sort_keys=True)}", flush=True)
        if cfg.progress:
            from tqdm import tqdm
            bar = tqdm(total=cfg.steps, initial=job.start_step, desc=f"{cfg.model} {cfg.mode}", dynamic_ncols=True)
    initial_eval = {}  # the policy the run starts from, logged in the first row as eval_reward_initial, ...
    if cfg.eval_every and groups.is_trainer and (rank == groups.leader or cfg.fsdp):
        with tracer.span("eval", step=job.start_step):
            initial_eval = {f"{k}_initial": v for k, v in evaluator(policy, job.start_step).items()}
    last = {"t": time.perf_counter()}

    def on_step_end(step, metrics, trainer):
        if rank != groups.leader and not cfg.fsdp:  # under FSDP, evaluation and checkpoint gathering are collectives
            return
        metrics.update(step_time_s=time.perf_counter() - last["t"], version=trainer.version)
        state = None
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            with tracer.span("eval", step=step):
                metrics.update(evaluator(policy, step + 1))  # eval_reward, eval_reward_heldout_prompts; grids
        if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
            with tracer.span("checkpoint", step=step):
                state = trainer.checkpoint_state()
        if rank == groups.leader:
            metrics.update(initial_eval)
            initial_eval.clear()
            run_dir.log(step, metrics)
            if state is not None:
                with tracer.span("checkpoint", step=step):
                    state.update(step=step + 1, rng=runio.rng_state(), identity=runio.identity(cfg),
                                 config=dataclasses.asdict(cfg))
                    lora = models.lora_state_for_diffusers(policy.transformer, state["weights"]) if cfg.lora else None
                    run_dir.save_checkpoint(step + 1, state, lora, policy.family.pipeline_class())
                run_dir.plot_rewards()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tag=int(metrics["tag_fragments"]),
                            stale=int(metrics["stale_fragments"]))
        last["t"] = time.perf_counter()  # step_time_s excludes evaluation and checkpointing

    job.on_step_end = on_step_end
    if groups.role == "colocated":
        runtime.run_colocated(job, trainer)
    elif groups.is_trainer:
        runtime.run_trainer(job, trainer)
    else:
        runtime.run_rollout(job, params)
    if bar is not None:
        bar.close()

    spans = gather_spans(tracer, dst=groups.leader) if cfg.trace else None
    if run_dir is not None:
        run_dir.plot_rewards()
        if spans is not None:
            write_chrome_trace(spans, os.path.join(run_dir.path, "trace.json"))
            write_timeline_png(spans, os.path.join(run_dir.path, "timeline.png"), title=f"{cfg.model} {cfg.mode}")
        print(f"[digenrl] done: {run_dir.path}", flush=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _all_linear_targets(transformer) -> list[str]:
    import torch
    return sorted({name.split(".")[-1] for name, mod in transformer.named_modules()
                   if isinstance(mod, torch.nn.Linear) and ("blocks" in name)})


def _shard(policy, groups, keep_reference: bool) -> None:
    """FSDP2 over the trainer group: each transformer block is a unit (gathered only while it runs), then the root."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if keep_reference and policy.reference_transformer is None:  # full fine-tuning with KL: copy before sharding
        import copy
        policy.reference_transformer = copy.deepcopy(policy.transformer).requires_grad_(False)
    mesh = DeviceMesh.from_group(groups.trainer, "cuda" if "cuda" in str(policy.device) else "cpu")
    # bf16 base + fp32 LoRA: gather and compute in the policy dtype, reduce gradients in fp32.
    mp = MixedPrecisionPolicy(param_dtype=policy.dtype, reduce_dtype=torch.float32)
    for name, module in policy.transformer.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("blocks"):
            for block in module:
                fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(policy.transformer, mesh=mesh, mp_policy=mp)
    for module in policy.transformer.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: pairs already carry 1/(N T_train)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no PREMUL_SUM


# --- launching ---------------------------------------------------------------------------------
def role_of(cfg: config_lib.Config, rank: int, world: int) -> str:
    if cfg.placement == "colocated" or world == 1:
        return "colocated"
    return "rollout" if rank < cfg.rollout_ranks else "trainer"


def _spawned_entry(rank, world, port, cfg_dict, failures):
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg_dict["threads"]))
    import faulthandler
    faulthandler.enable()  # a rank that aborts in native code (SIGABRT/SIGSEGV) still prints its Python stack
    try:
        run_rank(config_lib.from_dict(cfg_dict), rank, world, rank, ("127.0.0.1", port), agent_store=False)
    except BaseException as exc:
        failures.put((time.time(), rank, f"{type(exc).__name__}: {exc}"))  # the launcher names the first failure
        raise


def _first_failure(procs, failures, cfg) -> str | None:
    """Name the rank that failed first: a rank killed by SIGKILL, else the earliest reported exception."""
    killed = [r for r, p in enumerate(procs) if p.exitcode == -9]
    reports = []
    while not failures.empty():
        reports.append(failures.get())
    if killed:
        r = killed[0]
        return f"rank {r} ({role_of(cfg, r, len(procs))}) was killed by signal 9"
    if reports:
        _, r, message = min(reports)
        return f"rank {r} ({role_of(cfg, r, len(procs))}) failed: {message.splitlines()[0][:300]}"
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if dead:
        r, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"rank {r} ({role_of(cfg, r, len(procs))}) {how}"
    return None


def launch(cfg: config_lib.Config) -> int:
    """Spawn cfg.nproc ranks and watch them; returns the exit code (non-zero names the failed rank)."""
    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=_spawned_entry, args=(r, cfg.nproc, port, dataclasses.asdict(cfg), failures))
             for r in range(cfg.nproc)]
    for p in procs:
        p.start()
    while all(p.exitcode in (None, 0) for p in procs) and any(p.is_alive() for p in procs):
        time.sleep(0.05)
    if any(p.exitcode not in (None, 0) for p in procs):
        time.sleep(0.5)  # let the ranks that failed first report before we decide who it was
        print(f"[digenrl] {_first_failure(procs, failures, cfg)}; stopping the other ranks", file=sys.stderr, flush=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                p.kill()
                p.join(5)
        return 1
    return 0


def prepare(argv=None) -> config_lib.Config:
    """Parse, resolve and validate; raises ValueError/FileNotFoundError with a clear message on bad input."""
    cfg = config_lib.resolve(config_lib.parse_args(argv))
    world = int(os.environ.get("WORLD_SIZE", cfg.nproc))
    config_lib.validate(cfg, world)
    if cfg.run_name is None and cfg.resume is None:
        cfg.run_name = config_lib.default_run_name(cfg)
    return cfg


def main(argv=None) -> int:
    try:
        cfg = prepare(argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.pretrained is None:  # build the tiny pipeline once, before ranks race for it
        import models
        models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
    if "RANK" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        run_rank(cfg, rank, world, int(os.environ.get("LOCAL_RANK", 0)),
                 (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                 agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        return 0
    if cfg.nproc == 1:
        run_rank(cfg, 0, 1, 0, ("127.0.0.1", 0), agent_store=False)
        return 0
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
