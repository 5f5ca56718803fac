"""digenrl: disaggregated Flow-GRPO for diffusion / flow-matching models. The CLI and the wiring.

    python main.py --model flux                # tiny FLUX, colour task, DigenRL mode on 2 CPU ranks
    python main.py --mode colocated --nproc 2  # the colocated baseline
    python main.py --mode naive                # disaggregated with the full-batch barrier
    torchrun --nproc_per_node=8 main.py --pretrained /models/FLUX.1-dev --rollout-ranks 4 ...

Started as one process it spawns --nproc ranks (infra/launch.py watches them); under torchrun each
process is a rank. `run_rank` is one rank, top to bottom: the job (infra/runtime.py), the groups
(comm.py), the policy, then its loop, each mechanism plugged in on one line: GAP (gap.rollout_loop,
trainer.trainer_loop), TSP (tsp.*: wiring.py), TAG (tag.Assistant), TCSS (async_policy.py); the
baseline colocated.py; transport.py carries data, wiring.py wraps it in spans."""
from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import ContextManager

import torch

from flowgrpo import batch_rewards
import cli
import colocated
import comm
import config as config_lib
import gap
import grpo
import models
import rewards
import rollout
import tag
import async_policy
import transport
import wiring
from infra import bookkeeping, emulate, rundir, runtime
from infra.fsdp import shard_for_fsdp
from infra.launch import launch
from infra.preemption import EXIT_PREEMPTED, Preempted
from infra.prompts import PromptSource
from infra.tracing import Tracer
from trainer import TrainConfig, Trainer, TrainerSide, nothing, trainer_loop


@dataclasses.dataclass
class Rank:
    """What every rank builds before its loop (run_rank)."""

    cfg: config_lib.Config
    groups: comm.Groups  # this rank's place and the groups it talks on
    job: runtime.Job  # store, liveness, progress, preemption
    tracer: Tracer
    policy: models.Policy
    reward_fn: rewards.CombinedReward
    source: PromptSource  # train and held-out prompts with their dataset rows
    sampling: rollout.SamplingConfig
    queue: gap.FragmentQueue | None  # GAP's claims and announcements (None on one rank)
    steps: range
    pace: Callable[[], ContextManager]  # --rank-speed (infra/emulate.py, benchmarks); else no-op
    batch: batch_rewards.BatchRewards | None  # batch-level advantages: rewards posted, restated

    def generate(self, step: int, ranges: list[tuple[int, int]], version: int, producer: int,
                 part=None, calls: int = 0) -> list[gap.Fragment]:
        """Group ranges (first, count) of `step` in one generation call, one fragment each: every
        producer's one path (only the colocated baseline's calls join several ranges). part=(lo, hi)
        of one range: only those trajectories, advantages left to the joined groups (TAG)."""
        c = self.cfg
        spec = colocated.joined_specs([gap.fragment_spec(
            c.seed, step, first, count, len(self.source.train), c.prompts_per_step, c.group_size,
            c.algo == "dance_grpo") for first, count in ranges])
        spec, make = (spec, rollout.generate_fragment) if part is None else \
            (rollout.part_spec(spec, *part), rollout.generate_trajectories)
        kind = "tag" if producer == tag.TAG_PRODUCER else "generate"
        with self.tracer.span(kind, step=step, first_group=spec.first_group, version=version,
                              samples=len(spec.prompt_ids)), self.pace():
            fragment = make(self.policy, spec, self.source.train, self.sampling, self.score,
                            version, producer, calls=calls)
        self.job.progress.bump(step)
        fragments = colocated.split_rows(fragment, ranges) if len(ranges) > 1 else [fragment]
        for f in [f for f in fragments if f.is_whole] if self.batch is not None else []:
            self.batch.post(f)  # before it is announced, sent or shared (parts: TSP joins them)
        return fragments

    def score(self, images, *args, **kwargs):
        """The reward fn, excused from reporting progress (for as long as a remote one can take)."""
        with self.job.progress.excused("reward", up_to_s=self.reward_fn.deadline_s(images)):
            return self.reward_fn(images, *args, **kwargs)


