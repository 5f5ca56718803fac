"""GAP, the generation-axis pipeline: fragments of whole GRPO groups streamed from rollout to trainer.

Paper: DigenRL, "generation-axis pipeline" (docs/DESIGN.md sections 4-5). A batch of B prompts x G
samples is cut into fragments: contiguous ranges of whole groups. Ranks claim group ranges from an
atomic counter in a torch.distributed store (`store.add`): rollout ranks take `fragment_groups`
groups at a time, so fast ranks take more, and an idle trainer can take a share (TAG, tag.py).
A trajectory's prompt and noise seeds depend only on (seed, step, its global index in the batch), so
a fragment yields the same trajectories whichever rank generates it and however the batch is cut.
A finished fragment is announced in the store (sequence number -> producer, groups, destination),
so the trainer knows whom to receive from without any-source receives (NCCL has none), then sent
point to point over gloo: a fixed-size int64 header, then one uint8 buffer with every tensor's bytes.
The trainer side is `consume`: train each fragment as it arrives (GAP) or after the whole batch (the
naive barrier).

Invariant: the update from fragments consumed as they arrive equals the full-batch update (allclose
in float32): every (sample, timestep) pair carries weight 1/(N T_train) and gradients add.

Departures from the paper: claiming is pull-based through the store (the paper schedules centrally);
advantages are normalised per group so that a fragment is self-contained.

Try it: `python main.py --placement disaggregated --gap` (or `--mode digenrl`); without `--gap` the
trainer receives the whole batch before training (`--mode naive`).
Only torch and the standard library are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

HEADER_LEN = 160
MAGIC = 0x6469_6765  # "dige"
MAX_DIMS = 7
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.float64]


@dataclasses.dataclass
class FragmentSpec:
    """What to generate: groups [first_group, first_group + num_groups) of RL step `step`."""

    step: int
    first_group: int
    prompt_ids: list[int]  # one per trajectory (members of a group are contiguous)
    init_seeds: list[int]  # initial-noise seed per trajectory (shared within a group for DanceGRPO)
    noise_seeds: list[int]  # per-step noise seed per trajectory
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids) // self.group_size


@dataclasses.dataclass
class Fragment:
    """The wire format: everything the trainer needs to train m trajectories (whole groups)."""

    step: int
    first_group: int  # the fragment's groups are [first_group, first_group + num_groups) of its step
    policy_version: int  # the weights version that generated every trajectory of this fragment
    producer: int  # rank that generated it (a negative value marks a trainer-assisted fragment)
    group_size: int
    prompt_ids: torch.Tensor  # [m] int64
    cond: dict[str, torch.Tensor]  # prompt embeddings, batch first [m, ...]
    latents: torch.Tensor  # [m, T_train, *latent] x at each trained timestep
    next_latents: torch.Tensor  # [m, T_train, *latent] x at the following timestep (the scored sample)
    timestep_index: torch.Tensor  # [m, T_train] int64 position in the sampling schedule
    sigmas: torch.Tensor  # [m, T_train]
    sigmas_next: torch.Tensor  # [m, T_train]
    log_probs: torch.Tensor  # [m, T_train] behaviour log-probs recorded at rollout
    rewards: torch.Tensor  # [m] the combined reward
    reward_parts: torch.Tensor  # [m, n_rewards] each named reward (for metrics)
    advantages: torch.Tensor  # [m]

    @property
    def num_samples(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return self.num_samples // self.group_size

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        out.update({f"cond.{k}": v for k, v in sorted(self.cond.items())})
        return out

    def to(self, device) -> "Fragment":
        return _from_tensors(self._ints(), {k: v.to(device) for k, v in self.tensors().items()})

    def _ints(self) -> list[int]:
        return [self.step, self.first_group, self.policy_version, self.producer, self.group_size]


def _from_tensors(ints: list[int], tensors: dict[str, torch.Tensor]) -> Fragment:
    cond = {k[len("cond."):]: v for k, v in tensors.items() if k.startswith("cond.")}
    plain = {k: v for k, v in tensors.items() if not k.startswith("cond.")}
    step, first_group, version, producer, group_size = ints
    return Fragment(step=step, first_group=first_group, policy_version=version, producer=producer,
                    group_size=group_size, cond=cond, **plain)


def concat_fragments(parts: list[Fragment]) -> Fragment:
    """Join sub-fragments of consecutive groups (in group order) back into one fragment."""
    tensors = [p.tensors() for p in parts]
    joined = {k: torch.cat([t[k] for t in tensors]) for k in tensors[0]}
    return _from_tensors(parts[0]._ints(), joined)


# --- batch -> fragments ----------------------------------------------------------------------
def fragment_spec(seed: int, step: int, first_group: int, num_groups: int, num_prompts_total: int,
                  groups_per_step: int, group_size: int, shared_group_noise: bool = False) -> FragmentSpec:
    """Groups [first_group, first_group + num_groups) of step `step`: prompts and seeds depend only on
    (seed, step, global trajectory index), so any cut of the batch gives the same trajectories."""
    # The step's prompts: a seeded permutation, so every rank agrees without communication.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    order = torch.randperm(max(num_prompts_total, groups_per_step), generator=gen) % num_prompts_total
    groups = order[:groups_per_step][first_group:first_group + num_groups].tolist()
    prompt_ids = [p for p in groups for _ in range(group_size)]
    base = (seed * 1_000_003 + step) * 1_000_033
    first = first_group * group_size  # global index of the fragment's first trajectory in the batch
    trajectories = range(first, first + len(prompt_ids))
    noise_seeds = [base + 2 * t + 1 for t in trajectories]
    if shared_group_noise:  # DanceGRPO: every member of a group starts from the same noise
        init_seeds = [base + 2 * (t // group_size * group_size) for t in trajectories]
    else:
        init_seeds = [base + 2 * t for t in trajectories]
    return FragmentSpec(step, first_group, prompt_ids, init_seeds, noise_seeds, group_size)


def num_fragments(groups_per_step: int, fragment_groups: int) -> int:
    if fragment_groups < 1 or groups_per_step % fragment_groups:
        raise ValueError(f"--fragment-groups {fragment_groups} must divide the {groups_per_step} groups of a step")
    return groups_per_step // fragment_groups


# --- the fragment queue (claims and announcements in a torch.distributed store) --------------
@dataclasses.dataclass
class Announcement:
    producer: int
    first_group: int
    num_groups: int
    destination: int


class FragmentQueue:
    """Atomic claims of group ranges and ordered completion announcements, per step."""

    def __init__(self, store, groups_per_step: int, poll_s: float = 0.001):
        self.store, self.groups_per_step, self.poll_s = store, groups_per_step, poll_s

    def claim(self, step: int, num_groups: int) -> tuple[int, int] | None:
        """Claim the next `num_groups` unclaimed groups of `step` (fewer at the end): (first, count), or None."""
        end = self.store.add(f"claim/{step}", num_groups)
        first = end - num_groups
        if first >= self.groups_per_step:
            return None
        return first, min(end, self.groups_per_step) - first

    def num_claimed(self, step: int) -> int:
        return min(self.store.add(f"claim/{step}", 0), self.groups_per_step)

    def announce(self, step: int, first_group: int, num_groups: int, producer: int,
                 destination_of: Callable[[int], int] | None = None) -> tuple[int, int]:
        """Publish 'these groups are done by `producer`'; returns (sequence number, destination rank)."""
        seq = self.store.add(f"done/{step}", 1) - 1
        destination = destination_of(seq) if destination_of else -1
        self.store.add(f"done_groups/{step}", num_groups)
        self.store.set(f"done/{step}/{seq}", f"{producer},{first_group},{num_groups},{destination}")
        return seq, destination

    def num_announced(self, step: int) -> int:
        return self.store.add(f"done/{step}", 0)

    def num_announced_groups(self, step: int) -> int:
        return self.store.add(f"done_groups/{step}", 0)

    def poll(self, step: int, seq: int) -> Announcement | None:
        key = f"done/{step}/{seq}"
        if not self.store.check([key]):
            return None
        return Announcement(*(int(x) for x in self.store.get(key).decode().split(",")))

    def wait(self, step: int, seq: int) -> Announcement:
        """Block until announcement `seq` exists: no deadline (a step may take minutes); liveness ends a
        job whose producer died. Polled, so the store connection is never held by a blocking wait."""
        while (found := self.poll(step, seq)) is None:
            time.sleep(self.poll_s)
        return found

    def forget(self, step: int) -> None:
        """Delete step `step`'s keys once every rank is past it: the store must not grow per step."""
        announced = range(self.num_announced(step))
        keys = [f"claim/{step}", f"done/{step}", f"done_groups/{step}"] + [f"done/{step}/{s}" for s in announced]
        for key in keys:
            self.store.delete_key(key)


