"""The process groups of a rehearsal: every rehearsed rank is a thread of one process with a
torch.distributed world of its own (torch's threaded-world registry), and comm.build_groups' groups
are replaced by three kinds:

- data plane (what comm.py creates with backend "gloo"): `DataGroup`, a real exchange between the
  rehearsed ranks. A message goes from the sender's thread to the receiver's (the trainer receives
  exactly the fragment the rollout rank produced; the header and control values are real) and its
  bytes are counted per rank. Ranks that are not rehearsed ("stand-ins") are symmetric to a
  rehearsed rank of the same role, their "representative": in a collective a stand-in contributes
  what its representative contributed (a metric sum over K trainers is the leader's value plus K - 1
  times a non-leader's); a message to a stand-in is counted and dropped. Data from a stand-in that
  no rehearsed rank could stand for (a broadcast a stand-in starts, a receive from one) is an error
  that names it. comm.py's rules are checked on every call: CPU tensors only (rule 1), never a
  collective on the world group (rule 4).
- compute plane (comm.py's default backend: NCCL on GPUs): torch's FakeProcessGroup, which moves
  nothing (its tensors are fake); every call is recorded with its thread and its tensors' devices:
  a compute collective from a background thread or on CPU tensors is refused (rule 2), and the
  trainers' sequences of collectives must be the same (a mismatch hangs NCCL: `check_lockstep`).
- the world group itself: `WorldGroup`, which refuses every collective.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from tools.rehearsal import fake_gpu

DATA, COMPUTE, WORLD = "rehearsal_data", "rehearsal_compute", "rehearsal_world"
STALL_S = 600.0  # no rehearsed rank moved for this long while all wait on each other: a deadlock


class RehearsalError(RuntimeError):
    """A rule of the real program broken in the rehearsal (a bug a GPU run would hit)."""


@dataclasses.dataclass
class Position:
    """A rehearsed rank: its global rank, role, and the ranks of its role it stands for."""

    rank: int
    role: str  # "rollout", "leader", "trainer" (a non-leader trainer), "colocated"
    represents: list[int]


class Exchange:
    """What the rehearsed ranks share: the pending collectives and messages, the bytes moved."""

    def __init__(self, positions: list[Position], world: int):
        self.positions, self.world = {p.rank: p for p in positions}, world
        self.representative = {r: p.rank for p in positions for r in p.represents}
        self.cond = threading.Condition()
        # (group, seq) -> ({rank: contribution}, ranks that read them)
        self.slots: dict[tuple, tuple[dict, set]] = {}
        self.counts: collections.Counter = collections.Counter()  # (group, rank) -> calls so far
        self.messages: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
        # rank -> (phase, plane, what) -> bytes
        self.traffic: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self.phase_of = lambda: "outside"  # the calling thread's innermost phase (ranks.py sets it)
        self.compute_log: dict[int, list[tuple]] = collections.defaultdict(list)
        self.waiting: dict[int, str] = {}  # thread id -> what it waits for
        self.failed: BaseException | None = None
        self.last_move = time.monotonic()

    # --- bookkeeping ---------------------------------------------------------------------------
    def count(self, rank: int, plane: str, what: str, nbytes: int) -> None:
        phase = self.phase_of()
        with self.cond:
            self.traffic[rank][(phase, plane, what)] += nbytes

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = error
            self.cond.notify_all()

    def moved(self) -> None:
        self.last_move = time.monotonic()

    def _wait(self, ready, what: str):
        """Wait (cond held) until ready(): no deadline while anyone moves; raise on failure."""
        me = threading.get_ident()
        self.waiting[me] = what
        try:
            while not ready():
                if self.failed is not None:
                    raise RehearsalError(f"another rehearsed rank failed while this one waited for "
                                         f"{what}") from self.failed
                self.cond.wait(1.0)
        finally:
            self.waiting.pop(me, None)

    # --- collectives among the rehearsed members of a group ------------------------------------
    def meet(self, group: "DataGroup", contribution) -> dict[int, object]:
        """Every rehearsed member's contribution to this call (each one's n-th on the group)."""
        key = (group.key, group.global_rank)
        live = group.live_members
        with self.cond:
            seq = self.counts[key]
            self.counts[key] += 1
            got, read = self.slots.setdefault((group.key, seq), ({}, set()))
            got[group.global_rank] = contribution
            self.cond.notify_all()
            self._wait(lambda: len(got) == len(live), f"{group.name} collective #{seq}")
            read.add(group.global_rank)
            if len(read) == len(live):
                del self.slots[(group.key, seq)]
            got = dict(got)
        self.moved()
        return got

    def post(self, group: "DataGroup", dst: int, tensor: torch.Tensor) -> None:
        with self.cond:
            self.messages[(group.key, group.global_rank, dst)].append(tensor)
            self.cond.notify_all()
        self.moved()

    def take(self, group: "DataGroup", src: int) -> torch.Tensor:
        box = self.messages[(group.key, src, group.global_rank)]
        with self.cond:
            self._wait(lambda: bool(box), f"{group.name} recv from rank {src}")
            message = box.popleft()
        self.moved()
        return message


def _work(result=None):
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def holdings_of():
    """The calling rank's tensors.Holdings, or None (ranks.install sets it: a rank's context)."""
    return None


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src across threads. A real destination cannot hold a fake value: it takes what is
    known of the source (tools/rehearsal/tensors.py: its shadow, or the real pieces of a buffer)
    and keeps what it had elsewhere."""
    holdings = holdings_of()
    with torch.no_grad():
        if isinstance(dst, FakeTensor) or not isinstance(src, FakeTensor):
            # the source, a fake tensor of the sender's mode, is re-made in this rank's: a copy no
            # transport makes (gloo writes into dst), so not this rank's memory
            # (dst was counted when it was made; copy_ makes nothing else the rank keeps)
            with holdings.apart() if holdings is not None else contextlib.nullcontext():
                dst.copy_(src)
        elif getattr(src, "_rehearsal_shadow", None) is not None:
            dst.copy_(src._rehearsal_shadow)
        else:
            flat = dst.view(-1)
            for a, b, real in getattr(src, "_rehearsal_segments", None) or []:
                flat[a:b].copy_(real)