def run_rank(cfg, rank: int, world: int, local_rank: int, master: tuple, agent_store: bool,
             report_silent=None, store=None) -> int:  # store: opened already (infra/node_fetch.py)
    """One rank: job, groups, policy, loop, shutdown. 0, or EXIT_PREEMPTED after a SIGTERM stop."""
    cfg = cfg if isinstance(cfg, config_lib.Config) else config_lib.from_dict(cfg)
    torch.set_num_threads(cfg.threads)
    device, dtype = runtime.device_of(cfg, local_rank)
    roles = [comm.role_of(cfg.placement, cfg.rollout_ranks, r, world) for r in range(world)]
    runtime.name_process(f"dg{rank}-{roles[rank]}")  # what ps/top (and tools/soak.py) show
    job = runtime.connect(cfg, rank, world, local_rank, master, agent_store, report_silent,
                          device, roles, store)
    groups = job.phase("process groups", comm.build_groups, rank, world, cfg.placement,
                       cfg.rollout_ranks)
    tracer = Tracer(rank, groups.role, enabled=cfg.trace, progress=job.progress)
    job.phase("align clocks", tracer.align, groups.world_data)
    policy = runtime.load_policy(cfg, device, dtype, groups, job.progress)
    source = config_lib.prompt_source(cfg)  # train and held-out prompts, their metadata
    reward_fn = job.excused("build the reward", rewards.build_reward, cfg.reward,  # loads, dry call
                            config_lib.reward_options(cfg), config_lib.reward_probe(cfg, source))
    reward_fn.prompt_metadata = source.train_metadata  # generation passes prompt ids
    runtime.freeze_heap()
    queue = gap.FragmentQueue(job.prefixed("queue"), cfg.prompts_per_step,
                              group_size=cfg.group_size) if job.store else None
    pace = functools.partial(emulate.paced, emulate.speed_of(cfg.rank_speed, rank))
    r = Rank(cfg, groups, job, tracer, policy, reward_fn, source, rollout.SamplingConfig.of(cfg),
             queue, range(rundir.first_step(cfg), cfg.steps), pace,
             batch_rewards.for_run(cfg, job.prefixed("adv"), tracer))
    try:
        run_dir = rollout_rank(r) if groups.role == "rollout" else trainer_rank(r)
    except Preempted:  # the trainers agreed to stop; the leader's checkpoint is on disk
        if world == 1:
            job.preemption.close()
            return EXIT_PREEMPTED
        job.preemption.finish(leader=groups.is_leader)  # every rank exits with EXIT_PREEMPTED
    except BaseException as error:
        job.preemption.absorb(error)  # a peer leaving after an agreed stop: not a failure
        if job.watch is not None:
            job.watch.name_the_dead(error)
        raise
    runtime.shutdown(job, cfg, groups, tracer, run_dir, device)
    return 0


def rollout_rank(r: Rank) -> None:
    """A rollout rank: GAP streams its fragments; TCSS swaps weights between them, runs ahead."""
    cfg, groups = r.cfg, r.groups
    params = [p for p in r.policy.transformer.parameters() if p.requires_grad]  # published ones
    sender = transport.FragmentSender(wiring.Send(r.tracer, groups.world_data))
    shapes, progress = [(p.shape, p.dtype) for p in params], r.job.progress
    receive = transport.WeightReceiver(groups.leader, groups.publish, shapes, progress=progress)
    budget = async_policy.StaleBudget(r.job.prefixed("stale"), cfg.max_stale_fragments)
    weights = async_policy.RolloutWeights(  # TCSS
        async_policy.Mailbox(receive), params, budget if cfg.use_tcss else None,
        sender.raise_if_failed, r.tracer, groups.rank == 0)
    times = tag.RolloutTimes(r.job.prefixed("timing"), groups.rollout_ranks, cfg.fragment_groups)
    generate = wiring.TimedGenerate(r.generate, groups.rank, times)  # TAG's predictor reads times
    r.job.progress.start()
    gap.rollout_loop(rank=groups.rank, steps=r.steps, queue=r.queue, generate=generate,
                     fragment_groups=cfg.fragment_groups, send=sender.put, weights=weights,
                     destination_of=functools.partial(wiring.destination, groups, cfg.tsp))  # GAP
    r.job.phase("wait for the trainers' end", lambda: (sender.close(), weights.close()))