# --- GAP's two ends ---------------------------------------------------------------------------
def consume(fragments: Iterable[Fragment], train: Callable[[Fragment], None], streaming: bool) -> None:
    """The trainer side of GAP: train each fragment as it arrives, or (the naive barrier) after the batch."""
    if streaming:
        for fragment in fragments:
            train(fragment)
    else:
        for fragment in list(fragments):  # receive everything first
            train(fragment)


def dealt_fragments(queue: FragmentQueue, step: int, fragments_per_step: int, trainer_index: int,
                    num_trainers: int, receive: Callable[[Announcement], Fragment]) -> Iterable[Fragment]:
    """Without TSP: trainer k of K receives announcements k, k + K, ... and trains whole fragments."""
    for seq in range(trainer_index, fragments_per_step, num_trainers):
        yield receive(queue.wait(step, seq))


def claims(queue: FragmentQueue, step: int, fragment_groups: int,
           before_each: Callable[[], object] = lambda: None) -> Iterator[tuple[int, int]]:
    """The rollout side of GAP: claim `fragment_groups` groups of `step` at a time until none are left;
    each claim is generated and streamed before the next one is taken."""
    while True:
        before_each()  # e.g. swap in new weights: only ever between fragments
        claimed = queue.claim(step, fragment_groups)
        if claimed is None:
            return
        yield claimed


