"""digenrl: disaggregated Flow-GRPO for diffusion / flow-matching models: one RL step, top to
bottom.

    python main.py --model flux                # tiny FLUX, colour task, DigenRL mode on 2 CPU ranks
    python main.py --mode colocated --nproc 2  # the colocated baseline
    python main.py --mode naive                # disaggregated with the full-batch barrier
    torchrun --nproc_per_node=8 main.py --pretrained /models/FLUX.1-dev --rollout-ranks 4 ...

Started as one process it spawns --nproc ranks (infra/launch.py watches them); under torchrun each
process is a rank. `run_rank` is one rank: the job (infra/runtime.py), the groups (comm.py), the
policy, then its loop, written out here:
  rollout rank (`rollout_loop`): claim -> generate -> announce -> send; weights swapped between
      fragments.                                  GAP: gap.claims; TCSS: async_policy.RolloutWeights
  trainer rank (`TrainerRank.run`): fragments in -> train each -> M updates -> publish -> end of
      step.
      GAP: gap.dealt_fragments; TSP: tsp.lockstep_fragments, tsp.trainer_packs; TAG: tag.Assistant,
      tag.assisted_generation; TCSS: async_policy.check_staleness, async_policy.Publisher;
      Flow-GRPO's M updates: grpo.train_in_minibatches
  colocated rank: the trainer's loop, its own share generated in place of the queue's fragments.
transport.py carries fragments and weights; infra/bookkeeping.py logs, evaluates and checkpoints."""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Iterable
from typing import ContextManager

import torch

