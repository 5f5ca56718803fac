"""The placements: who generates, who trains, and what crosses between them (DESIGN.md sections 4-5).

- `run_colocated`: every rank generates its share of the batch, then every rank trains, gradients summed.
- `run_rollout` / `run_trainer`: the disaggregated placement. Rollout ranks claim fragments from the
  store-backed queue and stream them to the trainers; trainers consume them (GAP) or wait for the
  whole batch (naive barrier), train pairs dealt by fragment or spread by TSP, optionally generate
  fragments themselves (TAG), and publish weights that rollout ranks pick up between fragments,
  possibly one version late (TCSS).
"""
from __future__ import annotations

import dataclasses
import queue as queue_lib
import threading
import time

import torch
import torch.distributed as dist

import async_policy
import gap
import tag
import tsp
from infra import emulate
from rollout import generate_fragment

TRAIN, ASSIST, IDLE = 1, 2, 3  # trainer-group commands broadcast by the leader under TSP
TAG_PRODUCER = -2  # the producer rank recorded on fragments the trainer group generated itself


@dataclasses.dataclass
class Groups:
    """Rank layout and process groups, built identically on every rank (new_group order matters)."""

    rank: int
    world: int
    rollout_ranks: list[int]
    trainer_ranks: list[int]
    trainer: object = None  # process group of the trainer ranks (None at world size 1)
    publish: object = None  # leader + rollout ranks: weight publishing

    @property
    def leader(self) -> int:
        return self.trainer_ranks[0]

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainer_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def role(self) -> str:
        if self.is_trainer and self.is_rollout:
            return "colocated"
        return "trainer" if self.is_trainer else "rollout"


def build_groups(rank: int, world: int, placement: str, rollout_ranks: int, timeout=None) -> Groups:
    if placement == "colocated" or world == 1:
        ranks = list(range(world))
        group = dist.new_group(ranks, timeout=timeout) if world > 1 else None
        return Groups(rank, world, ranks, ranks, trainer=group)
    rollout, trainers = list(range(rollout_ranks)), list(range(rollout_ranks, world))
    trainer_group = dist.new_group(trainers, timeout=timeout)
    publish_group = dist.new_group([trainers[0]] + rollout, timeout=timeout)
    return Groups(rank, world, rollout, trainers, trainer=trainer_group, publish=publish_group)


@dataclasses.dataclass
class Job:
    """Everything a rank's loop needs; built by main.py."""

    cfg: object  # main.Config
    groups: Groups
    policy: object
    prompts: list[str]
    sampling: object  # rollout.SamplingConfig
    reward_fn: object
    reward_names: list[str]
    queue: gap.FragmentQueue | None
    tracer: object
    comm_device: str = "cpu"
    start_step: int = 0
    on_step_end: object = None  # callback(step, metrics, trainer) on trainer ranks

    def spec(self, step: int, index: int) -> gap.FragmentSpec:
        c = self.cfg
        return gap.fragment_spec(c.seed, step, index, len(self.prompts), c.prompts_per_step, c.group_size,
                                 c.fragment_groups, shared_group_noise=(c.algo == "dance_grpo"))

    def generate(self, spec, version, producer) -> gap.Fragment:
        with self.tracer.span("generate", step=spec.step, index=spec.index, version=version,
                              samples=len(spec.prompt_ids)):
            with emulate.paced(emulate.speed_of(self.cfg.rank_speed, self.groups.rank)):  # bench only
                return generate_fragment(self.policy, spec, self.prompts, self.sampling, self.reward_fn,
                                         version, producer)

    @property
    def fragments_per_step(self) -> int:
        return self.cfg.prompts_per_step // self.cfg.fragment_groups

    @property
    def total_pairs(self) -> int:
        from rollout import num_train_timesteps
        return self.cfg.prompts_per_step * self.cfg.group_size * num_train_timesteps(self.sampling)


