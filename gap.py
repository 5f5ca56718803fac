"""GAP, the generation-axis pipeline: fragments of whole GRPO groups streamed from rollout to trainer.

Paper: DigenRL, "generation-axis pipeline" (DESIGN.md sections 4-5). A batch of B prompts x G
samples is cut into M fragments of `fragment_groups` whole groups. Each fragment has prompt ids and
noise seeds derived only from (seed, step, index), so it yields the same trajectories whichever rank
generates it. Ranks claim fragment indices from an atomic counter in a torch.distributed store
(`store.add`), so fast ranks take more and an idle trainer can take some (TAG). A finished fragment
is announced in the store (sequence number -> producer rank, fragment index), so the trainer knows
whom to receive from without any-source receives (NCCL has none), then sent point to point:
a fixed-size int64 header first, then one uint8 buffer with the names and every tensor's bytes.

Invariant: the trainer's update from fragments consumed as they arrive equals the full-batch update
(allclose in float32): every (sample, timestep) pair carries weight 1/(N T_train) and gradients add.

Departures from the paper: claiming is pull-based through the store (the paper schedules centrally);
advantages are normalised per group so a fragment is self-contained.

Try it: `python main.py --placement disaggregated --gap` (or `--mode digenrl`); without `--gap`
the trainer receives the whole batch before training (the naive barrier).
Only torch is imported: this file can be copied into another codebase as it is.
"""
from __future__ import annotations

import dataclasses
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER_LEN = 160
MAGIC = 0x6469_6765  # "dige"
MAX_DIMS = 7
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.float64]


@dataclasses.dataclass
class FragmentSpec:
    """What to generate: the deterministic identity of fragment `index` of RL step `step`."""

    step: int
    index: int
    prompt_ids: list[int]  # one per trajectory (members of a group are contiguous)
    init_seeds: list[int]  # initial-noise seed per trajectory (shared within a group for DanceGRPO)
    noise_seeds: list[int]  # per-step noise seed per trajectory
    group_size: int


@dataclasses.dataclass
class Fragment:
    """The wire format: everything the trainer needs to train m trajectories (whole groups)."""

    step: int
    index: int
    policy_version: int  # the weights version that generated every trajectory of this fragment
    producer: int  # rank that generated it
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

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        out.update({f"cond.{k}": v for k, v in sorted(self.cond.items())})
        return out

    def to(self, device) -> "Fragment":
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return _from_tensors(self._ints(), moved)

    def _ints(self) -> list[int]:
        return [self.step, self.index, self.policy_version, self.producer, self.group_size]

    def select(self, samples: slice) -> "Fragment":
        """The sub-fragment of samples `samples` (whole groups)."""
        parts = {k: v[samples] for k, v in self.tensors().items()}
        return _from_tensors(self._ints(), parts)


def _from_tensors(ints: list[int], tensors: dict[str, torch.Tensor]) -> Fragment:
    cond = {k[len("cond."):]: v for k, v in tensors.items() if k.startswith("cond.")}
    plain = {k: v for k, v in tensors.items() if not k.startswith("cond.")}
    step, index, version, producer, group_size = ints
    return Fragment(step=step, index=index, policy_version=version, producer=producer, group_size=group_size,
                    cond=cond, **plain)


def concat_fragments(parts: list[Fragment]) -> Fragment:
    """Join sub-fragments (in group order) back into one fragment."""
    tensors = [p.tensors() for p in parts]
    joined = {k: torch.cat([t[k] for t in tensors]) for k in tensors[0]}
    return _from_tensors(parts[0]._ints(), joined)


