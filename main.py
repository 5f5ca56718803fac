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
import datetime
import os
import sys
import time

import config as config_lib
from infra.launch import launch


@dataclasses.dataclass
class Rank:
    """What every rank builds before its loop (run_rank), used by the rollout and trainer wiring below."""

    cfg: config_lib.Config
    rank: int
    world: int
    groups: object  # comm.Groups
    store: object  # the torch.distributed store (None at world size 1)
    tracer: object
    policy: object
    params: list
    reward_fn: object
    prompts: list[str]
    source: object  # infra.prompts.PromptSource: train and held-out prompts with their dataset rows
    sampling: object
    queue: object  # gap.FragmentQueue
    steps: range

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

        c = self.cfg
        spec = gap.fragment_spec(c.seed, step, first, count, len(self.prompts), c.prompts_per_step, c.group_size,
                                 shared_group_noise=(c.algo == "dance_grpo"))
        kind = "tag" if producer == tag.TAG_PRODUCER else "generate"
        with self.tracer.span(kind, step=step, first_group=first, version=version, samples=len(spec.prompt_ids)):
            with emulate.paced(self.speed):  # --rank-speed: the benchmark's emulation of a slower rank
                return rollout.generate_fragment(self.policy, spec, self.prompts, self.sampling, self.reward_fn,
                                                 version, producer)

    def prefixed(self, name: str):
        import torch.distributed as dist
        return dist.PrefixStore(name, self.store) if self.store is not None else None


def run_rank(cfg, rank: int, world: int, local_rank: int, master: tuple[str, int], agent_store: bool,
             report_silent=None) -> None:
    """One rank: groups (comm.py), liveness, the policy, then the rollout or trainer loop, then shutdown."""
    import torch
    import torch.distributed as dist

    import comm
    import gap
    import models
    import rewards
    import rollout
    from infra.liveness import Liveness, on_sigterm_name_the_dead
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
    store, watch = None, None
    if world > 1:
        if local_rank == 0 and (warning := comm.loopback_data_plane(os.environ)):
            print(f"[digenrl] warning: {warning}", file=sys.stderr, flush=True)
        backend = comm.choose_backend(use_cuda, torch.cuda.device_count() if use_cuda else 0, world, os.environ,
                                      cfg.backend)
        store = dist.TCPStore(master[0], master[1], world, is_master=(rank == 0 and not agent_store),
                              timeout=datetime.timedelta(seconds=cfg.timeout_s))
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=comm.NO_DEADLINE)
        watch = Liveness(dist.PrefixStore("liveness", store), rank, roles, cfg.timeout_s, report_silent).start()
        if agent_store or "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: name the dead rank's role too
            on_sigterm_name_the_dead(watch, rank, roles[rank])
    groups = comm.build_groups(rank, world, cfg.placement, cfg.rollout_ranks)
    tracer = Tracer(rank, groups.role, enabled=cfg.trace)
    tracer.align(groups.world_data)

    path = cfg.pretrained or models.tiny_pipeline_path(cfg.model, cfg.cache_dir)
    policy = models.load(cfg.model, path, device, dtype, height=cfg.resolution or None, frames=cfg.frames or None,
                         max_sequence_length=cfg.text_len, guidance=cfg.guidance,
                         prompt_cache_size=cfg.prompt_cache_size)
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
    r = Rank(cfg, rank, world, groups, store, tracer, policy,
             params=[p for p in policy.transformer.parameters() if p.requires_grad], reward_fn=reward_fn,
             prompts=source.train, source=source,
             sampling=rollout.SamplingConfig(cfg.num_steps, cfg.noise_level, cfg.timestep_fraction, cfg.algo,
                                             cfg.adv_clip),
             queue=gap.FragmentQueue(dist.PrefixStore("queue", store), cfg.prompts_per_step) if store else None,
             steps=steps)
    try:
        run_dir = rollout_rank(r) if groups.role == "rollout" else trainer_rank(r)
    except BaseException as error:
        if watch is not None:
            watch.name_the_dead(error)
        raise

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