def trainer_rank(r: Rank):
    """A trainer rank (disaggregated) or a colocated rank: the trainer, the mechanisms, the loop."""
    cfg, groups, leader = r.cfg, r.groups, r.groups.is_leader
    if cfg.fsdp:
        shard_for_fsdp(r.policy, groups.compute, keep_reference=cfg.beta > 0 and not cfg.lora)
    trainer = Trainer(r.policy, TrainConfig.of(cfg), compute_group=groups.compute,
                      data_group=groups.trainer_data, sharded=cfg.fsdp, progress=r.job.progress)
    r.job.progress.start()  # the loop's work begins (a stop request now waits for a checkpoint)
    if cfg.resume:  # reports progress per tensor loaded
        bookkeeping.resume(trainer, cfg, r.job.progress)
    books = bookkeeping.Bookkeeping(cfg, r.steps, trainer, r.policy, r.source, r.sampling, r.score,
                                    r.reward_fn.names, r.tracer, r.job, leader)
    books.evaluate_initial()
    assistant = wiring.assistant(cfg, groups, r.queue, r.job) if cfg.tag and leader else None  # TAG
    send = functools.partial(wiring.publish, groups, None if cfg.lora else r.policy.dtype)
    publisher = async_policy.Publisher(  # TCSS
        trainer.iter_full_weights, len(trainer.params), send, sends=leader, gathers=cfg.fsdp,
        tracer=r.tracer, on_published=assistant.published if assistant else None)
    t_train = rollout.num_train_timesteps(r.sampling)
    bounds = grpo.minibatch_bounds(cfg.prompts_per_step, cfg.updates_per_batch)  # M updates a step
    train, flush, count = wiring.fragment_training(cfg, groups, trainer, bounds, t_train,  # TSP
                                            r.reward_fn.names, r.tracer, r.pace,
                                            assistant.trained if assistant else None)
    fragments = wiring.TrainerFragments(cfg, groups, r.queue, r.tracer, r.job.progress, r.generate,
                                        trainer.current_version, assistant)  # dealt, or TSP's
    side = TrainerSide(fragments_of=fragments, train=train, version=trainer.current_version,
                           optimizer_step=books.optimizer_step, publish=publisher.publish,
                           end_step=books.end_step, update=books.update, bounds=bounds, flush=flush,
                           restate=r.batch.restate if r.batch else None,  # batch-level advantages
                           minibatches=wiring.minibatch_plan(cfg, r.batch), count=count,
                           before_publish=assistant.before_publish if assistant else nothing)
    books.forgetting(r.queue.forget_old if leader and r.queue else nothing,
                     assistant.forget if assistant else nothing,
                     r.batch.forget if leader and r.batch else nothing)
    if groups.role == "colocated":  # the baseline: a static 1/P of every minibatch, no queue
        claims = functools.partial(colocated.static_claims, bounds)
        colocated.loop(side, r.steps, claims, groups.rank, groups.world,
                       functools.partial(r.generate, producer=groups.rank), cfg.fragment_groups)
    else:
        trainer_loop(side, r.steps, streaming=cfg.gap)  # GAP
        publisher.stop()
    return books.close()


def main(argv=None) -> int:
    """The command line: validate, lock the run directory, run this process's rank(s)."""
    return cli.main(argv, run_rank, launch)


if __name__ == "__main__":
    sys.exit(main())