def train_fragment(job: Job, trainer, fragment: gap.Fragment, spread: bool) -> None:
    """Train this rank's share of a fragment: TSP packs over the trainer group, or the per-timestep loop."""
    m, t_train = fragment.latents.shape[:2]
    if spread:
        k = len(job.groups.trainer_ranks)
        me = job.groups.trainer_ranks.index(job.groups.rank)
        packs, masks = tsp.tsp_packs(m, t_train, me, k, job.cfg.tsp_pack)
    else:
        packs = tsp.per_timestep_packs(m, t_train)
        masks = [[1.0] * len(p) for p in packs]
    start = time.perf_counter()
    pairs = sum(int(sum(mask)) for mask in masks)  # real pairs (TSP padding excluded)
    with job.tracer.span("train", step=fragment.step, index=fragment.index, pairs=pairs):
        with emulate.paced(emulate.speed_of(job.cfg.rank_speed, job.groups.rank)):  # bench only
            trainer.accumulate(fragment.to(job.policy.device), packs, masks, job.total_pairs)
    trainer.tag_estimates["train"].update(time.perf_counter() - start)


def finish_step(job: Job, trainer, step: int) -> dict:
    with job.tracer.span("optimizer", step=step):
        metrics = trainer.step(job.reward_names)
    if job.on_step_end is not None:
        job.on_step_end(step, metrics, trainer)
    trainer.assisted.pop(step, None)
    if job.queue is not None and job.groups.rank == job.groups.leader and step >= 2:
        job.queue.forget(step - 2)  # every rank is past step - 2: rollout ranks run at most one step ahead
    job.tracer.mark_step(step)
    return metrics


# --- colocated -----------------------------------------------------------------------------------
def run_colocated(job: Job, trainer) -> None:
    g = job.groups
    for step in range(job.start_step, job.cfg.steps):
        mine = range(g.rank, job.fragments_per_step, g.world)  # static share: every rank the same work
        fragments = [job.generate(job.spec(step, i), trainer.version, g.rank) for i in mine]
        for fragment in fragments:
            async_policy.check_staleness(trainer.version, fragment.policy_version, async_on=False)
            trainer.count_fragment(fragment, job.reward_names)
            train_fragment(job, trainer, fragment, spread=False)
        finish_step(job, trainer, step)


# --- rollout ranks ---------------------------------------------------------------------------------
class Sender:
    """A background thread that sends finished fragments, so generation of the next one starts at once."""

    def __init__(self, job: Job):
        self.job, self.items, self.error = job, queue_lib.Queue(), None
        self.thread = threading.Thread(target=self._run, name="fragment-sender", daemon=True)
        self.thread.start()

    def _run(self):
        try:
            while (item := self.items.get()) is not None:
                fragment, dst = item
                with self.job.tracer.span("send", step=fragment.step, index=fragment.index):
                    gap.send_fragment(fragment, dst, device=self.job.comm_device)
        except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
            self.error = exc

    def put(self, fragment, dst):
        if self.error is not None:
            raise RuntimeError(f"fragment sender failed: {self.error}") from self.error
        self.items.put((fragment, dst))

    def close(self, timeout_s):
        self.items.put(None)
        self.thread.join(timeout_s)
        if self.error is not None:
            raise RuntimeError(f"fragment sender failed: {self.error}") from self.error


def destination_of(job: Job):
    trainers = job.groups.trainer_ranks
    if job.cfg.tsp:
        return lambda seq: trainers[0]  # the leader receives and broadcasts to the trainer group
    return lambda seq: trainers[seq % len(trainers)]  # fragments dealt round-robin


