"""digenrl: disaggregated Flow-GRPO for diffusion / flow-matching generators. The CLI and the wiring.

    python main.py --model flux                      # tiny FLUX, colour task, DigenRL mode on 2 CPU ranks
    python main.py --mode colocated --nproc 2        # the colocated baseline
    python main.py --mode naive                      # disaggregated with the full-batch barrier
    torchrun --nproc_per_node=8 main.py --pretrained /models/FLUX.1-dev --rollout-ranks 4 ...

Started as one process it spawns --nproc ranks itself (infra/launch.py watches them: if one dies or
goes silent, all stop and the exit message names the rank and its role); under torchrun each
process is a rank. Every input is validated before any rank starts. `run_rank` below is one rank:
the process groups (comm.py), the policy, then the rank's loop with the four mechanisms plugged in:
GAP (gap.consume / gap.claims), TSP (tsp.lockstep_fragments, tsp.tsp_packs), TAG (tag.Assistant)
and TCSS (async_policy.StaleBudget / generate_ahead). See config.py for every option.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import time

import config as config_lib
import presets
from infra import lifeline
from infra.launch import launch, open_store
from infra.preemption import EXIT_PREEMPTED, Preempted, Preemption
from infra.runlock import RunLock, check_new_run


@dataclasses.dataclass
class Rank:
    """What every rank builds before its loop (run_rank), used by the rollout and trainer wiring below."""

    cfg: config_lib.Config
    rank: int
    world: int
    groups: object  # comm.Groups
    store: object  # the torch.distributed store (None at world size 1)
    tracer: object
    progress: object  # infra.progress.Progress: what liveness watches (per forward, pack, fragment, tensor, step)
    policy: object
    reward_fn: object
    prompts: list[str]
    source: object  # infra.prompts.PromptSource: train and held-out prompts with their dataset rows
    sampling: object
    queue: object  # gap.FragmentQueue
    steps: range
    preemption: object  # infra.preemption.Preemption: the stop request the trainers agree on at a step's end

    @property
    def speed(self) -> float:
        from infra import emulate
        return emulate.speed_of(self.cfg.rank_speed, self.rank)

    def generate(self, step: int, first: int, count: int, version: int, producer: int):
        """Groups [first, first + count) of step `step`: the one generation path of every producer."""
        import gap
        import rollout
        import tag
        from infra import emulate

        c, progress = self.cfg, self.progress
        spec = gap.fragment_spec(c.seed, step, first, count, len(self.prompts), c.prompts_per_step, c.group_size,
                                 shared_group_noise=(c.algo == "dance_grpo"))
        kind = "tag" if producer == tag.TAG_PRODUCER else "generate"
        with self.tracer.span(kind, step=step, first_group=first, version=version, samples=len(spec.prompt_ids)):
            with emulate.paced(self.speed):  # --rank-speed: the benchmark's emulation of a slower rank
                fragment = rollout.generate_fragment(self.policy, spec, self.prompts, self.sampling, self.score,
                                                     version, producer)
        progress.bump(step)
        return fragment

    def score(self, *args, **kwargs):
        """The reward function, excused from reporting progress (a user's function reports none)."""
        with self.progress.excused("reward"):
            return self.reward_fn(*args, **kwargs)

    def prefixed(self, name: str):
        import torch.distributed as dist
        return dist.PrefixStore(name, self.store) if self.store is not None else None


def run_rank(cfg, rank: int, world: int, local_rank: int, master: tuple, agent_store: bool,
             report_silent=None) -> int:
    """One rank: groups (comm.py), liveness, the policy, then the rollout or trainer loop, then shutdown. Returns 0,
    or EXIT_PREEMPTED after a stop on SIGTERM (a rank of a larger job exits with it: infra/preemption.py)."""
    import torch
    import torch.distributed as dist

    import comm
    import gap
    import models
    import rewards
    import rollout
    from infra.liveness import Liveness
    from infra.progress import Progress
    from infra.tracing import Tracer, gather_spans, write_chrome_trace, write_timeline_png

    cfg = cfg if isinstance(cfg, config_lib.Config) else config_lib.from_dict(cfg)
    torch.set_num_threads(cfg.threads)
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        cfg.dtype, torch.bfloat16 if use_cuda else torch.float32)
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.enable_cudnn_sdp(False)  # docs/DESIGN.md section 7: cuDNN SDPA backward crashed on H200
    roles = [comm.role_of(cfg.placement, cfg.rollout_ranks, r, world) for r in range(world)]
    _name_process(f"dg{rank}-{roles[rank]}")  # what ps/top (and tools/soak.py) show for this rank
    store, watch, progress = None, None, Progress()
    if world > 1:
        if local_rank == 0 and (warning := comm.loopback_data_plane(os.environ)):
            print(f"[digenrl] warning: {warning}", file=sys.stderr, flush=True)
        store = open_store(master, world, is_master=(rank == 0 and not agent_store), timeout_s=cfg.timeout_s)
        gpus = comm.gather_device_identities(store, rank, world, comm.this_device_identity(device)) if use_cuda else []
        backend, why = comm.choose_backend(use_cuda, [gpu for gpu, role in zip(gpus, roles) if role != "rollout"],
                                           cfg.backend)
        if rank == 0:
            print(f"[digenrl] compute plane: {backend} ({why})", flush=True)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=comm.NO_DEADLINE)
        watch = Liveness(dist.PrefixStore("liveness", store), rank, roles, cfg.timeout_s, report_silent,
                         progress=progress).start()
    # SIGTERM: stop after the current step with a checkpoint; but at once when a peer is dead already (torchrun's
    # agent stops the others that way when one fails): then say which one, as torchrun names no roles
    preemption = Preemption(dist.PrefixStore("preemption", store) if store is not None else None, rank, world,
                            urgent=lambda: "; ".join(f"{watch.describe(r)} died" for r in watch.dead_local_peers())
                            if watch is not None else None,
                            finishing=watch.finishing if watch is not None else lambda: None,
                            hosts_store=rank == 0 and not agent_store).start()
    groups = comm.build_groups(rank, world, cfg.placement, cfg.rollout_ranks)
    tracer = Tracer(rank, groups.role, enabled=cfg.trace, progress=progress)
    tracer.align(groups.world_data)

    path = cfg.pretrained or models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
    policy = models.load(cfg.model, path, device, dtype, height=cfg.resolution or None, width=cfg.width or None,
                         frames=cfg.frames or None,
                         max_sequence_length=cfg.text_len, guidance=cfg.guidance,
                         prompt_cache_size=cfg.prompt_cache_size)
    policy.on_forward = progress.bump  # every transformer forward is progress (generation, evaluation, training)
    torch.manual_seed(cfg.seed)  # identical LoRA init on every rank (the leader also publishes version 0)
    if cfg.lora:
        models.add_lora(policy, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        if cfg.init_lora and not cfg.resume:  # every rank starts from the file (a resumed run: from its checkpoint)
            models.load_init_lora(policy.transformer, cfg.init_lora)
    else:
        models.enable_full_training(policy, fp32_master=cfg.fp32_master and groups.is_trainer)
    if cfg.grad_ckpt and groups.is_trainer:
        policy.transformer.enable_gradient_checkpointing()
    source = config_lib.prompt_source(cfg)  # train prompts, held-out eval prompts, their metadata (infra/prompts.py)
    reward_fn = rewards.build_reward(cfg.reward, config_lib.reward_options(cfg), config_lib.reward_probe(cfg, source))
    reward_fn.prompt_metadata = source.train_metadata  # generation passes prompt ids; the reward looks metadata up
    import gc
    gc.freeze()  # the libraries' and the model's long-lived objects leave the collector's scans: shorter GC pauses,
    # during which no thread (the liveness heartbeat included) can run
    steps = range(0, cfg.steps)
    if cfg.resume:
        from infra import rundir
        steps = range(rundir.checkpoint_step(rundir.check_resume(cfg.resume, cfg)), cfg.steps)
    r = Rank(cfg, rank, world, groups, store, tracer, progress, policy, reward_fn=reward_fn,
             prompts=source.train, source=source,
             sampling=rollout.SamplingConfig(cfg.num_steps, cfg.noise_level, cfg.timestep_fraction, cfg.algo,
                                             cfg.adv_clip),
             queue=gap.FragmentQueue(dist.PrefixStore("queue", store), cfg.prompts_per_step) if store else None,
             steps=steps, preemption=preemption)
    try:
        run_dir = rollout_rank(r) if groups.role == "rollout" else trainer_rank(r)
    except Preempted:  # the trainers agreed to stop; the leader's checkpoint is on disk
        if world == 1:
            preemption.close()
            return EXIT_PREEMPTED
        preemption.finish(leader=groups.is_leader)  # every rank exits with EXIT_PREEMPTED
    except BaseException as error:
        preemption.absorb(error)  # a peer leaving after an agreed stop: not a failure
        if watch is not None:
            watch.name_the_dead(error)
        raise
    progress.finish()  # shutdown reports no progress: liveness watches only the heartbeat from here on

    # Shutdown: the loops have joined their background threads; only the main threads talk from here on.
    spans = gather_spans(tracer, group=groups.world_data, dst=groups.leader) if cfg.trace else None
    if run_dir is not None:
        run_dir.plot_rewards()
        run_dir.close()
        if spans is not None:
            write_chrome_trace(spans, os.path.join(run_dir.path, "trace.json"))
            write_timeline_png(spans, os.path.join(run_dir.path, "timeline.png"), title=f"{cfg.model} {cfg.mode}")
        print(f"[digenrl] done: {run_dir.path}", flush=True)
    if use_cuda:
        print(f"[digenrl] rank {rank} ({groups.role}) peak device memory "
              f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB", flush=True)
    if world > 1:
        watch.finishing()
        dist.barrier(group=groups.world_data)
        watch.stop()
        dist.destroy_process_group()
    preemption.close()
    return 0


def rollout_rank(r: Rank) -> None:
    """A rollout rank: GAP streams its fragments; TCSS (--async) lets it generate ahead with a stale budget."""
    import async_policy
    import rollout

    cfg, groups = r.cfg, r.groups
    timing = r.prefixed("timing")
    params = [p for p in r.policy.transformer.parameters() if p.requires_grad]  # what the leader publishes
    r.progress.start()
    rollout.run_rollout_rank(
        rank=r.rank, steps=r.steps, queue=r.queue, fragment_groups=cfg.fragment_groups, generate=r.generate,
        mailbox=async_policy.Mailbox(groups.leader, groups.publish, like=params), params=params,
        sender=rollout.Sender(groups.world_data, r.tracer),
        destination_of=(lambda seq: groups.leader) if cfg.tsp  # TSP: the leader receives, then shares
        else (lambda seq: groups.trainer_ranks[seq % groups.num_trainers]),  # else dealt round-robin
        tracer=r.tracer, report_generation_s=lambda s, g: timing.set(f"gen/{r.rank}", f"{s / g}"),
        stale_budget=async_policy.StaleBudget(r.prefixed("stale"), cfg.max_stale_fragments) if cfg.use_async else None)


def trainer_rank(r: Rank):
    """A trainer rank (disaggregated) or a colocated rank: the trainer, the mechanisms plugged in, the loop."""
    import async_policy
    import gap
    import tag
    import tsp
    from infra import rundir
    from infra.evaluation import Evaluator
    from rollout import num_train_timesteps
    from trainer import (TrainConfig, Trainer, run_colocated_rank, run_trainer_rank, shard_for_fsdp,
                         train_fragment)

    cfg, groups, policy, queue, tracer, progress = r.cfg, r.groups, r.policy, r.queue, r.tracer, r.progress
    if cfg.fsdp:
        shard_for_fsdp(policy, groups.compute, keep_reference=cfg.beta > 0 and not cfg.lora)
    trainer = Trainer(policy, TrainConfig(cfg.lr, cfg.weight_decay, 1e-8, cfg.clip_range, cfg.max_grad_norm, cfg.beta,
                                          cfg.noise_level, cfg.algo, cfg.max_bad_steps, cfg.optimizer),
                      compute_group=groups.compute, data_group=groups.trainer_data, sharded=cfg.fsdp,
                      progress=progress)
    if cfg.resume:  # rollout ranks take the weights from the leader's first publish
        state = rundir.load_state(rundir.check_resume(cfg.resume, cfg))  # tensors and plain data only
        trainer.load_checkpoint_state(state)  # re-shards under FSDP
        trainer.version = state["step"]
        rundir.set_rng_state(state["rng"])
        del state
    progress.start()  # from here on this rank reports progress (loading a checkpoint did not)
    k, me, leader = groups.num_trainers, groups.trainer_index, groups.is_leader
    total_pairs = cfg.prompts_per_step * cfg.group_size * num_train_timesteps(r.sampling)
    fragments_per_step = gap.num_fragments(cfg.prompts_per_step, cfg.fragment_groups)
    run_dir = rundir.open_run_dir(cfg, r.steps) if leader else None
    bar = _progress_bar(cfg, r.steps) if leader and cfg.progress else None
    n_eval = cfg.eval_prompts or len(r.source.train)  # training prompts on held-out noises, then held-out prompts
    evaluator = Evaluator(r.source.train[:n_eval], r.source.eval, r.sampling, r.score, cfg.eval_seeds,
                          run_dir.path if leader else None, metadata=r.source.train_metadata[:n_eval],
                          heldout_metadata=r.source.eval_metadata,
                          # TB/W&B steps are rows: the first evaluation goes with the first row, the one
                          # after step s's update (updates = s + 1) with row s
                          on_images=(lambda updates, *media: run_dir.log_eval_media(
                              max(updates - 1, r.steps.start), *media)) if leader else None)
    initial_eval = {}  # the policy the run starts from: logged in the first row as eval_reward_initial, ...
    if cfg.eval_every and (leader or cfg.fsdp):  # under FSDP evaluation is a collective
        with tracer.span("eval", step=r.steps.start):
            initial_eval = {f"{k}_initial": v for k, v in evaluator(policy, r.steps.start).items()}
    stale_budget = async_policy.StaleBudget(r.prefixed("stale"), cfg.max_stale_fragments) if cfg.use_async else None

    # TAG: the leader decides and claims; every trainer generates its share of what the leader claimed.
    assistant = None
    if cfg.tag and leader:
        timing = r.prefixed("timing")

        def rollout_gen_s():  # a fragment of fragment_groups groups on a rollout rank, as they last reported
            per_group = [float(timing.get(f"gen/{x}")) for x in groups.rollout_ranks if timing.check([f"gen/{x}"])]
            return sum(per_group) / len(per_group) * cfg.fragment_groups if per_group else None
        assistant = tag.Assistant(cfg.prompts_per_step, cfg.fragment_groups, len(groups.rollout_ranks), k,
                                  quantum=k if cfg.fsdp else 1, claim=queue.claim, claimed=queue.num_claimed,
                                  announced_groups=queue.num_announced_groups, rollout_gen_s=rollout_gen_s)

    def pairs_of(m: int, t_train: int):  # TSP: my share of the fragment's pairs, packed; else the per-timestep loop
        if cfg.tsp:
            return tsp.tsp_packs(m, t_train, me, k, cfg.tsp_pack)
        packs = tsp.per_timestep_packs(m, t_train)
        return packs, [[1.0] * len(p) for p in packs]

    def train(fragment):
        train_fragment(trainer, fragment, pairs_of=pairs_of, total_pairs=total_pairs, count=leader or not cfg.tsp,
                       async_on=cfg.use_async, reward_names=r.reward_fn.names, tracer=tracer, speed=r.speed,
                       on_trained=(lambda f, s: assistant.trained_groups(f.num_groups, s)) if assistant else None)

    def receive(step: int, announcement) -> gap.Fragment:
        with tracer.span("recv", step=step, first_group=announcement.first_group):
            return gap.recv_fragment(announcement.producer, group=groups.world_data)

    def fragments_of(step: int):
        if not cfg.tsp:  # GAP without TSP: whole fragments dealt round-robin to the trainers
            return gap.dealt_fragments(queue, step, fragments_per_step, me, k, lambda a: receive(step, a))
        poll = lambda seq: queue.poll(step, seq) is not None  # noqa: E731
        if assistant:
            decide = assistant.next_command(step, poll, tsp.TRAIN, tsp.GENERATE)
        else:
            decide = tsp.wait_for_arrival(poll)

        def next_command(next_seq, groups_done):
            with tracer.span("wait", step=step, what="fragment"):
                return decide(next_seq, groups_done)

        def assist(first: int, count: int) -> gap.Fragment:  # TAG: runs on every trainer
            start = time.perf_counter()
            fragment = tag.assisted_generation(
                first, count, k, me, generate=lambda f, c: r.generate(step, f, c, trainer.version, tag.TAG_PRODUCER),
                share=lambda part, owner: _inside(progress, "tag share", gap.broadcast_fragment, part,
                                                  groups.trainer_ranks[owner], groups.trainer_data),
                concat=gap.concat_fragments, lockstep=cfg.fsdp)  # FSDP: equal forwards on every trainer
            if assistant:
                assistant.generated_groups(step, count, time.perf_counter() - start)
            return fragment

        return tsp.lockstep_fragments(  # TSP: the trainer group moves in lockstep, the leader decides
            cfg.prompts_per_step, leader, next_command,
            share_command=lambda c: _inside(progress, "command broadcast", tsp.broadcast_command, c, groups.leader,
                                            groups.trainer_data),
            receive=lambda seq: receive(step, queue.wait(step, seq)),
            share_fragment=lambda f: _inside(progress, "fragment broadcast", gap.broadcast_fragment, f,
                                             groups.leader, groups.trainer_data), generate=assist)

    stop = {"agreed": False}  # set when the trainers agreed at this step's optimizer step to stop after it

    def optimizer_step(step: int) -> dict:
        with tracer.span("optimizer", step=step):
            reduced = trainer.metrics  # reduced over the trainers in trainer.step: all of them see the same max
            reduced.high("stop_asked", float(r.preemption.stop_asked()))
            metrics = trainer.step(r.reward_fn.names)
        stop["agreed"] = reduced.maxs["stop_asked"] > 0 and step + 1 < cfg.steps
        return metrics

    def publish(version: int) -> None:
        """The leader broadcasts whole weights; under FSDP every trainer takes part in gathering each one."""
        if version == async_policy.STOP:
            if leader:
                async_policy.publish([], 0, version, groups.leader, groups.publish)
            return
        if not (leader or cfg.fsdp):
            return
        start = time.perf_counter()
        with tracer.span("publish", version=version):
            tensors = progress.each(trainer.iter_full_weights())  # progress per gathered tensor
            if leader:  # in the rollout's dtypes: bf16 weights for full fine-tuning even with fp32 masters here
                async_policy.publish(tensors, len(trainer.params), version, groups.leader, groups.publish,
                                     dtypes=None if cfg.lora else [policy.dtype] * len(trainer.params))
            else:
                collections.deque(tensors, maxlen=0)  # take part in each gather, keep nothing
        if assistant is not None:
            assistant.published(time.perf_counter() - start)

    last = {"t": time.perf_counter(), "start": time.perf_counter()}

    def end_step(step: int, metrics: dict) -> None:
        """Log, evaluate and checkpoint (the leader; under FSDP evaluation and gathering are collectives)."""
        now = time.perf_counter()  # wall_s: seconds since this process's first step (compare_runs' time to reward)
        metrics.update(step_time_s=now - last["t"], wall_s=now - last["start"], version=trainer.version)
        if leader or cfg.fsdp:
            state = None
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                with tracer.span("eval", step=step):
                    metrics.update(evaluator(policy, step + 1))  # eval_reward, eval_reward_heldout_prompts; grids
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps or stop["agreed"]:
                with tracer.span("checkpoint", step=step):
                    state = trainer.checkpoint_state(keep=leader)
            if leader:
                metrics.update(initial_eval)
                initial_eval.clear()
                with progress.excused("write the run directory"):  # metrics, a checkpoint file: no progress inside
                    rundir.record_step(run_dir, cfg, policy, step, metrics, state, tracer)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", tag=int(metrics["tag_fragments"]),
                            stale=int(metrics["stale_fragments"]))
        if leader and queue is not None and step >= 2:  # every rank is past step - 2 (rollout runs <= 1 ahead)
            queue.forget(step - 2)
            if stale_budget is not None:
                stale_budget.forget(step - 2)
        if assistant is not None:
            assistant.forget(step)
        tracer.mark_step(step)
        progress.bump(step + 1)
        last["t"] = time.perf_counter()  # step_time_s excludes evaluation and checkpointing
        if stop["agreed"]:
            if leader:
                run_dir.plot_rewards()
                run_dir.close()
                print(f"[digenrl] stopped on request after step {step}: checkpoint "
                      f"{os.path.join(run_dir.path, 'checkpoints', f'step_{step + 1:06d}')}; continue with: "
                      f"python main.py --resume {run_dir.path}", flush=True)
            raise Preempted(step)

    if groups.role == "colocated":
        run_colocated_rank(
            trainer, steps=r.steps,
            my_claims=lambda step: [(i * cfg.fragment_groups, cfg.fragment_groups)
                                    for i in range(r.rank, fragments_per_step, r.world)],  # a static share
            generate=lambda step, first, count, version: r.generate(step, first, count, version, r.rank),
            train=train, optimizer_step=optimizer_step, end_step=end_step)
    else:
        run_trainer_rank(trainer, steps=r.steps, fragments_of=fragments_of, streaming=cfg.gap, train=train,
                         optimizer_step=optimizer_step, publish=publish, end_step=end_step,
                         before_publish=(lambda step: step + 1 < cfg.steps
                                         and assistant.consider(step + 1, 0, before_publish=True))
                         if assistant else None)
    if bar is not None:
        bar.close()
    return run_dir


def _inside(progress, name: str, call, *args):
    """call(*args) with `progress` knowing this thread is inside `name` (a collective liveness can name)."""
    with progress.inside(name):
        return call(*args)


def _name_process(name: str) -> None:
    """Set this process's name (Linux, 15 characters) so operators can tell the ranks apart."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _progress_bar(cfg, steps):
    from tqdm import tqdm
    return tqdm(total=cfg.steps, initial=steps.start, desc=f"{cfg.model} {cfg.mode}", dynamic_ncols=True)


# --- launching ---------------------------------------------------------------------------------
ONE_RANK = ("[digenrl] one rank: running colocated (generate, then train, on this rank); the disaggregated modes "
            "need 2+ ranks: torchrun --nproc_per_node=2 main.py ... or python main.py --nproc 2 ...")


def prepare(argv=None) -> config_lib.Config:
    """Parse, resolve and validate; raises ValueError/FileNotFoundError with a clear message on bad input."""
    parsed = config_lib.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", parsed.nproc))
    cfg = config_lib.resolve(parsed, world=world)
    if cfg.placement == "disaggregated" and world < 2:  # asked for explicitly (the default falls back to colocated)
        raise ValueError(_needs_two_ranks(argv, world))
    config_lib.validate(cfg, world)
    if world == 1 and parsed.mode is None and parsed.placement is None:  # the default mode, on one rank
        print(ONE_RANK, file=sys.stderr, flush=True)
    if cfg.run_name is None and cfg.resume is None:
        cfg.run_name = config_lib.default_run_name(cfg)
    return cfg


def _needs_two_ranks(argv, world: int) -> str:
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


def main(argv=None) -> int:
    torchrun = "RANK" in os.environ
    if "TORCHELASTIC_RUN_ID" in os.environ:
        lifeline.die_with_parent()  # a rank of torchrun dies with its agent (a SIGKILLed torchrun leaves none)
    try:
        cfg = prepare(argv)
        world = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc
        rank = int(os.environ["RANK"]) if torchrun else 0
        print(f"[digenrl] {presets.describe(cfg)}", flush=True)
        if cfg.dry_run:  # before the lock: a dry run writes nothing
            print(f"[digenrl] dry run, nothing started; config {config_lib.to_json(cfg)}", flush=True)
            return 0
        lock = lock_run_dir(cfg) if rank == leader_rank(cfg, world) or not torchrun else None
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg.pretrained is None:  # build the tiny pipeline once, before ranks race for it
            import models
            models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
        if torchrun:
            return run_rank(cfg, rank, world, int(os.environ.get("LOCAL_RANK", 0)),
                            (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        if cfg.nproc == 1:
            return run_rank(cfg, 0, 1, 0, ("127.0.0.1", 0), agent_store=False)
        import comm
        return launch(run_rank, dataclasses.asdict(cfg), cfg.nproc, threads=cfg.threads,
                      role_of=lambda r: comm.role_of(cfg.placement, cfg.rollout_ranks, r, cfg.nproc))
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
