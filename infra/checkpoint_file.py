"""torch.save's file, written one tensor at a time: the leader never holds a whole checkpoint on the host.

    state = {"weights": {"w": Deferred((3072, 12288), torch.float32, source=param)}, "step": 7}
    checkpoint_file.save(state, "state.pt", produce)  # produce(deferred) -> its whole CPU tensor, asked one
                                                       # at a time, in the order deferred_order(state) gives

A full fine-tuning checkpoint is the fp32 weights and AdamW's two moments: 12 bytes per parameter (143 GB for
FLUX.1-dev, 245 GB for Qwen-Image). Gathered into one dict and then torch.save'd, all of it sat in the leader's
host memory at once. Here the state's structure is pickled first with a `Deferred` (shape, dtype) where each
big tensor goes; the file then asks for the tensors in order, writes each and lets it go, so the leader holds
one whole tensor (the largest: 151 MB for FLUX) beyond what it already had.

The file is the one torch.save writes for the same state, byte for byte apart from its random serialization
id: the same pickle (a deferred tensor pickles as torch pickles a contiguous CPU tensor of its shape and
dtype), the same records in the same order (data.pkl, .format_version, .storage_alignment, byteorder, then
data/0, data/1, ... numbered in the pickle's order; tests/test_checkpoint_file.py compares the bytes). So
torch.load(path, mmap=True, weights_only=True) reads it (records aligned for mmap, as torch.save aligns them)
and code that read torch.save's checkpoints reads these. It uses torch.save's own writer
(torch.serialization._open_zipfile_writer, torch._C.PyTorchFileWriter) and mirrors torch.serialization._save's
pickling: the test above fails if a torch release changes the format.
"""
from __future__ import annotations

import collections
import io
import pickle
import sys
from collections.abc import Callable

import torch
from torch.serialization import _get_storage_alignment, _open_zipfile_writer


class Deferred:
    """A tensor of the state that is produced only when the file reaches it: its shape and dtype now (the
    pickle needs only those), its values from `produce(deferred)` later. `source` is whatever the producer
    needs to make it (e.g. the FSDP shard to gather)."""

    __slots__ = ("shape", "dtype", "source")

    def __init__(self, shape, dtype: torch.dtype, source=None):
        self.shape, self.dtype, self.source = torch.Size(shape), dtype, source

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"Deferred({tuple(self.shape)}, {self.dtype})"


class _DeferredStorage:
    """What a Deferred pickles as the storage of: torch's persistent id names its dtype, key and size."""

    __slots__ = ("deferred",)

    def __init__(self, deferred: Deferred):
        self.deferred = deferred


def _storage_type(dtype: torch.dtype):
    """torch.FloatStorage for float32, torch.BFloat16Storage for bfloat16, ...: what torch.save pickles."""
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class _Records:
    """The pickle of a state, and its storages in key order: ("tensor", storage) for a tensor already there,
    ("deferred", Deferred) for one to produce. Keys are numbered as torch.serialization._save numbers them: in
    the order the pickler meets the storages."""

    def __init__(self, state):
        self.entries: list[tuple[str, object]] = []
        keys: dict[int, str] = {}  # a storage met again (two views of one tensor) keeps its key
        records = self

        class Pickler(pickle.Pickler):
            def reducer_override(self, obj):
                if isinstance(obj, Deferred):  # as Tensor._reduce_ex_internal reduces a contiguous CPU tensor
                    return (torch._utils._rebuild_tensor_v2,
                            (_DeferredStorage(obj), 0, tuple(obj.shape), _contiguous_stride(obj.shape), False,
                             collections.OrderedDict()))
                return NotImplemented

            def persistent_id(self, obj):
                if isinstance(obj, _DeferredStorage):
                    key = str(len(records.entries))
                    records.entries.append(("deferred", obj.deferred))
                    return ("storage", _storage_type(obj.deferred.dtype), key, "cpu", obj.deferred.shape.numel())
                if isinstance(obj, torch.storage.TypedStorage):  # a tensor already in the state
                    storage = obj._untyped_storage
                    if storage.device.type != "cpu":
                        raise ValueError(f"checkpoint_file.save: a {storage.device} tensor in the state; "
                                         "move it to the CPU (or defer it)")
                    key = keys.get(storage._cdata)
                    if key is None:
                        key = keys[storage._cdata] = str(len(records.entries))
                        records.entries.append(("tensor", storage))
                    return ("storage", getattr(torch, obj._pickle_storage_type()), key, "cpu", obj._size())
                if torch.is_storage(obj):
                    raise ValueError("checkpoint_file.save: untyped storages in the state are not supported")
                return None

        buffer = io.BytesIO()
        Pickler(buffer, protocol=2).dump(state)  # torch.save's DEFAULT_PROTOCOL
        self.pickle = buffer.getvalue()

    def deferred(self) -> list[Deferred]:
        return [d for kind, d in self.entries if kind == "deferred"]


def deferred_order(state) -> list[Deferred]:
    """The Deferred tensors of `state` in the order `save` asks for them (the pickle's order). A rank that takes
    part in producing them without writing (an FSDP trainer other than the leader: each gather is a
    collective) walks this same list."""
    return _Records(state).deferred()


def filled(state, produced: dict[int, torch.Tensor]):
    """`state` with each Deferred d replaced by produced[id(d)] (dicts, lists and tuples rebuilt; the rest as is):
    the whole state in memory, what `save` writes without ever holding it."""
    if isinstance(state, Deferred):
        return produced[id(state)]
    if isinstance(state, dict):
        return {k: filled(v, produced) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(filled(v, produced) for v in state)
    return state


def save(state, path: str, produce: Callable[[Deferred], torch.Tensor],
         on_write: Callable[[], None] | None = None) -> None:
    """Write torch.save(state with every Deferred replaced by its tensor) to `path`, asking produce(d) for one
    Deferred at a time, in deferred_order(state), and holding each only while it is written; `on_write()` after
    each tensor's record (a checkpoint of many GB takes minutes: the caller's progress, infra/progress.py). The tensor must
    have the Deferred's shape and dtype and lie on the CPU. Not atomic by itself: write to a temporary name
    and rename (infra/rundir.py does, for the whole checkpoint folder)."""
    records = _Records(state)
    with _open_zipfile_writer(path) as writer:  # torch.save's own writer (entering it gives the writer)
        writer.write_record("data.pkl", records.pickle, len(records.pickle))
        writer.write_record(".format_version", "1", len("1"))
        alignment = str(_get_storage_alignment())
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, (kind, item) in enumerate(records.entries):
            name = f"data/{key}"
            if kind == "tensor":
                writer.write_record(name, item, item.nbytes())
                if on_write is not None:
                    on_write()
                continue
            tensor = produce(item)
            if tensor.shape != item.shape or tensor.dtype != item.dtype or tensor.device.type != "cpu":
                raise ValueError(f"checkpoint_file.save: produced a {tensor.dtype} {tuple(tensor.shape)} tensor on "
                                 f"{tensor.device} for {item!r} (record {name})")
            if tensor.storage_offset() or not tensor.is_contiguous():  # a view inside its storage: its own bytes
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            writer.write_record(name, tensor.untyped_storage(), item.nbytes)  # the first nbytes (FSDP's padded
            del tensor  # gather is longer); the one whole tensor held: let it go before the next is produced
            if on_write is not None:
                on_write()
