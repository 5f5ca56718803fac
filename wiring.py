"""The callables main.py hands the mechanisms: transport (transport.py) wrapped in tracing spans and
liveness names, the rollout's timed generation (TAG's predictor reads it), and the trainer group's
fragments per step.

    # gap.rollout_loop's send, on the sender thread
    send = Send(tracer, group)
    # reports seconds per group to tag.RolloutTimes
    generate = TimedGenerate(generate_fragment, rank, times)
    # TrainerSide.fragments_of: dealt or TSP
    fragments = TrainerFragments(...)

None of these decide anything: the decisions are the mechanisms' (gap, tsp, tag, tcss).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable

import comm
import gap
import grpo
import rollout
import tag
import transport
import tsp
from infra.progress import Progress
from trainer import Trainer, flush_packs, nothing, train_fragment


class Send:
    """A fragment to rank `dst` over the world's data group, inside a "send" span."""

    def __init__(self, tracer, group):
        self.tracer, self.group = tracer, group

    def __call__(self, fragment: gap.Fragment, dst: int) -> None:
        with self.tracer.span("send", step=fragment.step, first_group=fragment.first_group):
            transport.send_fragment(fragment, dst, group=self.group)
        if self.tracer.progress is not None:  # a fragment delivered (this thread's own count)
            self.tracer.progress.bump()


class TimedGenerate:
    """generate(step, first, count, version) on a rollout rank, its time per group reported for
    TAG."""

    def __init__(self, generate: Callable[..., gap.Fragment], rank: int, times: tag.RolloutTimes):
        self.generate, self.rank, self.times = generate, rank, times

    def __call__(self, step: int, first: int, count: int, version: int) -> gap.Fragment:
        start = time.perf_counter()
        fragment, = self.generate(step, [(first, count)], version, self.rank)
        self.times.report(self.rank, time.perf_counter() - start,
                          fragment.num_samples / fragment.group_size)
        return fragment


def destination(groups: comm.Groups, spread: bool, seq: int) -> int:
    """Where announced fragment `seq` goes: the leader under TSP (it shares it), else dealt
    round-robin."""
    return groups.leader if spread else groups.trainer_ranks[seq % groups.num_trainers]


class TrainerFragments:
    """The fragments this trainer trains in a step: without TSP whole fragments dealt round-robin
    (GAP); with TSP the trainer group's lockstep, the leader deciding (tsp.wait_for_arrival, or
    TAG's strategy)."""

    def __init__(self, cfg, groups: comm.Groups, queue: gap.FragmentQueue, tracer,
                 progress: Progress, generate: Callable[..., gap.Fragment],
                 version: Callable[[], int], assistant: tag.Assistant | None):
        self.cfg, self.groups, self.queue, self.tracer, self.progress = (
            cfg, groups, queue, tracer, progress)
        self.generate, self.version, self.assistant = generate, version, assistant
        self.per_step = gap.num_fragments(cfg.prompts_per_step, cfg.fragment_groups)

    def __call__(self, step: int) -> Iterable[gap.Fragment]:
        g = self.groups
        if not self.cfg.tsp:
            return gap.dealt_fragments(self.queue, step, self.per_step, g.trainer_index,
                                       g.num_trainers, functools.partial(self.receive, step),
                                       wait=self.announced)
        poll = functools.partial(self.arrived, step)
        if self.assistant is not None:
            decide = self.assistant.strategy(step, poll, tsp.TRAIN, tsp.PRODUCE)  # TAG
        else:
            decide = tsp.wait_for_arrival(poll)
        fragments = tsp.lockstep_fragments(
            self.cfg.prompts_per_step * self.cfg.group_size, g.is_leader,
            functools.partial(self.wait, step, decide), self.share_command,
            functools.partial(self.receive_seq, step), self.share_fragment,
            functools.partial(self.assist, step))
        return tag.with_advantages(fragments, self.complete)  # TAG's claims: advantages once joined

    def arrived(self, step: int, seq: int) -> bool:
        return self.queue.poll(step, seq) is not None

    def announced(self, step: int, seq: int) -> gap.Announcement:
        with self.tracer.span("wait", step=step, what="fragment"):
            return self.queue.wait(step, seq)

    def wait(self, step: int, decide: Callable[[int, int], tsp.Command], next_seq: int,
             done: int) -> tsp.Command:
        with self.tracer.span("wait", step=step, what="fragment"):
            return decide(next_seq, done)

    def receive(self, step: int, announcement: gap.Announcement) -> gap.Fragment:
        with self.tracer.span("recv", step=step, first_group=announcement.first_group):
            return transport.recv_fragment(announcement.producer, group=self.groups.world_data)

    def receive_seq(self, step: int, seq: int) -> gap.Fragment:
        return self.receive(step, self.queue.wait(step, seq))

    def share_command(self, command: tsp.Command | None) -> tsp.Command:
        with self.progress.inside("command broadcast"):
            return transport.broadcast_command(command, self.groups.leader,
                                               self.groups.trainer_data)

    def share_fragment(self, fragment: gap.Fragment | None) -> gap.Fragment:
        with self.progress.inside("fragment broadcast"):
            return transport.broadcast_fragment(fragment, self.groups.leader,
                                                self.groups.trainer_data)

    def share_part(self, part: gap.Fragment | None, owner: int) -> gap.Fragment:
        with self.progress.inside("tag share"):
            return transport.broadcast_fragment(part, self.groups.trainer_ranks[owner],
                                                self.groups.trainer_data)

    def assist(self, step: int, lo: int, hi: int) -> gap.Fragment:
        """TAG, on every trainer: generate its share of the claimed trajectories [lo, hi) with the
        current weights; the shares joined on every trainer (advantages once groups are whole)."""
        start = time.perf_counter()
        g = self.groups
        fragment = tag.assisted_generation(lo, hi, g.num_trainers, g.trainer_index,
                                           generate=functools.partial(self.generate_part, step),
                                           share=self.share_part, join=gap.concat_fragments,
                                           lockstep=self.cfg.fsdp,  # FSDP: the same forwards
                                           batch_size=self.cfg.sample_batch_size)
        if self.assistant is not None:
            self.assistant.generated_trajectories(step, hi - lo, time.perf_counter() - start)
        return fragment

    def generate_part(self, step: int, lo: int, hi: int, calls: int = 0) -> gap.Fragment:
        """Trajectories [lo, hi) of the step: scored, no advantages yet (in at least `calls` forward
        batches: FSDP's lockstep)."""
        g = self.cfg.group_size
        first, last = lo // g, -(-hi // g)  # the groups [lo, hi) touches, then its rows in them
        return self.generate(step, [(first, last - first)], self.version(), tag.TAG_PRODUCER,
                             part=(lo - first * g, hi - first * g), calls=calls)[0]

    def complete(self, fragment: gap.Fragment) -> gap.Fragment:
        """Joined whole groups with their group advantages (they need the whole group)."""
        return rollout.with_advantages(fragment, rollout.SamplingConfig.of(self.cfg))


