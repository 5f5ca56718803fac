"""TSP, time-step parallelism: a fragment's (sample, timestep) pairs, packed and spread evenly over
trainers.

Paper: DigenRL, "time-step parallelism" (docs/DESIGN.md section 5). A diffusion trajectory is
trained at T_train timesteps, and each (sample, timestep) pair is an independent forward+backward:
the policy loss of one SDE step depends only on x_t, x_t+1, sigma_t and the sample's advantage. So a
fragment's m * T_train pairs can be packed `pack` at a time into one forward with per-sample
timesteps, and split evenly over the K trainer ranks. Every trainer works on every fragment (the
tail shrinks K-fold) and every rank runs the same number of passes, which FSDP requires.

Invariant: the summed gradient equals the per-timestep loop's (allclose in float32): packing only
changes which pairs share a forward, never a pair's loss or weight. Padding pairs (when K * pack
does not divide m * T_train) repeat a real pair with weight 0, so they cost compute but add nothing.

Packs that span fragments (`PackStream`, `--tsp-span`, the default): a trainer's pairs of
consecutive fragments of one step fill the same packs (pair k of the step's stream goes to trainer
k mod K); a pack is trained as soon as every trainer can fill one and only the last pack before each
update is padded, so padding is paid once per update, not once per fragment. Same invariant.

Departures from the paper: pairs are dealt round-robin (rank r gets pairs r, r+K, ...) rather than
by contiguous timestep ranges, which balances high- and low-noise steps across ranks.

The protocol (`lockstep_fragments`): under TSP the trainer group moves in lockstep. The leader
decides what the group does next (train the next announced fragment, or, with TAG, generate groups
it claimed), broadcasts that small command over the trainers' data group, and every trainer gets the
same fragment (the leader receives it and broadcasts it), then trains its own share of its pairs.

Try it: `python3 tsp.py` (alone, fake ranks: packs per trainer); in a run,
`python main.py --placement disaggregated --gap --tsp --tsp-pack 4`. Without `--tsp`, whole
fragments are dealt to trainers and trained with the per-timestep loop (`per_timestep_packs`).
Only torch and the standard library are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch

Pair = tuple[int, int]  # (sample index in the fragment, trained-timestep slot)


def per_timestep_packs(num_samples: int, num_train_timesteps: int) -> list[list[Pair]]:
    """The naive reference: one forward per trained timestep over all samples of the fragment."""
    return [[(i, j) for i in range(num_samples)] for j in range(num_train_timesteps)]


def tsp_packs(num_samples: int, num_train_timesteps: int, rank: int, world: int,
              pack: int) -> tuple[list[list[Pair]], list[list[float]]]:
    """This rank's packs of pairs and their validity masks (1 real, 0 padding).

    Every rank gets ceil(n / world) pairs rounded up to a multiple of `pack`, so all ranks run
    exactly the same number of forward/backward passes of the same size.
    """
    if pack < 1:
        raise ValueError(f"--tsp-pack must be >= 1, got {pack}")
    # timestep-major
    pairs = [(i, j) for j in range(num_train_timesteps) for i in range(num_samples)]
    per_rank = math.ceil(len(pairs) / world)
    per_rank = math.ceil(per_rank / pack) * pack
    mine = pairs[rank::world]
    mask = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    # weight-0 padding: same shape, no contribution
    mine = mine + [pairs[0]] * (per_rank - len(mine))
    packs = [mine[s:s + pack] for s in range(0, per_rank, pack)]
    masks = [mask[s:s + pack] for s in range(0, per_rank, pack)]
    return packs, masks


def trainer_packs(num_samples: int, num_train_timesteps: int, rank: int, world: int, pack: int,
                  spread: bool = True) -> tuple[list[list[Pair]], list[list[float]]]:
    """What a trainer trains of a fragment: its TSP share (`spread`), else the whole fragment per
    timestep."""
    if spread:
        return tsp_packs(num_samples, num_train_timesteps, rank, world, pack)
    packs = per_timestep_packs(num_samples, num_train_timesteps)
    return packs, [[1.0] * len(p) for p in packs]


class PackStream:
    """TSP packs that span fragments: this trainer's pairs of consecutive fragments fill the same
    packs, so padding happens once per update (flush), not once per fragment. Pair k of the stream
    (fragments in arrival order, each timestep-major) goes to trainer k mod K, so at any moment
    every trainer holds within one pair of the others; a pack is emitted when every trainer can fill
    one (all trainers see the same fragments under TSP's lockstep, so all emit the same number of
    passes, which FSDP requires)."""

    def __init__(self, rank: int, world: int, pack: int):
        if pack < 1:
            raise ValueError(f"--tsp-pack must be >= 1, got {pack}")
        self.rank, self.world, self.pack = rank, world, pack
        # pairs dealt to all trainers; packs emitted (the same on all)
        self.dealt, self.passes = 0, 0
        self.waiting: list[tuple[object, Pair]] = []  # mine, not yet packed: (fragment, pair)
        self.last: tuple[object, Pair] | None = None  # a real pair to repeat as weight-0 padding

    def add(self, fragment) -> list[tuple[list[tuple[object, Pair]], list[float]]]:
        """Deal `fragment`'s pairs; returns the packs every trainer can now fill: (items, mask)
        each."""
        m, t_train = fragment.latents.shape[:2]
        pairs = [(i, j) for j in range(t_train) for i in range(m)]  # timestep-major, as tsp_packs
        first = (self.rank - self.dealt) % self.world  # my first pair's index in this fragment
        self.waiting += [(fragment, p) for p in pairs[first::self.world]]
        self.dealt += len(pairs)
        self.last = (fragment, pairs[0])
        ready = spanning_passes(self.dealt, self.world, self.pack, last=False) - self.passes
        return self._take(ready * self.pack, ready)

    def flush(self) -> list[tuple[list[tuple[object, Pair]], list[float]]]:
        """The rest, padded: as many packs as the trainer holding the most pairs needs. Then a new
        stream."""
        packs = self._take(len(self.waiting),
                           spanning_passes(self.dealt, self.world, self.pack, True) - self.passes)
        self.dealt = self.passes = 0
        self.last = None
        return packs

    def _take(self, real: int, passes: int) -> list[tuple[list[tuple[object, Pair]], list[float]]]:
        items, self.waiting = self.waiting[:real], self.waiting[real:]
        self.passes += passes
        slots = passes * self.pack
        mask = [1.0] * len(items) + [0.0] * (slots - len(items))
        items = items + [self.last] * (slots - len(items))  # weight 0: same shapes, no contribution
        return [(items[s:s + self.pack], mask[s:s + self.pack]) for s in range(0, slots, self.pack)]


def gather_spanning(items: list[tuple[object, Pair]]) -> dict[str, torch.Tensor]:
    """gather_pairs over pairs of several fragments: one batch, the pairs in `items` order."""
    # consecutive pairs of one fragment, gathered together
    runs: list[tuple[object, list[Pair]]] = []
    for fragment, pair in items:
        if runs and runs[-1][0] is fragment:
            runs[-1][1].append(pair)
        else:
            runs.append((fragment, [pair]))
    parts = [gather_pairs(fragment, pairs) for fragment, pairs in runs]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "cond"}
    batch["cond"] = {k: torch.cat([p["cond"][k] for p in parts]) for k in parts[0]["cond"]}
    return batch


def gather_pairs(fragment, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """Stack the tensors of `pairs` of a fragment into one batch (per-sample timesteps)."""
    samples = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    slots = torch.tensor([j for _, j in pairs], dtype=torch.long)
    dev = fragment.latents.device
    samples, slots = samples.to(dev), slots.to(dev)
    return {
        "latents": fragment.latents[samples, slots],  # [p, *latent]
        "next_latents": fragment.next_latents[samples, slots],  # [p, *latent]
        "sigma": fragment.sigmas[samples, slots],  # [p] mixed timesteps in one forward
        "sigma_next": fragment.sigmas_next[samples, slots],  # [p]
        "old_log_prob": fragment.log_probs[samples, slots],  # [p]
        "advantages": fragment.advantages[samples],  # [p]
        "cond": {k: v[samples] for k, v in fragment.cond.items()},  # [p, ...]
    }


def spanning_passes(pairs: int, trainers: int, pack: int, last: bool) -> int:
    """Packs spanning fragments (PackStream): passes every trainer has run once `pairs` pairs of a
    minibatch are in. Trainer r holds pairs r, r + K, ..., so the fullest common share is
    floor(pairs / K) pairs: floor(. / pack) full packs, run as soon as they fill; `last` (the flush
    before an update): ceil(ceil(pairs / K) / pack), the last one padded. The simulator
    (tools/sim_model.py) uses it too."""
    if last:
        return math.ceil(math.ceil(pairs / trainers) / pack)
    return pairs // trainers // pack


def num_passes(num_samples: int, num_train_timesteps: int, world: int, pack: int) -> int:
    """Forward/backward passes each trainer runs per fragment under TSP (the same on every rank)."""
    return math.ceil(math.ceil(num_samples * num_train_timesteps / world) / pack)


# --- the lockstep protocol of the trainer group --------------------------------------------------
# commands: train announced fragment `a`; produce groups [a, a + b) here (e.g. TAG)
TRAIN, PRODUCE = 0, 1
Command = tuple[int, int, int]  # (kind, a, b)


def wait_for_arrival(poll: Callable[[int], bool],
                     poll_s: float = 0.001) -> Callable[[int, int], Command]:
    """The leader's default strategy: wait (no deadline) until announcement `next_seq` exists, train
    it."""
    def decide(next_seq: int, samples_done: int) -> Command:
        while not poll(next_seq):
            time.sleep(poll_s)
        return TRAIN, next_seq, 0
    return decide


def lockstep_fragments(samples_per_step: int, is_leader: bool,
                       decide: Callable[[int, int], Command] | None,
                       share_command: Callable[[Command | None], Command],
                       receive: Callable[[int], object], share_fragment: Callable[[object], object],
                       produce: Callable[[int, int], object]) -> Iterator:
    """Every trainer iterates the same fragments of one step, in the same order, until all
    trajectories are in (a fragment may be part of a group: TAG by trajectories).

    decide(next_seq, samples_done) is the leader's strategy (wait_for_arrival, or tag.Assistant's);
    it runs on the leader only and may wait. share_command broadcasts its command
    (transport.broadcast_command); receive(seq) is the leader's receive of announced fragment `seq`;
    share_fragment broadcasts the leader's copy to the group; produce(lo, hi) runs on every trainer
    for a PRODUCE command (trajectories [lo, hi) of the step)."""
    next_seq, samples_done = 0, 0
    while samples_done < samples_per_step:
        kind, a, b = share_command(decide(next_seq, samples_done) if is_leader else None)
        if kind == TRAIN:
            fragment = share_fragment(receive(a) if is_leader else None)
            next_seq += 1
        else:
            fragment = produce(a, b)
        samples_done += fragment.num_samples
        yield fragment


# --- python3 tsp.py: the mechanism alone, on fake trainers ----------------------------------------
def _demo() -> None:
    import types

    m, t_train, trainers, pack, dim = 3, 4, 2, 4, 5
    g = torch.Generator().manual_seed(0)
    fragment = types.SimpleNamespace(  # a fragment's tensors, as fragment.Fragment holds them
        latents=torch.randn(m, t_train, dim, generator=g),
        next_latents=torch.randn(m, t_train, dim, generator=g),
        sigmas=torch.rand(m, t_train, generator=g), sigmas_next=torch.rand(m, t_train, generator=g),
        log_probs=torch.zeros(m, t_train), advantages=torch.randn(m, generator=g),
        cond={"e": torch.zeros(m, 1)}, num_groups=1, num_samples=m)
    theta = torch.zeros(dim, requires_grad=True)

    def gradient(packs: list[list[Pair]], masks: list[list[float]]) -> torch.Tensor:
        """Sum over packs of the weighted pair losses' gradient (weight 1/(m T_train) per real
        pair)."""
        theta.grad = None
        for p, mask in zip(packs, masks):
            batch = gather_pairs(fragment, p)
            weights = torch.tensor(mask) / (m * t_train)  # [p]
            value = (batch["latents"] * batch["sigma"][:, None]) @ theta  # [p]: a pair's "log-prob"
            (-(batch["advantages"] * value * weights).sum()).backward()
        return theta.grad.clone()

    print(f"TSP: a fragment of {m} samples x {t_train} trained timesteps = {m * t_train} pairs, "
          f"{trainers} trainers, {pack} pairs per forward")
    total = torch.zeros(dim)
    for rank in range(trainers):
        packs, masks = tsp_packs(m, t_train, rank, trainers, pack)
        print(f"  trainer {rank}: {len(packs)} packs {packs} "
              f"(padding: {sum(x == 0 for k in masks for x in k)})")
        total += gradient(packs, masks)
    reference = gradient(*trainer_packs(m, t_train, 0, 1, pack, spread=False))
    print(f"summed TSP gradient == per-timestep loop's: {torch.allclose(total, reference)}")
    streams = [PackStream(rank, trainers, pack) for rank in range(trainers)]
    spanning = sum(len(mask) for s in streams for _ in range(3) for _, mask in s.add(fragment)) \
        + sum(len(mask) for s in streams for _, mask in s.flush())
    per_fragment = 3 * trainers * num_passes(m, t_train, trainers, pack) * pack
    print(f"3 fragments: {spanning} pair slots with packs spanning fragments, {per_fragment} "
          f"packed one by one ({3 * m * t_train} real pairs)")
    commands = iter([(TRAIN, 0, 0), (PRODUCE, 1, 1), (TRAIN, 1, 0)])
    steps = lockstep_fragments(3 * m, True, lambda seq, done: next(commands),
                               share_command=lambda c: c, receive=lambda seq: fragment,
                               share_fragment=lambda f: f,
                               produce=lambda a, b: fragment)
    print(f"lockstep: the leader's commands train, produce, train -> {len(list(steps))} fragments, "
          "3 groups")


if __name__ == "__main__":
    _demo()
