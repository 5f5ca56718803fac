"""GAP, the generation-axis pipeline: fragments of whole GRPO groups streamed from rollout to
trainer.

Paper: DigenRL, "generation-axis pipeline" (docs/DESIGN.md sections 4-5). A batch of B prompts x G
samples is cut into fragments: contiguous ranges of whole groups. Ranks claim ranges from an atomic
counter of trajectories in a torch.distributed store (compare-and-set): rollout ranks take
`fragment_groups` groups at a time, so fast ranks take more, and an idle trainer can take a share
(TAG, tag.py).
A trajectory's prompt and noise seeds depend only on (seed, step, its global index in the batch), so
a fragment yields the same trajectories whichever rank generates it and however the batch is cut
(fragment.py: what a fragment holds; the queue here never looks inside one).
A finished fragment is announced in the store (sequence number -> producer, groups, destination),
so the trainer knows whom to receive from without any-source receives (NCCL has none), then sent
point to point over gloo: a fixed-size int64 header, then one uint8 buffer with every tensor's
bytes. The trainer trains each fragment as it arrives (GAP) or after the whole batch (the naive
barrier): main.py's trainer loop; Flow-GRPO's M updates per batch are grpo.py's.

Invariant: the update from fragments consumed as they arrive equals the full-batch update (allclose
in float32): every (sample, timestep) pair carries weight 1/(N T_train) and gradients add.

Departures from the paper: claiming is pull-based through the store (the paper schedules centrally);
advantages are normalised per group so that a fragment is self-contained.

Try it: `python3 gap.py` (alone, a scripted clock: which fragment trains while which is generated);
in a run,
`python main.py --placement disaggregated --gap` (or `--mode digenrl`); without `--gap` the
trainer receives the whole batch before training (`--mode naive`).
Only torch and the standard library are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, TypeVar

import torch

Received = TypeVar("Received")  # what a trainer receives: fragment.Fragment in a run


# --- the idea: a rollout rank claims a range of whole groups, generates it, announces it, sends
# it (main.rollout_loop); the trainer trains each as it arrives (main.TrainerRank); every pair
# weighs 1/(N T_train), so any order gives one update
def claims(queue: FragmentQueue, step: int, fragment_groups: int,
           before_each: Callable[[], object] = lambda: None) -> Iterator[Claim]:
    """Claim `fragment_groups` groups of `step` at a time until none are left; each claim is
    generated and streamed before the next one is taken."""
    while True:
        before_each()  # e.g. swap in new weights: only ever between fragments
        claimed = queue.claim(step, fragment_groups)
        if claimed is None:
            return
        yield claimed


# --- the trainer side: receive and train as fragments arrive --------------------------------------
def dealt_fragments(queue: FragmentQueue, step: int, fragments_per_step: int, trainer_index: int,
                    num_trainers: int, receive: Callable[[Announcement], Received],
                    wait: Callable[[int, int], Announcement] | None = None
                    ) -> Iterable[Received | Announcement]:
    """Without TSP: trainer k of K receives announcements k, k + K, ... and trains whole fragments.
    The other trainers' announcements are yielded as they are (no data): they tell which groups are
    in, which is when a minibatch is complete (grpo.train_in_minibatches). `wait(step, seq)`: how
    to wait for an announcement (queue.wait unless given)."""
    wait = wait or queue.wait
    for seq in range(fragments_per_step):
        announcement = wait(step, seq)
        yield receive(announcement) if seq % num_trainers == trainer_index else announcement


# --- the batch's cut and the 1/(N T_train) weighting ---------------------------------------------
def num_fragments(groups_per_step: int, fragment_groups: int) -> int:
    if fragment_groups < 1 or groups_per_step % fragment_groups:
        raise ValueError(f"--fragment-groups {fragment_groups} must divide the {groups_per_step} "
                         "groups of a step")
    return groups_per_step // fragment_groups


def total_pairs(groups_per_step: int, group_size: int, num_train_timesteps: int) -> int:
    """N T_train: the (sample, timestep) pairs of one whole batch."""
    return groups_per_step * group_size * num_train_timesteps


def pair_weights(mask: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """Each real pair's loss weight 1/(N T_train) (0 for padding): whichever rank trains whichever
    pair, in whatever packing and order, the summed gradient is the full-batch mean's gradient."""
    return mask / num_pairs  # [p]


# --- the fragment queue (claims and announcements in a torch.distributed store) --------------
@dataclasses.dataclass
class Announcement:
    producer: int
    first_group: int
    num_groups: int
    destination: int


class Claim(NamedTuple):
    """What a claim took: groups [first_group, first_group + num_groups) of its step."""

    first_group: int
    num_groups: int


_NEVER = "\x00never"  # a value no claim writes