# --- point-to-point and broadcast of fragments (data plane: gloo groups, CPU tensors) --------
# Two messages per fragment: a fixed-size int64 header (ints, dtypes, shapes, byte lengths), then ONE
# uint8 buffer holding the names and every tensor's bytes (8-byte aligned). One large message costs
# one latency instead of ~20; this matters on gloo/TCP where each message is a round trip.
ALIGN = 8


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header(fragment: Fragment) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tensors = fragment.tensors()
    names = ",".join(tensors).encode()
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    chunks = [torch.frombuffer(bytearray(names.ljust(_aligned(len(names)), b" ")), dtype=torch.uint8)]
    for i, t in enumerate(tensors.values()):
        row = 9 + i * (2 + MAX_DIMS)
        if t.ndim > MAX_DIMS or row + 2 + MAX_DIMS > HEADER_LEN:
            raise ValueError(f"fragment has {len(tensors)} tensors / {t.ndim} dims: "
                             "over the header's capacity")
        header[row], header[row + 1] = _DTYPES.index(t.dtype), t.ndim
        header[row + 2:row + 2 + t.ndim] = torch.tensor(t.shape)
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        chunks += [raw, torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8)]
    payload_bytes = sum(c.numel() for c in chunks)
    header[:9] = torch.tensor([MAGIC, *fragment._ints(), len(tensors), len(names), payload_bytes])
    return header, chunks


def _unpack(header: torch.Tensor, buffer: torch.Tensor) -> Fragment:
    """Fragment whose tensors are views into `buffer` (the uint8 payload described by `header`)."""
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"fragment header has magic {int(header[0]):#x}, expected {MAGIC:#x}: "
                           "the streams are out of step")
    ints = [int(x) for x in header[1:6]]
    n_tensors, names_len = int(header[6]), int(header[7])
    keys = bytes(buffer[:names_len].tolist()).decode().split(",")
    offset, tensors = _aligned(names_len), {}
    for i, key in enumerate(keys[:n_tensors]):
        row = 9 + i * (2 + MAX_DIMS)
        dtype, ndim = _DTYPES[int(header[row])], int(header[row + 1])
        shape = [int(x) for x in header[row + 2:row + 2 + ndim]]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensors[key] = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
        offset += _aligned(nbytes)
    return _from_tensors(ints, tensors)


def _transmit(fragment: Fragment, move) -> None:
    header, chunks = _header(fragment.to("cpu"))
    move(header)
    move(torch.cat(chunks))  # [payload bytes] uint8


def _receive(move) -> Fragment:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    move(header)
    buffer = torch.empty(int(header[8]), dtype=torch.uint8)
    move(buffer)
    return _unpack(header, buffer)


def send_fragment(fragment: Fragment, dst: int, group=None) -> None:
    _transmit(fragment, lambda t: dist.send(t, dst=dst, group=group))


def recv_fragment(src: int, group=None) -> Fragment:
    return _receive(lambda t: dist.recv(t, src=src, group=group))


def broadcast_fragment(fragment: Fragment | None, src: int, group=None) -> Fragment:
    """Every rank of `group` returns the fragment that global rank `src` holds."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fragment
    move = lambda t: dist.broadcast(t, src=src, group=group)  # noqa: E731
    if dist.get_rank() == src:
        _transmit(fragment, move)
        return fragment
    return _receive(move)