class DataGroup(dist.ProcessGroup):
    """A data-plane group (comm.py's gloo groups) between rehearsed ranks; see the module."""

    def __init__(self, exchange: Exchange, ranks: list[int], group_rank: int, name: str):
        super().__init__(group_rank, len(ranks))
        self.exchange, self.ranks, self.name = exchange, list(ranks), name
        self.global_rank = self.ranks[group_rank]
        self.key = tuple(self.ranks)
        self.live_members = [r for r in self.ranks if r in exchange.positions]

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return DATA

    def _check(self, tensors, what: str) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise RehearsalError(
                    f"comm.py rule 1 broken: a {t.device.type} tensor {tuple(t.shape)} in {what} "
                    f"on the data-plane group {self.name} (gloo, CPU tensors only)")

    def _stands_for(self, rank: int) -> int:
        """The rehearsed rank whose contribution rank `rank` makes (itself if rehearsed)."""
        return rank if rank in self.exchange.positions else self.exchange.representative[rank]

    def _per_rank(self, got: dict[int, object]) -> list:
        return [got[self._stands_for(r)] for r in self.ranks]

    # --- point to point ------------------------------------------------------------------------
    def send(self, tensors, dst_rank, tag=0):
        self._check(tensors, "send")
        dst = self.ranks[dst_rank]
        self.exchange.count(self.global_rank, "data", "sent", _nbytes(tensors))
        if dst in self.exchange.positions:
            self.exchange.post(self, dst, tensors[0])
        return _work()

    def recv(self, tensors, src_rank, tag=0):
        self._check(tensors, "recv")
        src = self.ranks[src_rank]
        if src not in self.exchange.positions:
            raise RehearsalError(f"a receive from rank {src} on {self.name}: it is not rehearsed "
                                 "and no rehearsed rank sends for it")
        _fill(tensors[0], self.exchange.take(self, src))
        self.exchange.count(self.global_rank, "data", "received", _nbytes(tensors))
        return _work(tensors)

    # --- collectives ----------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        self._check(tensors, "broadcast")
        root = self.ranks[opts.rootRank]
        if root not in self.exchange.positions:
            raise RehearsalError(f"a broadcast from rank {root} on {self.name}: it is not "
                                 "rehearsed, and its data is its own (no rehearsed rank has it)")
        got = self.exchange.meet(self, tensors[0] if root == self.global_rank else None)
        direction = "sent" if root == self.global_rank else "received"
        if root != self.global_rank:
            _fill(tensors[0], got[root])
        self.exchange.count(self.global_rank, "data", direction, _nbytes(tensors))
        return _work(tensors)

    def allreduce(self, tensors, opts=None):
        self._check(tensors, "all_reduce")
        op = opts.reduceOp.op if opts is not None else dist.ReduceOp.SUM
        got = self.exchange.meet(self, tensors[0].detach().clone())
        values = [v for v in self._per_rank(got)]
        if not any(isinstance(v, FakeTensor) for v in values) and not isinstance(tensors[0],
                                                                                  FakeTensor):
            stacked = torch.stack(values)
            reduce = {dist.ReduceOp.SUM: stacked.sum, dist.ReduceOp.MIN: lambda dim: stacked.min(
                dim).values, dist.ReduceOp.MAX: lambda dim: stacked.max(dim).values}[op]
            tensors[0].copy_(reduce(0))
        self.exchange.count(self.global_rank, "data", "all_reduce", _nbytes(tensors))
        return _work(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check(input_tensors, "all_gather")
        got = self.exchange.meet(self, input_tensors[0].detach().clone())
        for out, value in zip(output_tensors[0], self._per_rank(got)):
            _fill(out, value)
        self.exchange.count(self.global_rank, "data", "all_gather", _nbytes(input_tensors))
        return _work(output_tensors)

    def gather(self, output_tensors, input_tensors, opts):
        self._check(input_tensors, "gather")
        got = self.exchange.meet(self, input_tensors[0].detach().clone())
        if self.ranks[opts.rootRank] == self.global_rank:
            for out, value in zip(output_tensors[0], self._per_rank(got)):
                _fill(out, value)
        self.exchange.count(self.global_rank, "data", "gather", _nbytes(input_tensors))
        return _work(output_tensors)

    def barrier(self, opts=None):
        self.exchange.meet(self, None)
        return _work()


class WorldGroup(dist.ProcessGroup):
    """The default (world) group: comm.py's rule 4, nothing runs on it."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802
        return WORLD

    def _refuse(self, *args, **kwargs):
        raise RehearsalError("comm.py rule 4 broken: a collective on the default (world) group")

    send = recv = broadcast = allreduce = allgather = gather = barrier = _refuse


# --- the threaded worlds and the backends ---------------------------------------------------------
_EXCHANGE: list[Exchange] = []
_installed = threading.Lock()
_done: list = []


def _data_group(opts, _backend_opts=None):
    ranks = list(opts.global_ranks_in_group)
    return DataGroup(_EXCHANGE[0], ranks, opts.group_rank, f"data:{len(ranks)}")


def _world_group(opts, _backend_opts=None):
    return WorldGroup(opts.group_rank, opts.group_size)


def _compute_group(opts, backend_opts):
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg
    return _create_fake_pg(opts, backend_opts)


def install(exchange: Exchange) -> None:
    """Per-thread torch.distributed worlds, the three backends, and comm.py's groups mapped onto
    them (data: "gloo", compute: the default backend). Once per process; `exchange` is this
    rehearsal's."""
    _EXCHANGE[:] = [exchange]
    with _installed:
        if _done:
            return
        from torch.testing._internal.distributed import multi_threaded_pg

        devices = ["cpu", fake_gpu.NAME]
        dist.Backend.register_backend(DATA, _data_group, extended_api=True, devices=devices)
        dist.Backend.register_backend(WORLD, _world_group, extended_api=True, devices=devices)
        dist.Backend.register_backend(COMPUTE, _compute_group, extended_api=True, devices=devices)
        multi_threaded_pg._install_threaded_pg()  # each thread its own _world
        torch._C._distributed_c10d._set_thread_isolation_mode(True)  # ... and its group names
        original = dist.new_group

        def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
            backend = DATA if backend == "gloo" else COMPUTE if backend is None else backend
            return original(ranks, timeout, backend, *args, **kwargs)

        dist.new_group = new_group
        _done.append(original)


def thread_world():
    """This thread's torch.distributed world (what a thread it starts must share)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
    return ThreadLocalWorld._world.world if hasattr(ThreadLocalWorld._world, "world") else None


def set_thread_world(world) -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld
    if world is not None:
        ThreadLocalWorld._world.world = world


def record_compute(exchange: Exchange, rank: int, main_thread: int, what: str, tensors) -> None:
    """A compute-plane collective: comm.py's rule 2 (device tensors, main thread) and the log the
    trainers' sequences are compared on."""
    if threading.get_ident() != main_thread:
        raise RehearsalError(f"comm.py rule 2 broken: {what} on the compute plane from the thread "
                             f"{threading.current_thread().name!r} (main thread only under NCCL)")
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            raise RehearsalError(f"comm.py rule 2 broken: a CPU tensor {tuple(t.shape)} in {what} "
                                 "on the compute plane (NCCL: 'No backend type associated with "
                                 "device type cpu')")
    shapes = tuple(tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor))
    exchange.compute_log[rank].append((what, shapes))
    exchange.count(rank, "compute", what, _nbytes([t for t in tensors
                                                    if isinstance(t, torch.Tensor)]))


def check_lockstep(exchange: Exchange, trainers: list[int]) -> None:
    """Every rehearsed trainer ran the same compute collectives in the same order (else NCCL
    hangs on a real run)."""
    logs = {r: exchange.compute_log.get(r, []) for r in trainers}
    first = trainers[0]
    for r in trainers[1:]:
        a, b = logs[first], logs[r]
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise RehearsalError(f"trainers out of lockstep at compute collective #{i}: rank "
                                     f"{first} ran {x}, rank {r} ran {y} (NCCL would hang)")
        if len(a) != len(b):
            raise RehearsalError(f"trainers ran different numbers of compute collectives: rank "
                                 f"{first} {len(a)}, rank {r} {len(b)} (NCCL would hang)")