class FragmentQueue:
    """Atomic claims of trajectory ranges and ordered completion announcements, per step.

    The claim counter counts TRAJECTORIES (TAG's predictor reads it so), advanced by
    compare-and-set; every claim is whole groups: a rollout rank's (`claim`) and the TAG leader's
    (`claim_samples`)."""

    def __init__(self, store, groups_per_step: int, poll_s: float = 0.001, group_size: int = 1):
        self.store, self.groups_per_step, self.poll_s = store, groups_per_step, poll_s
        self.group_size = group_size
        self.samples_per_step = groups_per_step * group_size
        self._token, self._claims = f"{id(self):x}.{time.time_ns():x}", 0
        self._seen: dict[int, str] = {}  # step -> the counter's value this rank saw last

    def claim(self, step: int, num_groups: int) -> Claim | None:
        """The next `num_groups` unclaimed groups of `step` (fewer at the end): a Claim, or None."""
        return self._advance(step, lambda lo: lo + num_groups * self.group_size)

    def claim_samples(self, step: int, count: int) -> Claim | None:
        """The next `count` unclaimed trajectories of `step` (fewer at the end): whole groups, so
        `count` is a multiple of the group size (TAG's leader counts in trajectories)."""
        if count % self.group_size:
            raise ValueError(f"a claim of {count} trajectories is not whole groups of "
                             f"{self.group_size}")
        return self._advance(step, lambda lo: lo + count)

    def _advance(self, step: int, end_of: Callable[[int], int]) -> Claim | None:
        """Move the counter from lo to end_of(lo) atomically (store compare_set; a unique value per
        claim, so two claimers that read the same lo cannot both win). One round trip when nobody
        claimed since this rank last looked: a failed compare_set answers the current value."""
        key, current = f"claim/{step}", self._seen.pop(step, "")
        while True:
            lo = int(current.split()[0]) if current else 0
            if lo >= self.samples_per_step:
                self._seen[step] = current
                return None
            hi = min(end_of(lo), self.samples_per_step)
            self._claims += 1
            mine = f"{hi} {self._token}.{self._claims}"
            now = self.store.compare_set(key, current, mine).decode()
            if now == mine:
                self._seen = {k: v for k, v in self._seen.items() if k >= step - 2}  # bounded
                self._seen[step] = mine
                return Claim(lo // self.group_size, (hi - lo) // self.group_size)
            current = "" if now == current else now  # answered our guess: the key is not there

    def num_claimed_samples(self, step: int) -> int:
        """One round trip: a compare_set that never matches answers the value (or, for a missing
        key, its own expected value)."""
        now = self.store.compare_set(f"claim/{step}", _NEVER, _NEVER).decode()
        return 0 if now == _NEVER else int(now.split()[0])

    def announce(self, step: int, first_group: int, num_groups: int, producer: int,
                 destinations: list[int] | None = None) -> tuple[int, int]:
        """Publish 'these groups are done by `producer`'; returns (sequence number, destination
        rank): announcement seq goes to destinations[seq % len(destinations)] (the trainers in
        turn; the leader alone under TSP), -1 without."""
        seq = self.store.add(f"done/{step}", 1) - 1
        destination = destinations[seq % len(destinations)] if destinations else -1
        self.store.add(f"done_samples/{step}", num_groups * self.group_size)
        self.store.set(f"done/{step}/{seq}", f"{producer},{first_group},{num_groups},{destination}")
        return seq, destination

    def num_announced(self, step: int) -> int:
        return self.store.add(f"done/{step}", 0)

    def num_announced_samples(self, step: int) -> int:
        return self.store.add(f"done_samples/{step}", 0)

    def poll(self, step: int, seq: int) -> Announcement | None:
        key = f"done/{step}/{seq}"
        if not self.store.check([key]):
            return None
        return Announcement(*(int(x) for x in self.store.get(key).decode().split(",")))

    def wait(self, step: int, seq: int) -> Announcement:
        """Block until announcement `seq` exists: no deadline (a step may take minutes); liveness
        ends a job whose producer died. Polled, so the store connection is never held by a blocking
        wait."""
        while (found := self.poll(step, seq)) is None:
            time.sleep(self.poll_s)
        return found

    def forget_old(self, step: int) -> None:
        """At the end of step `step`: every rank is past step - 2 (rollout ranks run at most one
        ahead)."""
        if step >= 2:
            self.forget(step - 2)

    def forget(self, step: int) -> None:
        """Delete step `step`'s keys once every rank is past it: the store must not grow per
        step."""
        announced = range(self.num_announced(step))
        keys = [f"claim/{step}", f"done/{step}",
                f"done_samples/{step}"] + [f"done/{step}/{s}" for s in announced]
        for key in keys:
            self.store.delete_key(key)
        self._seen.pop(step, None)


# --- python3 gap.py: the mechanism alone, on fake ranks -------------------------------------------
class _DemoFragment(NamedTuple):
    """A stand-in for a generated fragment (fragment.Fragment in a run; the queue never looks inside
    one): its groups, the rank that made it, and what the demo's trainer reads."""

    first_group: int
    producer: int
    latents: torch.Tensor  # [m, T_train, dim]
    advantages: torch.Tensor  # [m]


def _demo_generate(claimed: Claim, producer: int, group_size: int, t_train: int,
                   dim: int) -> _DemoFragment:
    """A stand-in for generation: latents seeded by each trajectory's index in the batch (any rank
    makes the same ones), reward = the latent's first value, advantages within each group."""
    first = claimed.first_group * group_size
    seeds = range(first, first + claimed.num_groups * group_size)
    x = torch.stack([torch.randn(t_train, dim, generator=torch.Generator().manual_seed(s))
                     for s in seeds])  # [m, T_train, dim]
    grouped = x[:, 0, 0].reshape(-1, group_size)
    adv = ((grouped - grouped.mean(1, keepdim=True))
           / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return _DemoFragment(claimed.first_group, producer, x, adv)


def _demo() -> None:
    import torch.distributed as dist

    groups, group_size, t_train, dim = 6, 2, 3, 4
    gen_s, train_s, tick = {0: 1.0, 1: 1.5}, 0.5, 0.5  # rollout rank 1 is slower; s per group
    queue = FragmentQueue(dist.HashStore(), groups, group_size=group_size)  # the job's store
    free_at, arrivals = {0: 0.0, 1: 0.0}, []  # (done, start, fragment)
    print(f"GAP: {groups} groups of {group_size}; rollout rank 0 generates a group in "
          f"{gen_s[0]} s, rank 1 in {gen_s[1]} s; the trainer trains one in {train_s} s. Whichever "
          "rank is free first claims the next group from the queue (ties: the lower rank).")
    while True:  # a scripted clock, so the ranks' order is the same every run
        rank = min(free_at, key=lambda r: (free_at[r], r))
        claimed = queue.claim(0, 1)
        if claimed is None:
            break
        start, free_at[rank] = free_at[rank], free_at[rank] + gen_s[rank]
        queue.announce(0, claimed.first_group, claimed.num_groups, producer=rank)
        arrivals.append((free_at[rank], start,
                         _demo_generate(claimed, rank, group_size, t_train, dim)))
    arrivals.sort(key=lambda a: a[0])
    theta = torch.zeros(dim, requires_grad=True)  # the trainer's model: loss = -adv * <theta, x>
    n_pairs = total_pairs(groups, group_size, t_train)

    def train(fragment: _DemoFragment) -> None:
        weights = pair_weights(torch.ones(fragment.latents.shape[:2]), n_pairs)  # [m, T_train]
        (-(fragment.advantages[:, None] * (fragment.latents @ theta) * weights).sum()).backward()

    rows, clock = {"rollout 0": {}, "rollout 1": {}, "trainer  ": {}}, 0.0
    for done, start, fragment in arrivals:  # GAP: each fragment trained as soon as it is in
        for t in range(int(start / tick), int(done / tick)):
            rows[f"rollout {fragment.producer}"][t] = str(fragment.first_group)
        clock = max(clock, done)
        for t in range(int(clock / tick), int((clock + train_s) / tick)):
            rows["trainer  "][t] = str(fragment.first_group)
        print(f"  t={clock:3.1f}-{clock + train_s:3.1f} s: the trainer trains group "
              f"{fragment.first_group} (rank {fragment.producer}'s); meanwhile "
              + (", ".join(f"rank {f.producer} generates group {f.first_group}"
                           for d, s0, f in arrivals if s0 < clock + train_s and d > clock)
                 or "nothing is generated"))
        train(fragment)
        clock += train_s
    streamed, theta.grad = theta.grad.clone(), None
    span = int(max(clock, arrivals[-1][0]) / tick)
    print(f"timeline ({tick} s a column; the digit is the group):")
    for name, row in rows.items():
        print(f"  {name} |" + "".join(row.get(t, ".") for t in range(span)) + "|")
    barrier = arrivals[-1][0] + groups * train_s
    print(f"the step ends at {clock:.1f} s; the naive barrier (train after the last arrival) at "
          f"{barrier:.1f} s")
    in_order = [f for _, _, f in sorted(arrivals, key=lambda a: a[2].first_group)]
    train(_DemoFragment(0, -1, torch.cat([f.latents for f in in_order]),  # the whole batch at once
                        torch.cat([f.advantages for f in in_order])))
    print(f"streamed gradient == full-batch gradient: {torch.allclose(streamed, theta.grad)}")


if __name__ == "__main__":
    _demo()