# --- batch -> fragments ----------------------------------------------------------------------
def fragment_spec(seed: int, step: int, index: int, num_prompts_total: int, prompts_per_step: int,
                  group_size: int, fragment_groups: int, shared_group_noise: bool = False) -> FragmentSpec:
    """Fragment `index` of step `step`: prompt ids and seeds depend only on (seed, step, index)."""
    # The step's prompt ids: a seeded permutation, so every rank agrees without communication.
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    order = torch.randperm(max(num_prompts_total, prompts_per_step), generator=gen) % num_prompts_total
    groups = order[:prompts_per_step][index * fragment_groups:(index + 1) * fragment_groups].tolist()
    prompt_ids = [p for p in groups for _ in range(group_size)]
    base = (seed * 1_000_003 + step) * 1_000_033 + index * 10_007
    noise_seeds = [base + 2 * i + 1 for i in range(len(prompt_ids))]
    if shared_group_noise:  # DanceGRPO: every member of a group starts from the same noise
        init_seeds = [base + 2 * (i // group_size * group_size) for i in range(len(prompt_ids))]
    else:
        init_seeds = [base + 2 * i for i in range(len(prompt_ids))]
    return FragmentSpec(step, index, prompt_ids, init_seeds, noise_seeds, group_size)


def num_fragments(prompts_per_step: int, fragment_groups: int) -> int:
    if fragment_groups < 1 or prompts_per_step % fragment_groups:
        raise ValueError(f"--fragment-groups {fragment_groups} must divide the {prompts_per_step} groups of a step")
    return prompts_per_step // fragment_groups


# --- the fragment queue (claims and announcements in a torch.distributed store) --------------
class FragmentQueue:
    """Atomic claims of fragment indices and ordered completion announcements, per step."""

    def __init__(self, store, fragments_per_step: int, timeout_s: float = 300.0):
        self.store, self.m, self.timeout_s = store, fragments_per_step, timeout_s

    def claim(self, step: int) -> int | None:
        """Claim the next unclaimed fragment of `step`; None when all are taken."""
        index = self.store.add(f"claim/{step}", 1) - 1
        return index if index < self.m else None

    def num_claimed(self, step: int) -> int:
        return min(self.store.add(f"claim/{step}", 0), self.m)

    def announce(self, step: int, index: int, producer: int, destination_of=None) -> tuple[int, int]:
        """Publish 'fragment `index` done by `producer`'; returns (sequence number, destination rank)."""
        seq = self.store.add(f"done/{step}", 1) - 1
        destination = destination_of(seq) if destination_of else -1
        self.store.set(f"done/{step}/{seq}", f"{producer},{index},{destination}")
        return seq, destination

    def num_announced(self, step: int) -> int:
        return self.store.add(f"done/{step}", 0)

    def poll(self, step: int, seq: int) -> tuple[int, int, int] | None:
        """(producer, index, destination) of announcement `seq` if it exists yet, else None."""
        key = f"done/{step}/{seq}"
        if not self.store.check([key]):
            return None
        producer, index, destination = (int(x) for x in self.store.get(key).decode().split(","))
        return producer, index, destination

    def wait(self, step: int, seq: int) -> tuple[int, int, int]:
        """Block (bounded by the queue timeout) until announcement `seq` exists."""
        self.store.wait([f"done/{step}/{seq}"], timedelta(seconds=self.timeout_s))
        return self.poll(step, seq)

    def forget(self, step: int) -> None:
        """Delete step `step`'s keys (call it once every rank is past that step): the store must not grow per step."""
        keys = [f"claim/{step}", f"stale/{step}", f"done/{step}"]
        keys += [f"done/{step}/{seq}" for seq in range(self.num_announced(step))]
        for key in keys:
            self.store.delete_key(key)

    def counter(self, name: str, step: int, amount: int = 1) -> int:
        """A generic atomic per-step counter (used for the stale-fragment budget of TCSS)."""
        return self.store.add(f"{name}/{step}", amount)


# --- point-to-point and broadcast of fragments ------------------------------------------------
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
            raise ValueError(f"fragment has {len(tensors)} tensors / {t.ndim} dims: over the header's capacity")
        header[row], header[row + 1] = _DTYPES.index(t.dtype), t.ndim
        header[row + 2:row + 2 + t.ndim] = torch.tensor(t.shape)
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        chunks += [raw, torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8, device=raw.device)]
    payload_bytes = sum(c.numel() for c in chunks)
    header[:9] = torch.tensor([MAGIC, *fragment._ints(), len(tensors), len(names), payload_bytes])
    return header, chunks


def _pack(chunks: list[torch.Tensor], device) -> torch.Tensor:
    return torch.cat([c.to(device) for c in chunks])  # [payload bytes] uint8


def _unpack(header: torch.Tensor, buffer: torch.Tensor) -> Fragment:
    """Fragment whose tensors are views into `buffer` (the uint8 payload described by `header`)."""
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"fragment header has magic {int(header[0]):#x}, expected {MAGIC:#x}: the streams are out of step")
    ints = [int(x) for x in header[1:6]]
    n_tensors, names_len = int(header[6]), int(header[7])
    keys = bytes(buffer[:names_len].cpu().tolist()).decode().split(",")
    offset, tensors = _aligned(names_len), {}
    for i, key in enumerate(keys[:n_tensors]):
        row = 9 + i * (2 + MAX_DIMS)
        dtype, ndim = _DTYPES[int(header[row])], int(header[row + 1])
        shape = [int(x) for x in header[row + 2:row + 2 + ndim]]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensors[key] = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
        offset += _aligned(nbytes)
    return _from_tensors(ints, tensors)


def _transmit(fragment: Fragment, device, move) -> None:
    header, chunks = _header(fragment)
    move(header.to(device))
    move(_pack(chunks, device))


def _receive(device, move) -> Fragment:
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    move(header)
    header = header.cpu()
    buffer = torch.empty(int(header[8]), dtype=torch.uint8, device=device)
    move(buffer)
    return _unpack(header, buffer)


def send_fragment(fragment: Fragment, dst: int, group=None, device="cpu") -> None:
    _transmit(fragment, device, lambda t: dist.send(t, dst=dst, group=group))


def recv_fragment(src: int, group=None, device="cpu") -> Fragment:
    return _receive(device, lambda t: dist.recv(t, src=src, group=group))


def broadcast_fragment(fragment: Fragment | None, src: int, group=None, device="cpu") -> Fragment:
    """Every rank of `group` returns the fragment that global rank `src` holds."""
    if dist.get_world_size(group) == 1:
        return fragment
    move = lambda t: dist.broadcast(t, src=src, group=group)  # noqa: E731
    if dist.get_rank() == src:
        _transmit(fragment, device, move)
        return fragment
    return _receive(device, move)


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.002):
    """Poll `predicate` until it returns a non-None value; raise TimeoutError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
