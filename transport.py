"""Transport: the bytes on the wire of the data plane (fragments, weights, commands), in one place.

    transport.send_fragment(fragment, dst, group)      # GAP: rollout -> trainer, point to point
    transport.recv_fragment(src, group)                # -> fragment.Fragment
    transport.broadcast_fragment(fragment, src, group) # TSP/TAG: the leader's copy to every trainer
    transport.FragmentSender(group, send)              # a background thread, so generation goes on
    transport.publish_weights(tensors, count, version, src, group, dtypes)   # TCSS: the leader
    transport.WeightReceiver(src, group, shapes)       # TCSS: what a rollout rank receives with
    transport.Mailbox(receive)                         # TCSS: its receiving thread; swap_into
    transport.broadcast_command(command, src, group)   # TSP: the leader's (kind, a, b)
    transport.RolloutTimes(store, ranks, fragment_groups)  # TAG: rollout seconds per group, stored
    transport.TrainerLinks(groups, queue, tracer, progress)  # a trainer's receives, shares: named

The mechanism files (gap.py, tsp.py, tag.py, async_policy.py) never touch torch.distributed for
data: main.py hands them these functions. Every call here is data plane (comm.py's rule 1): CPU
tensors on a gloo group. TrainerLinks puts a trainer's receives and broadcasts inside the phase
liveness names when one stalls (infra/progress.py) and the span the trace shows.

A fragment is two messages: a fixed-size int64 header (ints, dtypes, shapes, byte lengths), then ONE
uint8 buffer holding the names and every tensor's bytes (8-byte aligned). One large message costs
one latency instead of ~20; this matters on gloo/TCP where each message is a round trip.
Weights are (version, count), then consecutive tensors packed into flat buckets of at most
PUBLISH_BUCKET_BYTES (one broadcast each: a model of many small tensors costs one round trip, not
one per tensor); a larger tensor goes alone, so the sender never holds more than a bucket plus one
tensor. Publishing 24-41 GB of full weights over gloo takes minutes: the sender reports progress per
tensor (the weights it iterates, trainer.iter_full_weights), the receiver per bucket.
"""
from __future__ import annotations

import contextlib
import queue as queue_lib
import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from async_policy import STOP
from fragment import Fragment

# --- the fragment wire format ---------------------------------------------------------------------
# int64s: [MAGIC, 6 ints (Fragment.ints), n_tensors, names_len, payload_bytes], then one row per
# tensor
HEADER_LEN = 160
MAGIC = 0x6469_6765  # "dige"
MAX_DIMS = 7
INTS = 6  # Fragment.ints(): step, first_group, version, producer, group_size, offset
FIXED = INTS + 4  # the header's fixed fields before the first tensor row
ALIGN = 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.float64]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _row(i: int) -> int:
    """Where tensor i's row (dtype, ndim, shape[MAX_DIMS]) starts in the header."""
    return FIXED + i * (2 + MAX_DIMS)