def assistant(cfg, groups: comm.Groups, queue: gap.FragmentQueue, job) -> tag.Assistant:
    """TAG on the trainer leader: the queue's claims and counts, the rollout ranks' reported
    times."""
    times = tag.RolloutTimes(job.prefixed("timing"), groups.rollout_ranks, cfg.fragment_groups)
    return tag.Assistant(cfg.prompts_per_step, cfg.fragment_groups, len(groups.rollout_ranks),
                         groups.num_trainers,
                         quantum=1, claim=queue.claim_samples,  # split by trajectories: fits FSDP
                         claimed=queue.num_claimed_samples, announced=queue.num_announced_samples,
                         rollout_gen_s=times.per_fragment_s, steps=cfg.steps,
                         group_size=cfg.group_size)  # the predictor costs the split by trajectories


def publish(groups: comm.Groups, dtype, tensors, count: int, version: int) -> None:
    """The leader's weights to the rollout ranks, in the rollout's dtype (bf16 even with fp32
    masters here)."""
    transport.publish_weights(tensors, count, version, groups.leader, groups.publish,
                              dtypes=None if dtype is None else [dtype] * count)


def minibatch_plan(cfg, batch) -> Callable[[int], list[list[int]]] | None:
    """TrainerSide's `minibatches` with --minibatches samples (Flow-GRPO's): the step's samples
    permuted and cut into M, zero advantages dropped with --drop-zero-advantage (the batch's
    advantages: batch_rewards.BatchRewards); None for minibatches of whole groups."""
    if cfg.minibatches != "samples":
        return None
    total = cfg.prompts_per_step * cfg.group_size

    def plan(step: int) -> list[list[int]]:
        keep = batch.batch_advantages(step, []) != 0 if cfg.drop_zero_advantage else None
        return grpo.sample_minibatches(total, cfg.updates_per_batch,
                                       grpo.minibatch_seed(cfg.seed, step), keep)
    return plan


def fragment_training(cfg, groups: comm.Groups, trainer: Trainer, bounds: list[tuple[int, int]],
                      t_train: int, reward_names: list[str], tracer, pace,
                      on_trained) -> tuple[Callable, Callable, Callable]:
    """TrainerSide's `train`, `flush` and `count`: TSP's share of each fragment
    (tsp.trainer_packs; with --tsp-span its packs span fragments, tsp.PackStream, padded at flush),
    else the whole fragment per timestep; each pair weighs 1/(N_j T_train), its minibatch's mean
    (grpo.minibatch_pairs); `count` a whole fragment's rewards into the metrics (sample
    minibatches), on one trainer per fragment."""
    pairs_of = functools.partial(tsp.trainer_packs, rank=groups.trainer_index, pack=cfg.tsp_pack,
                                 world=groups.num_trainers, spread=cfg.tsp)
    stream = tsp.PackStream(groups.trainer_index, groups.num_trainers, cfg.tsp_pack) \
        if cfg.tsp and cfg.tsp_span else None
    denominators = functools.partial(grpo.minibatch_pairs, bounds, cfg.group_size, t_train)
    counts = groups.is_leader or not cfg.tsp
    count = functools.partial(trainer.count_fragment, reward_names=reward_names) if counts else \
        nothing
    train = functools.partial(train_fragment, trainer, pairs_of=pairs_of,
                              count=counts, total_pairs=denominators,
                              tcss_on=cfg.use_tcss, reward_names=reward_names, tracer=tracer,
                              pace=pace, on_trained=on_trained, stream=stream)
    if stream is None:
        return train, nothing, count
    return train, functools.partial(flush_packs, trainer, stream, denominators, tracer, pace), count