def run_rollout(job: Job, params: list[torch.Tensor]) -> None:
    g, cfg, q = job.groups, job.cfg, job.queue
    mailbox = async_policy.Mailbox(g.leader, g.publish, job.comm_device, timeout_s=cfg.timeout_s)
    sender = Sender(job)
    store = q.store

    def produce(step, index, version):
        start = time.perf_counter()
        fragment = job.generate(job.spec(step, index), version, g.rank)
        store.set(f"gen_time/{g.rank}", f"{time.perf_counter() - start:.6f}")  # for the TAG predictor
        _, dst = q.announce(step, index, g.rank, destination_of(job))
        sender.put(fragment, dst)

    try:
        for step in range(job.start_step, cfg.steps):
            with job.tracer.span("wait", step=step, what="weights"):
                mailbox.wait_for(async_policy.version_for_step(step))
            while True:
                version = mailbox.swap_into(params)  # only here, between fragments
                index = q.claim(step)
                if index is None:
                    break
                async_policy.check_staleness(step, version, async_on=False)  # on-policy for batch `step`
                produce(step, index, version)
            # Batch `step` is fully claimed. TCSS: start batch step+1 with the weights we hold.
            while (cfg.use_async and step + 1 < cfg.steps and mailbox.latest_version() < step + 1
                   and async_policy.may_generate_stale(lambda: q.counter("stale", step + 1), cfg.max_stale_fragments)):
                index = q.claim(step + 1)
                if index is None:
                    break
                version = mailbox.held_version
                async_policy.check_staleness(step + 1, version, async_on=True)
                produce(step + 1, index, version)
        sender.close(cfg.timeout_s)
        mailbox.join(cfg.timeout_s)
    finally:
        if mailbox.error is not None:
            raise RuntimeError(f"weight mailbox failed: {mailbox.error}") from mailbox.error


# --- trainer ranks -------------------------------------------------------------------------------
def receive(job: Job, step: int, seq: int, wait: bool = True):
    """Wait for announcement `seq` of `step` and receive it if it is addressed to this rank."""
    q = job.queue
    with job.tracer.span("wait", step=step, what="fragment"):
        producer, index, dst = q.wait(step, seq) if wait else q.poll(step, seq)
    if dst != job.groups.rank:
        return None
    with job.tracer.span("recv", step=step, index=index):
        return gap.recv_fragment(producer, device=job.comm_device)


def run_trainer(job: Job, trainer) -> None:
    g, cfg = job.groups, job.cfg
    is_leader = g.rank == g.leader
    _publish(job, trainer, is_leader)
    for step in range(job.start_step, cfg.steps):
        if cfg.tsp:
            _tsp_step(job, trainer, step, is_leader)
        else:
            _dealt_step(job, trainer, step)
        finish_step(job, trainer, step)
        _publish(job, trainer, is_leader)
    if is_leader:
        async_policy.publish(trainer.params, async_policy.STOP, g.leader, g.publish, job.comm_device)


def _publish(job: Job, trainer, is_leader: bool) -> None:
    """The leader broadcasts whole weights; under FSDP every trainer takes part in gathering them (a collective)."""
    if not (is_leader or trainer.sharded):
        return
    with job.tracer.span("publish", version=trainer.version):
        weights = trainer.full_weights()
        if is_leader:
            async_policy.publish(weights, trainer.version, job.groups.leader, job.groups.publish, job.comm_device)


def _consume(job, trainer, fragment, spread, count):
    async_policy.check_staleness(trainer.version, fragment.policy_version, async_on=job.cfg.use_async)
    if count:
        trainer.count_fragment(fragment, job.reward_names)
    train_fragment(job, trainer, fragment, spread)


def _dealt_step(job: Job, trainer, step: int) -> None:
    """No TSP: this trainer takes announcements seq = me, me + K, ... and trains whole fragments."""
    k = len(job.groups.trainer_ranks)
    me = job.groups.trainer_ranks.index(job.groups.rank)
    mine = range(me, job.fragments_per_step, k)
    if job.cfg.gap:
        for seq in mine:
            _consume(job, trainer, receive(job, step, seq), spread=False, count=True)
    else:  # the naive barrier: receive the whole (dealt) batch, then train
        for fragment in [receive(job, step, seq) for seq in mine]:
            _consume(job, trainer, fragment, spread=False, count=True)


def _tsp_step(job: Job, trainer, step: int, is_leader: bool) -> None:
    """TSP: the leader picks the next fragment (arrived, or generated by TAG) and every trainer trains a share."""
    g, cfg = job.groups, job.cfg
    total, done, next_seq = job.fragments_per_step, 0, 0
    held = []  # the naive barrier keeps fragments until the batch is complete
    while done < total:
        command = torch.zeros(3, dtype=torch.int64)
        if is_leader:
            command = _leader_decide(job, trainer, step, next_seq)
        if g.trainer is not None and len(g.trainer_ranks) > 1:
            dist.broadcast(command, src=g.leader, group=g.trainer)
        kind, value = int(command[0]), int(command[1])
        if kind == TRAIN:
            fragment = receive(job, step, next_seq) if is_leader else None
            next_seq += 1
            fragment = gap.broadcast_fragment(fragment, g.leader, g.trainer, job.comm_device)
        else:  # ASSIST: the trainer group generates fragment `value` itself
            fragment = _assist(job, trainer, step, value)
        done += 1
        if cfg.gap:
            _consume(job, trainer, fragment, spread=True, count=is_leader)
        else:
            held.append(fragment)
    for fragment in held:
        _consume(job, trainer, fragment, spread=True, count=is_leader)