def pack_fragment(fragment: Fragment) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER_LEN] int64, payload [bytes] uint8) of a CPU fragment."""
    tensors = fragment.tensors()
    names = ",".join(tensors).encode()
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    chunks = [torch.frombuffer(bytearray(names.ljust(_aligned(len(names)), b" ")),
                               dtype=torch.uint8)]
    for i, t in enumerate(tensors.values()):
        row = _row(i)
        if t.ndim > MAX_DIMS or row + 2 + MAX_DIMS > HEADER_LEN:
            raise ValueError(f"fragment has {len(tensors)} tensors / {t.ndim} dims: over the "
                             "header's capacity")
        header[row], header[row + 1] = _DTYPES.index(t.dtype), t.ndim
        header[row + 2:row + 2 + t.ndim] = torch.tensor(t.shape)
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        chunks += [raw, torch.zeros(_aligned(raw.numel()) - raw.numel(), dtype=torch.uint8)]
    payload_bytes = sum(c.numel() for c in chunks)
    header[:FIXED] = torch.tensor([MAGIC, *fragment.ints(), len(tensors), len(names),
                                   payload_bytes])
    return header, torch.cat(chunks)


def unpack_fragment(header: torch.Tensor, buffer: torch.Tensor) -> Fragment:
    """Fragment whose tensors are views into `buffer` (the uint8 payload described by `header`)."""
    if int(header[0]) != MAGIC:
        raise RuntimeError(f"fragment header has magic {int(header[0]):#x}, expected {MAGIC:#x}: "
                           "the streams are out of step")
    ints = [int(x) for x in header[1:1 + INTS]]
    n_tensors, names_len = int(header[1 + INTS]), int(header[2 + INTS])
    keys = bytes(buffer[:names_len].tolist()).decode().split(",")
    offset, tensors = _aligned(names_len), {}
    for i, key in enumerate(keys[:n_tensors]):
        row = _row(i)
        dtype, ndim = _DTYPES[int(header[row])], int(header[row + 1])
        shape = [int(x) for x in header[row + 2:row + 2 + ndim]]
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        tensors[key] = buffer[offset:offset + nbytes].view(dtype).reshape(shape)
        offset += _aligned(nbytes)
    return Fragment.from_parts(ints, tensors)


def _transmit(fragment: Fragment, move: Callable[[torch.Tensor], None]) -> None:
    header, payload = pack_fragment(fragment.to("cpu"))
    move(header)
    move(payload)  # [payload bytes] uint8


def _receive(move: Callable[[torch.Tensor], None]) -> Fragment:
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    move(header)
    buffer = torch.empty(int(header[3 + INTS]), dtype=torch.uint8)
    move(buffer)
    return unpack_fragment(header, buffer)


def send_fragment(fragment: Fragment, dst: int, group=None) -> None:
    def move(t: torch.Tensor) -> None:
        dist.send(t, dst=dst, group=group)
    _transmit(fragment, move)


def recv_fragment(src: int, group=None) -> Fragment:
    def move(t: torch.Tensor) -> None:
        dist.recv(t, src=src, group=group)
    return _receive(move)


def broadcast_fragment(fragment: Fragment | None, src: int, group=None) -> Fragment:
    """Every rank of `group` returns the fragment that global rank `src` holds."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fragment

    def move(t: torch.Tensor) -> None:
        dist.broadcast(t, src=src, group=group)
    if dist.get_rank() == src:
        _transmit(fragment, move)
        return fragment
    return _receive(move)