import async_policy
import cli
import comm
import config as config_lib
import gap
import grpo
import models
import rewards
import rollout
import tag
import transport
import tsp
from flowgrpo import batch_rewards
from fragment import Fragment, concat_fragments, fragment_spec
from gap import Announcement
from infra import bookkeeping, emulate, rundir, runtime
from infra.fsdp import shard_for_fsdp
from infra.launch import launch
from infra.preemption import EXIT_PREEMPTED, Preempted
from infra.prompts import PromptSource
from infra.tracing import Tracer
from trainer import TrainConfig, Trainer


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
                 part=None, calls: int = 0) -> list[Fragment]:
        """Group ranges (first, count) of `step` in one generation call, one fragment each: every
        producer's one path (only a colocated rank's calls join several ranges). part=(lo, hi) of
        one range: only those trajectories, advantages left to the joined groups (TAG)."""
        c = self.cfg
        spec = rollout.joined_specs([fragment_spec(
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
        fragments = rollout.split_rows(fragment, ranges) if len(ranges) > 1 else [fragment]
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
    source = rewards.prompt_source(cfg)  # train and held-out prompts, their metadata
    reward_fn = job.excused("build the reward", rewards.build_reward, cfg.reward,  # loads, dry call
                            rewards.RewardOptions.of(cfg), rewards.reward_probe(cfg, source))
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


# === a rollout rank ===============================================================================
def rollout_rank(r: Rank) -> None:
    """A rollout rank: GAP streams its fragments to the trainers; TCSS swaps weights between
    them."""
    cfg, groups, tracer = r.cfg, r.groups, r.tracer
    params = [p for p in r.policy.transformer.parameters() if p.requires_grad]  # published ones

    def send(fragment: Fragment, dst: int) -> None:  # on the sender thread
        with tracer.span("send", step=fragment.step, first_group=fragment.first_group):
            transport.send_fragment(fragment, dst, group=groups.world_data)
        r.job.progress.bump()  # a fragment delivered (the sender thread's own count)
    sender = transport.FragmentSender(send)  # a thread: the next generation starts at once
    shapes = [(p.shape, p.dtype) for p in params]
    receive = transport.WeightReceiver(groups.leader, groups.publish, shapes,
                                       progress=r.job.progress)
    budget = async_policy.StaleBudget(r.job.prefixed("stale"), cfg.max_stale_fragments)
    weights = async_policy.RolloutWeights(transport.Mailbox(receive), params,  # TCSS
                                          budget if cfg.use_tcss else None, sender.raise_if_failed,
                                          tracer, groups.rank == 0)
    times = transport.RolloutTimes(r.job.prefixed("timing"), groups.rollout_ranks,
                                   cfg.fragment_groups)

    def produce(step: int, claimed: gap.Claim, ahead: bool = False) -> None:
        """Generate a claim, announce it, send it to its trainer (the leader's under TSP)."""
        version = weights.version(step, ahead)  # on-policy, or one version behind when ahead
        start = time.perf_counter()
        fragment, = r.generate(step, [claimed], version, groups.rank)
        # TAG's predictor reads the rollout ranks' seconds per group
        times.report(groups.rank, time.perf_counter() - start, claimed.num_groups)
        _, dst = r.queue.announce(step, claimed.first_group, claimed.num_groups, groups.rank,
                                  [groups.leader] if cfg.tsp else groups.trainer_ranks)
        sender.put(fragment, dst)

    r.job.progress.start()
    rollout_loop(r.steps, r.queue, cfg.fragment_groups, weights, produce)
    r.job.phase("wait for the trainers' end", lambda: (sender.close(), weights.close()))


def rollout_loop(steps: range, queue: gap.FragmentQueue, fragment_groups: int,
                 weights: async_policy.RolloutWeights, produce: Callable) -> None:
    """Per step: wait for its weights, then claim `fragment_groups` groups at a time until none
    are left, each produced (generated, announced, sent) before the next claim."""
    for step in steps:
        weights.wait_for(step)  # TCSS: batch k is generated with version k
        for claimed in gap.claims(queue, step, fragment_groups,  # GAP: fast ranks claim more
                                  before_each=weights.between_fragments):  # new weights only here
            produce(step, claimed)
        weights.after_claims(step, steps.stop - 1,  # TCSS: batch k + 1 with version k, if allowed
                             lambda s: queue.claim(s, fragment_groups),
                             functools.partial(produce, ahead=True))


# === a trainer rank ===============================================================================
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
    assistant = None
    if cfg.tag and leader:  # TAG: the leader claims a share of the rollout's work for the trainers
        times = transport.RolloutTimes(r.job.prefixed("timing"), groups.rollout_ranks,
                                       cfg.fragment_groups)
        assistant = tag.Assistant(cfg.prompts_per_step, cfg.fragment_groups,
                                  len(groups.rollout_ranks), groups.num_trainers, quantum=1,
                                  claim=r.queue.claim_samples, claimed=r.queue.num_claimed_samples,
                                  announced=r.queue.num_announced_samples,
                                  rollout_gen_s=times.per_fragment_s, steps=cfg.steps,
                                  group_size=cfg.group_size)
    publisher = async_policy.Publisher(  # TCSS: the leader sends, FSDP trainers help gather
        trainer.iter_full_weights, len(trainer.params), functools.partial(
            transport.publish_weights, src=groups.leader, group=groups.publish,
            dtypes=None if cfg.lora else [r.policy.dtype] * len(trainer.params)),
        sends=leader, gathers=cfg.fsdp, tracer=r.tracer,
        on_published=assistant.published if assistant else None)
    if leader and r.queue is not None:  # per-step store keys and state, dropped after the step
        books.forgetting(r.queue.forget_old)
    if assistant is not None:
        books.forgetting(assistant.forget)
    if leader and r.batch is not None:
        books.forgetting(r.batch.forget)
    TrainerRank(r, trainer, books, publisher, assistant).run()
    return books.close()


class TrainerRank:
    """A trainer rank's loop: `run` is one RL step after another; the methods below it are its
    parts, in the order a step calls them."""

    def __init__(self, r: Rank, trainer: Trainer, books, publisher: async_policy.Publisher,
                 assistant: tag.Assistant | None):
        self.r, self.cfg, self.groups = r, r.cfg, r.groups
        self.trainer, self.books = trainer, books
        self.publisher, self.assistant = publisher, assistant
        self.bounds = grpo.minibatch_bounds(self.cfg.prompts_per_step, self.cfg.updates_per_batch)
        self.t_train = rollout.num_train_timesteps(r.sampling)
        # TSP packs that span fragments (--tsp-span): filled across arrivals, padded before updates
        self.stream = (tsp.PackStream(self.groups.trainer_index, self.groups.num_trainers,
                                      self.cfg.tsp_pack) if self.cfg.tsp and self.cfg.tsp_span
                       else None)
        self.counts = self.groups.is_leader or not self.cfg.tsp  # one trainer counts a fragment
        self.links = transport.TrainerLinks(r.groups, r.queue, r.tracer, r.job.progress)

    def run(self) -> None:
        colocated = self.groups.role == "colocated"
        if not colocated:
            self.publisher.publish(self.trainer.current_version())  # version 0, or the resumed one
        for step in self.r.steps:
            items = self.own_share(step) if colocated else self.fragments(step)  # GAP, TSP, TAG
            metrics = self.train_batch(step, items if self.cfg.gap else list(items))  # naive: all
            if self.assistant is not None:
                self.assistant.before_publish(step)  # TAG: claim part of the next batch now
            if not colocated:
                self.publisher.publish(self.trainer.current_version())  # TCSS: one version a step
            self.books.end_step(step, metrics)  # log, evaluate, checkpoint
        if not colocated:
            self.publisher.stop()

    # --- which fragments this trainer trains in a step ------------------------------------------
    def fragments(self, step: int) -> Iterable[Fragment | Announcement]:
        """Without TSP, whole fragments dealt round-robin, trained as they arrive (GAP); with TSP
        every trainer iterates the same fragments in lockstep, the leader deciding what comes next
        (the next arrival, or TAG's claim for the trainers)."""
        cfg, g, links = self.cfg, self.groups, self.links
        if not cfg.tsp:
            return gap.dealt_fragments(self.r.queue, step, gap.num_fragments(  # GAP
                cfg.prompts_per_step, cfg.fragment_groups), g.trainer_index, g.num_trainers,
                functools.partial(links.receive, step), wait=links.announced)
        arrived = lambda seq: self.r.queue.poll(step, seq) is not None  # noqa: E731
        decide = (self.assistant.strategy(step, arrived, tsp.TRAIN, tsp.PRODUCE)  # TAG
                  if self.assistant is not None else tsp.wait_for_arrival(arrived))
        fragments = tsp.lockstep_fragments(  # TSP
            cfg.prompts_per_step * cfg.group_size, g.is_leader,
            functools.partial(links.decide, step, decide), links.share_command,
            functools.partial(links.receive_seq, step), links.share_fragment,
            functools.partial(self.assist, step))
        return tag.with_advantages(fragments, self.complete)  # TAG's claims: advantages once joined

    def own_share(self, step: int) -> list[Fragment | Announcement]:
        """The colocated baseline: this rank's static 1/P of every minibatch, generated here,
        fragment_groups groups per call; the other ranks' shares only mark their groups as in."""
        g, fg = self.groups, self.cfg.fragment_groups
        mine = [f for ranges in grpo.generation_batches(
            grpo.static_claims(self.bounds, g.rank, g.world), fg)
            for f in self.r.generate(step, ranges, self.trainer.current_version(), g.rank)]
        return mine + [Announcement(-1, first, count, -1) for other in range(g.world)
                       if other != g.rank for first, count in
                       grpo.static_claims(self.bounds, other, g.world)]

    # --- Flow-GRPO's M updates over the step's fragments ----------------------------------------
    def train_batch(self, step: int, items: Iterable[Fragment | Announcement]) -> dict:
        """Minibatch j trained as its parts arrive, an update after each but the last, then the
        step's optimizer step (its metrics). Batch-level advantages and Flow-GRPO's sample
        minibatches need the whole batch first."""
        if self.r.batch is not None:  # flowgrpo/batch_rewards.py: the batch's statistics
            items = list(items)
            mine = self.r.batch.restate(step, [f for f in items if isinstance(f, Fragment)])
            items = [*mine, *(a for a in items if not isinstance(a, Fragment))]
        update = functools.partial(self.update, step)
        if self.cfg.minibatches == "samples":  # the step's samples permuted and cut into M
            keep = (self.r.batch.batch_advantages(step, []) != 0
                    if self.cfg.drop_zero_advantage else None)
            minibatches = grpo.sample_minibatches(
                self.cfg.prompts_per_step * self.cfg.group_size, self.cfg.updates_per_batch,
                grpo.minibatch_seed(self.cfg.seed, step), keep)
            grpo.train_by_samples([f for f in items if isinstance(f, Fragment)], minibatches,
                                  self.train, update, self.count)
        else:
            grpo.train_in_minibatches(items, self.bounds, self.train, update)
        self.flush()
        return self.books.optimizer_step(step)

    def update(self, step: int, j: int) -> None:
        self.flush()
        self.books.update(step)

    def train(self, fragment: Fragment) -> None:
        """This trainer's share of a fragment's (sample, timestep) pairs: TSP's packs, or every
        pair per timestep; each pair weighs 1/(N_j T_train), its minibatch's mean."""
        async_policy.check_staleness(self.trainer.version, fragment.policy_version,  # TCSS bound
                                     self.cfg.use_tcss)
        if not fragment.minibatch_samples:  # sample minibatches: counted whole (train_by_samples)
            self.count(fragment)
        moved = fragment.to(self.trainer.policy.device)
        start = time.perf_counter()
        if self.stream is not None:
            self.train_packs(self.stream.add(moved), fragment)
        else:
            g = self.groups
            packs, masks = tsp.trainer_packs(*fragment.latents.shape[:2], rank=g.trainer_index,
                                             world=g.num_trainers, pack=self.cfg.tsp_pack,
                                             spread=self.cfg.tsp)  # TSP: this trainer's pairs
            with self.train_span(fragment, masks), self.r.pace():
                self.trainer.accumulate(moved, packs, masks, self.pairs_in_minibatch(fragment))
        if self.assistant is not None:
            self.assistant.trained(fragment, time.perf_counter() - start)  # TAG's predictor

    def flush(self) -> None:
        """Before an update: the open TSP packs that span fragments, padded."""
        if self.stream is not None:
            self.train_packs(self.stream.flush(), None)

    def train_packs(self, packs, fragment: Fragment | None) -> None:
        if packs:
            with self.train_span(fragment or packs[0][0][0][0], [m for _, m in packs]), \
                    self.r.pace():
                self.trainer.accumulate_spanning(packs, self.pairs_in_minibatch)

    def pairs_in_minibatch(self, fragment: Fragment) -> int:
        return grpo.minibatch_pairs(self.bounds, self.cfg.group_size, self.t_train, fragment)

    def count(self, fragment: Fragment) -> None:
        """A fragment's rewards into the step's metrics, on one trainer."""
        if self.counts:
            self.trainer.count_fragment(fragment, self.r.reward_fn.names)

    def train_span(self, fragment: Fragment, masks) -> ContextManager:
        """A "train" span: real pairs (TSP padding excluded) and slots (what the passes cost)."""
        return self.r.tracer.span("train", step=fragment.step, first_group=fragment.first_group,
                                  pairs=sum(int(sum(mask)) for mask in masks),
                                  slots=sum(len(mask) for mask in masks))

    # --- TAG: the trainers generate the trajectories the leader claimed -------------------------
    def assist(self, step: int, lo: int, hi: int) -> Fragment:
        """Every trainer generates its share of trajectories [lo, hi) with the current weights;
        the shares are joined on every trainer (advantages once its groups are whole)."""
        start = time.perf_counter()
        g = self.groups
        fragment = tag.assisted_generation(lo, hi, g.num_trainers, g.trainer_index,
                                           generate=functools.partial(self.generate_part, step),
                                           share=self.links.share_part, join=concat_fragments,
                                           lockstep=self.cfg.fsdp,  # FSDP: the same forwards
                                           batch_size=self.cfg.sample_batch_size)
        if self.assistant is not None:
            self.assistant.generated_trajectories(step, hi - lo, time.perf_counter() - start)
        return fragment

    def generate_part(self, step: int, lo: int, hi: int, calls: int = 0) -> Fragment:
        """Trajectories [lo, hi) of the step: scored, no advantages yet."""
        g = self.cfg.group_size
        first, last = lo // g, -(-hi // g)  # the groups [lo, hi) touches, then its rows in them
        return self.r.generate(step, [(first, last - first)], self.trainer.current_version(),
                               tag.TAG_PRODUCER, part=(lo - first * g, hi - first * g),
                               calls=calls)[0]

    def complete(self, fragment: Fragment) -> Fragment:
        return rollout.with_advantages(fragment, self.r.sampling)


def main(argv=None) -> int:
    """The command line: validate, lock the run directory, run this process's rank(s)."""
    return cli.main(argv, run_rank, launch)


if __name__ == "__main__":
    sys.exit(main())