def rollout_rank(r: Rank) -> None:
    """A rollout rank: GAP streams its fragments; TCSS (--async) lets it generate ahead with a stale budget."""
    import async_policy
    import rollout

    cfg, groups = r.cfg, r.groups
    timing = r.prefixed("timing")
    rollout.run_rollout_rank(
        rank=r.rank, steps=r.steps, queue=r.queue, fragment_groups=cfg.fragment_groups, generate=r.generate,
        mailbox=async_policy.Mailbox(groups.leader, groups.publish, like=r.params), params=r.params,
        sender=rollout.Sender(groups.world_data, r.tracer),
        destination_of=(lambda seq: groups.leader) if cfg.tsp  # TSP: the leader receives, then shares
        else (lambda seq: groups.trainer_ranks[seq % groups.num_trainers]),  # else dealt round-robin
        tracer=r.tracer, report_generation_s=lambda s, g: timing.set(f"gen/{r.rank}", f"{s / g}"),
        stale_budget=async_policy.StaleBudget(r.prefixed("stale"), cfg.max_stale_fragments) if cfg.use_async else None)


def trainer_rank(r: Rank):
    """A trainer rank (disaggregated) or a colocated rank: the trainer, the mechanisms plugged in, the loop."""
    import torch

    import async_policy
    import gap
    import tag
    import tsp
    from infra import rundir
    from infra.evaluation import Evaluator
    from rollout import num_train_timesteps
    from trainer import (TrainConfig, Trainer, run_colocated_rank, run_trainer_rank, shard_for_fsdp,
                         train_fragment)

    cfg, groups, policy, queue, tracer = r.cfg, r.groups, r.policy, r.queue, r.tracer
    if cfg.fsdp:
        shard_for_fsdp(policy, groups.compute, keep_reference=cfg.beta > 0 and not cfg.lora)
    trainer = Trainer(policy, TrainConfig(cfg.lr, cfg.weight_decay, 1e-8, cfg.clip_range, cfg.max_grad_norm, cfg.beta,
                                          cfg.noise_level, cfg.algo, cfg.max_bad_steps, cfg.optimizer),
                      compute_group=groups.compute, data_group=groups.trainer_data, sharded=cfg.fsdp)
    if cfg.resume:  # rollout ranks take the weights from the leader's first publish
        state = torch.load(os.path.join(rundir.check_resume(cfg.resume, cfg), "state.pt"), map_location="cpu",
                           weights_only=False, mmap=True)  # mmap: each tensor is read when it is copied in
        trainer.load_checkpoint_state(state)  # re-shards under FSDP
        trainer.version = state["step"]
        rundir.set_rng_state(state["rng"])
        del state
    k, me, leader = groups.num_trainers, groups.trainer_index, groups.is_leader
    total_pairs = cfg.prompts_per_step * cfg.group_size * num_train_timesteps(r.sampling)
    fragments_per_step = gap.num_fragments(cfg.prompts_per_step, cfg.fragment_groups)
    run_dir = rundir.open_run_dir(cfg, r.steps) if leader else None
    bar = _progress_bar(cfg, r.steps) if leader and cfg.progress else None
    n_eval = cfg.eval_prompts or len(r.source.train)  # training prompts on held-out noises, then held-out prompts
    evaluator = Evaluator(r.source.train[:n_eval], r.source.eval, r.sampling, r.reward_fn, cfg.eval_seeds,
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
                share=lambda part, owner: gap.broadcast_fragment(part, groups.trainer_ranks[owner],
                                                                 groups.trainer_data),
                concat=gap.concat_fragments)
            if assistant:
                assistant.generated_groups(step, count, time.perf_counter() - start)
            return fragment

        return tsp.lockstep_fragments(  # TSP: the trainer group moves in lockstep, the leader decides
            cfg.prompts_per_step, leader, next_command,
            share_command=lambda c: tsp.broadcast_command(c, groups.leader, groups.trainer_data),
            receive=lambda seq: receive(step, queue.wait(step, seq)),
            share_fragment=lambda f: gap.broadcast_fragment(f, groups.leader, groups.trainer_data), generate=assist)

    def optimizer_step(step: int) -> dict:
        with tracer.span("optimizer", step=step):
            return trainer.step(r.reward_fn.names)

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
            tensors = trainer.iter_full_weights()
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
            if (cfg.save_every and (step + 1) % cfg.save_every == 0) or step + 1 == cfg.steps:
                with tracer.span("checkpoint", step=step):
                    state = trainer.checkpoint_state(keep=leader)
            if leader:
                metrics.update(initial_eval)
                initial_eval.clear()
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
        last["t"] = time.perf_counter()  # step_time_s excludes evaluation and checkpointing

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
    import comm
    return launch(run_rank, dataclasses.asdict(cfg), cfg.nproc, threads=cfg.threads,
                  role_of=lambda r: comm.role_of(cfg.placement, cfg.rollout_ranks, r, cfg.nproc))


if __name__ == "__main__":
    sys.exit(main())