class FragmentSender:
    """A background thread that sends finished fragments (gloo, CPU tensors, a group no other thread
    uses meanwhile), so generation of the next one starts at once. `send(fragment, dst)` is the
    actual send (main.py wraps send_fragment in a tracing span)."""

    def __init__(self, send: Callable[[Fragment, int], None]):
        self.send, self.items, self.error = send, queue_lib.Queue(), None
        self.thread = threading.Thread(target=self._run, name="fragment-sender", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while (item := self.items.get()) is not None:
                self.send(*item)
        except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
            self.error = exc

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fragment sender failed: {self.error}") from self.error

    def put(self, fragment: Fragment, dst: int) -> None:
        self.raise_if_failed()
        self.items.put((fragment, dst))

    def close(self) -> None:
        """Send what is queued, then stop. No deadline: each send completes when its trainer
        receives it, and a dead trainer ends the job through liveness."""
        self.items.put(None)
        self.thread.join()
        self.raise_if_failed()


# --- bucketed weight publishing -------------------------------------------------------------------
PUBLISH_BUCKET_BYTES = 32 << 20  # both ends cut the stream into the same buckets (fits_bucket)


def fits_bucket(bucket: list[tuple[int, torch.dtype]], nbytes: int, dtype: torch.dtype,
                limit: int) -> bool:
    """Whether a tensor of `nbytes` bytes in `dtype` joins the open bucket (same dtype,
    total <= limit)."""
    return bool(bucket) and bucket[0][1] == dtype and sum(b for b, _ in bucket) + nbytes <= limit


def publish_weights(tensors: Iterable[torch.Tensor], count: int, version: int, src: int, group,
                    dtypes: list[torch.dtype] | None = None,
                    bucket_bytes: int | None = None) -> None:
    """The sender: broadcast (version, count) then the `count` tensors as CPU tensors in `dtypes`
    (the receivers' parameter dtypes), packed into buckets (of PUBLISH_BUCKET_BYTES unless given).
    `tensors` may gather each one just in time (FSDP), so at most one bucket, its flat copy and one
    whole tensor are held here at once. count 0: the header only."""
    bucket_bytes = bucket_bytes or PUBLISH_BUCKET_BYTES
    dist.broadcast(torch.tensor([version, count], dtype=torch.int64), src=src, group=group)
    bucket: list[torch.Tensor] = []
    # (bytes, dtype) of the bucket's tensors: what fits_bucket reads
    plan: list[tuple[int, torch.dtype]] = []

    def flush() -> None:
        flat = (bucket[0].reshape(-1) if len(bucket) == 1
                else torch.cat([b.reshape(-1) for b in bucket]))
        bucket.clear()
        plan.clear()
        dist.broadcast(flat, src=src, group=group)  # [bucket numel] in the bucket's dtype

    sent = 0
    for t in tensors:  # (not enumerate: its reused result tuple would keep the last tensor alive)
        wire = t.detach().to("cpu", dtypes[sent] if dtypes is not None else t.dtype).contiguous()
        del t  # let a just-in-time gathered tensor go before the next one is gathered
        nbytes = wire.numel() * wire.element_size()
        if bucket and not fits_bucket(plan, nbytes, wire.dtype, bucket_bytes):
            flush()
        bucket.append(wire)
        plan.append((nbytes, wire.dtype))
        del wire
        sent += 1
    if bucket:
        flush()
    if sent != count:
        raise RuntimeError(f"published {sent} tensors, announced {count}")


def bucket_plan(shapes: list[tuple[torch.Size, torch.dtype]],
                bucket_bytes: int | None = None
                ) -> list[tuple[torch.dtype, list[torch.Size]]]:
    """The buckets a publish of weights of these (shape, dtype)s is cut into (fits_bucket, as the
    publisher cuts them, PUBLISH_BUCKET_BYTES unless given): (dtype, the shapes of its weights) per
    bucket, in order."""
    bucket_bytes = bucket_bytes or PUBLISH_BUCKET_BYTES
    plan: list[tuple[torch.dtype, list[torch.Size]]] = []
    bucket: list[tuple[int, torch.dtype]] = []
    for shape, dtype in shapes:
        nbytes = shape.numel() * dtype.itemsize
        if not (bucket and fits_bucket(bucket, nbytes, dtype, bucket_bytes)):
            bucket = []
            plan.append((dtype, []))
        bucket.append((nbytes, dtype))
        plan[-1][1].append(torch.Size(shape))
    return plan


def receive_buckets(src: int, group, shapes: list[tuple[torch.Size, torch.dtype]],
                    bucket_bytes: int | None = None,
                    flats: list[torch.Tensor] | None = None,
                    on_bucket: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    """The publisher's buckets, cut the same way (bucket_plan), each received into flats[i] (a
    flat tensor per bucket, reused: WeightReceiver) or a new one; returns one view per weight.
    `on_bucket()` after each bucket arrived."""
    buffers: list[torch.Tensor] = []
    for i, (dtype, bucket) in enumerate(bucket_plan(shapes, bucket_bytes)):
        numel = sum(s.numel() for s in bucket)
        flat = flats[i] if flats is not None else torch.empty(numel, dtype=dtype)
        dist.broadcast(flat, src=src, group=group)  # [bucket numel] in the bucket's dtype
        on_bucket()
        offset = 0
        for shape in bucket:
            buffers.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
    return buffers


def _receive_header(src: int, group, expected: int, progress=None) -> tuple[int, int]:
    header = torch.empty(2, dtype=torch.int64)
    with _inside(progress, "next publish", idle=True):  # waiting for work, not doing it
        dist.broadcast(header, src=src, group=group)
    version, count = int(header[0]), int(header[1])
    if count not in (0, expected):
        raise RuntimeError(f"published weights have {count} tensors, this model has {expected}")
    return version, count


def _inside(progress, name: str, idle: bool = False):
    return progress.inside(name, idle=idle) if progress is not None else contextlib.nullcontext()


def _bump_of(progress) -> Callable[[], None]:
    return progress.bump if progress is not None else (lambda: None)


def receive_weights(src: int, group, shapes: list[tuple[torch.Size, torch.dtype]],
                    bucket_bytes: int | None = None,
                    begin: Callable[[int], None] | None = None,
                    progress=None) -> tuple[int, list[torch.Tensor]]:
    """The receiver (blocks until the next publish), into new buffers every time: (version, one
    tensor per weight); (version, []) for a header-only message (async_policy.STOP).
    begin(version) is called between the header and the weights. The reference for WeightReceiver,
    which reuses its buffers (tests/test_host_memory.py). `progress` (infra.progress.Progress):
    the wait for the next publish is idle, receiving one is a named phase with a unit of progress
    per bucket."""
    version, count = _receive_header(src, group, len(shapes), progress)
    if count == 0:
        return version, []
    if begin is not None:
        begin(version)
    with _inside(progress, "receive weights"):
        return version, receive_buckets(src, group, shapes, bucket_bytes,
                                        on_bucket=_bump_of(progress))


class WeightReceiver:
    """A rollout rank's receiving end of weight publishing, into buffers allocated at the first
    publish and reused by every later one: one copy of the published weights on the host for the
    whole run (24 GB for FLUX.1-dev's full weights in bf16), where new buffers per publish cost a
    fresh 24 GB allocation (and page faults) per step and two copies at once whenever a publish
    arrived before the last one was swapped in. The caller (Mailbox, below) must not read the
    buffers from begin(version) until the call returns: they are being overwritten. `progress`
    as for receive_weights."""

    def __init__(self, src: int, group, shapes: list[tuple[torch.Size, torch.dtype]],
                 bucket_bytes: int | None = None, progress=None):
        self.src, self.group, self.shapes, self.bucket_bytes = src, group, shapes, bucket_bytes
        self.progress = progress
        self.flats: list[torch.Tensor] | None = None  # one flat tensor per bucket

    def __call__(self, begin: Callable[[int], None] | None = None
                 ) -> tuple[int, list[torch.Tensor]]:
        """(version, one view per weight into the reused buffers); (version, []) for
        async_policy.STOP."""
        version, count = _receive_header(self.src, self.group, len(self.shapes), self.progress)
        if count == 0:
            return version, []
        if begin is not None:
            begin(version)
        if self.flats is None:
            self.flats = [torch.empty(sum(s.numel() for s in bucket), dtype=dtype)
                          for dtype, bucket in bucket_plan(self.shapes, self.bucket_bytes)]
        with _inside(self.progress, "receive weights"):
            return version, receive_buckets(self.src, self.group, self.shapes, self.bucket_bytes,
                                            self.flats, _bump_of(self.progress))


# --- TCSS: a rollout rank's weights mailbox (a receiving thread; swaps between fragments) ---------
class Mailbox:
    """Rollout rank: a background thread receives published weights into CPU buffers; the main
    thread swaps them into the model between fragments. Waits have no deadline: liveness ends a dead
    job.

    The buffers may be the same for every publish (WeightReceiver: one copy of the weights on the
    host for the whole run), so a publish that arrives overwrites the last one's buffers: the
    receive calls begin(version) before it writes them, which waits for a swap in progress to finish
    and marks them unreadable until the publish is complete. A version the model never took is then
    gone, which is safe: the next publish can only start once its step is trained, so this rank
    needs the newer version next. A swap that finds a completed version it has not taken being
    overwritten waits for the newer one (it must not generate with weights two versions old); with
    nothing newer than what it holds it returns at once (generating ahead while a publish arrives is
    TCSS's point)."""

    def __init__(self, receive: Callable[..., tuple[int, list[torch.Tensor]]]):
        """`receive(begin=...)` blocks until the next publish and returns (version, one tensor per
        weight), calling begin(version) before it writes into buffers it reuses: WeightReceiver
        on a gloo group of its own, or a test's stand-in."""
        self.receive = receive
        self._cond = threading.Condition()
        self._ready: tuple[int, list[torch.Tensor]] | None = None  # complete, not yet swapped in
        self._filling = False  # a publish is being written into the buffers
        self._swapping = False  # the main thread is copying the buffers into the model
        self._arrived = -1  # the latest version received completely
        self._held_version = -1  # version of the weights currently in the model
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-mailbox", daemon=True)
        self._thread.start()

    def _begin(self, version: int) -> None:
        with self._cond:
            while self._swapping:
                self._cond.wait()
            self._filling, self._ready = True, None  # what the buffers held is being overwritten
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            while True:
                version, buffers = self.receive(begin=self._begin)  # blocks until the next publish
                if version == STOP:
                    break
                with self._cond:
                    self._ready, self._filling = (version, buffers), False
                    self._arrived = version
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  (surfaced to the main thread, which raises it)
            self.error = exc
        with self._cond:
            self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight mailbox failed: {self.error}") from self.error

    def _wait(self, what: str) -> None:
        """One wait on the condition (held): at most a second; the thread's failure is raised."""
        self._raise_if_failed()
        if not self._thread.is_alive():
            raise RuntimeError(f"weight mailbox stopped before {what}")
        self._cond.wait(1.0)

    def latest_version(self) -> int:
        with self._cond:
            return self._arrived

    @property
    def held_version(self) -> int:
        return self._held_version

    def wait_for(self, version: int, also_check: Callable[[], None] = lambda: None) -> None:
        """Block until weights of at least `version` have arrived. `also_check` runs at least once a
        second while waiting and may raise: the rollout's fragment sender, whose failure means they
        never will."""
        with self._cond:
            while self._arrived < version:
                also_check()
                self._wait(f"version {version} arrived")

    def swap_into(self, params: list[torch.Tensor]) -> int:
        """Copy the latest weights into the model (call only between fragments); returns the held
        version."""
        self._raise_if_failed()
        with self._cond:
            while self._filling and self._arrived > self._held_version:  # the newest one is being
                self._wait("a publish being received completed")  # overwritten: take the next
            latest = self._ready
            if latest is None or latest[0] <= self._held_version:
                return self._held_version
            self._swapping = True  # the receive waits before overwriting the buffers
        try:
            with torch.no_grad():
                for p, t in zip(params, latest[1]):
                    p.copy_(t)
        finally:
            with self._cond:
                self._swapping = False
                self._ready = None  # taken
                self._held_version = latest[0]
                self._cond.notify_all()
        return self._held_version

    def join(self) -> None:
        """Wait for the thread to finish (after the leader's STOP); a failure is raised here."""
        self._thread.join()
        self._raise_if_failed()


# --- TSP's commands -------------------------------------------------------------------------------
def broadcast_command(command: tuple[int, int, int] | None, src: int,
                      group) -> tuple[int, int, int]:
    """The leader's (kind, a, b) to every trainer (data plane: a CPU tensor on a gloo group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return command
    message = torch.tensor(command if command is not None else (0, 0, 0), dtype=torch.int64)
    dist.broadcast(message, src=src, group=group)
    return tuple(int(x) for x in message)


# --- TAG's input: the rollout ranks' generation times, through the job's store ------------------
class RolloutTimes:
    """Rollout ranks report how long a group took (a store key per rank); the leader reads the mean,
    in seconds per fragment of `fragment_groups` groups: tag.Assistant's rollout_gen_s."""

    def __init__(self, store, ranks: list[int], fragment_groups: int):
        self.store, self.ranks, self.fragment_groups = store, ranks, fragment_groups

    def report(self, rank: int, seconds: float, groups: int) -> None:
        self.store.set(f"gen/{rank}", f"{seconds / groups}")

    def per_fragment_s(self) -> float | None:
        reported = [f"gen/{r}" for r in self.ranks if self.store.check([f"gen/{r}"])]
        per_group = [float(self.store.get(key)) for key in reported]
        return sum(per_group) / len(per_group) * self.fragment_groups if per_group else None


# --- a trainer's receives and broadcasts, each inside its named phase -----------------------------
class TrainerLinks:
    """How a trainer takes fragments in (main.TrainerRank.fragments): waits and receives in tracing
    spans ("wait", "recv": liveness names them too), TSP's and TAG's broadcasts in named phases.
    `groups` is comm.Groups, `queue` gap.FragmentQueue."""

    def __init__(self, groups, queue, tracer, progress):
        self.groups, self.queue, self.tracer, self.progress = groups, queue, tracer, progress

    def announced(self, step: int, seq: int):
        with self.tracer.span("wait", step=step, what="fragment"):
            return self.queue.wait(step, seq)

    def decide(self, step: int, decide: Callable[[int, int], tuple[int, int, int]], next_seq: int,
               done: int) -> tuple[int, int, int]:
        """The leader's TSP decision, which may wait for an arrival."""
        with self.tracer.span("wait", step=step, what="fragment"):
            return decide(next_seq, done)

    def receive(self, step: int, announcement) -> Fragment:
        with self.tracer.span("recv", step=step, first_group=announcement.first_group):
            return recv_fragment(announcement.producer, group=self.groups.world_data)

    def receive_seq(self, step: int, seq: int) -> Fragment:
        return self.receive(step, self.queue.wait(step, seq))

    def share_command(self, command: tuple[int, int, int] | None) -> tuple[int, int, int]:
        with _inside(self.progress, "command broadcast"):
            return broadcast_command(command, self.groups.leader, self.groups.trainer_data)

    def share_fragment(self, fragment: Fragment | None) -> Fragment:
        with _inside(self.progress, "fragment broadcast"):
            return broadcast_fragment(fragment, self.groups.leader, self.groups.trainer_data)

    def share_part(self, part: Fragment | None, owner: int) -> Fragment:
        """TAG: trainer `owner`'s share of a claim, on every trainer."""
        with _inside(self.progress, "tag share"):
            return broadcast_fragment(part, self.groups.trainer_ranks[owner],
                                      self.groups.trainer_data)