def _leader_decide(job: Job, trainer, step: int, next_seq: int) -> torch.Tensor:
    """Block until there is something to do: train an arrived fragment, or (TAG) generate one."""
    q, cfg = job.queue, job.cfg
    deadline = time.monotonic() + cfg.timeout_s
    with job.tracer.span("wait", step=step, what="fragment"):
        while True:
            if q.poll(step, next_seq) is not None:
                return torch.tensor([TRAIN, next_seq, 0])
            if cfg.tag and cfg.gap and _tag_wants(job, trainer, step, next_seq):
                index = q.claim(step)
                if index is not None:
                    return torch.tensor([ASSIST, index, 0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer waited {cfg.timeout_s:.0f}s for fragment {next_seq} of step {step}")
            time.sleep(0.002)


def _tag_wants(job: Job, trainer, step: int, next_seq: int) -> bool:
    q, est = job.queue, trainer.tag_estimates
    claimed = q.num_claimed(step)
    announced = q.num_announced(step)
    rollout_gen = [float(v) for r in job.groups.rollout_ranks
                   if (v := _store_get(q.store, f"gen_time/{r}")) is not None]
    if rollout_gen:
        est["gen_rollout"].update(sum(rollout_gen) / len(rollout_gen))
    state = tag.StepState(
        unclaimed=job.fragments_per_step - claimed, in_flight=max(claimed - announced - trainer.assisted.get(step, 0), 0),
        waiting=announced - next_seq, rollout_ranks=len(job.groups.rollout_ranks),
        gen_rollout_s=est["gen_rollout"].value, gen_trainer_s=est["gen_trainer"].value, train_s=est["train"].value)
    return tag.should_assist(state)


def _store_get(store, key):
    return store.get(key).decode() if store.check([key]) else None


def _assist(job: Job, trainer, step: int, index: int) -> gap.Fragment:
    """TAG: every trainer generates its share of the fragment's groups with its own current weights."""
    g = job.groups
    k, me = len(g.trainer_ranks), g.trainer_ranks.index(g.rank)
    spec = job.spec(step, index)
    groups = len(spec.prompt_ids) // spec.group_size
    start = time.perf_counter()
    # Every trainer generates its own share at the same time (under FSDP their forwards must run together),
    # then each share is broadcast to the group.
    lo, hi = tag.split_groups(groups, k, me)
    mine = None
    if lo < hi:
        rows = slice(lo * spec.group_size, hi * spec.group_size)
        sub = dataclasses.replace(spec, prompt_ids=spec.prompt_ids[rows], init_seeds=spec.init_seeds[rows],
                                  noise_seeds=spec.noise_seeds[rows])
        with job.tracer.span("tag", step=step, index=index, samples=len(sub.prompt_ids)), \
                emulate.paced(emulate.speed_of(job.cfg.rank_speed, g.rank)):  # bench only
            mine = generate_fragment(job.policy, sub, job.prompts, job.sampling, job.reward_fn,
                                     trainer.version, TAG_PRODUCER)
    shares = [tag.split_groups(groups, k, r) for r in range(k)]
    parts = [gap.broadcast_fragment(mine if r == me else None, g.trainer_ranks[r], g.trainer, job.comm_device)
             for r, (lo_r, hi_r) in enumerate(shares) if lo_r < hi_r] if k > 1 else [mine]
    trainer.assisted[step] = trainer.assisted.get(step, 0) + 1
    trainer.tag_estimates["gen_trainer"].update(time.perf_counter() - start)
    return gap.concat_fragments(parts)
