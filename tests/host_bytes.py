"""Count the host (CPU) memory a block of code allocates through torch: every storage created inside it, how many
bytes of them were alive at once (the peak) and in all (allocated, freed ones included).

    with NewStorages(dtype=torch.float32) as seen:    # on this thread (dispatch modes are per thread)
        ...
    seen.peak, seen.allocated, seen.alive()          # bytes

A TorchDispatchMode sees the output of every op run on this thread; each output's storage is remembered by a weak
reference (torch.multiprocessing.reductions.StorageWeakRef, as torch's own MemTracker does) with its size, and the
sum over the storages not yet freed is taken after every op. DTensor outputs count their local shard. An output
whose storage is one of the op's inputs' (an in-place op, a view) is not new; storages that existed before the block
(the model, the optimizer) are not counted.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewStorages(TorchDispatchMode):
    def __init__(self, dtype: torch.dtype | None = None, device: str = "cpu"):
        super().__init__()
        self.dtype, self.device = dtype, device
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage data pointer -> (weak ref, bytes)
        self.peak = self.allocated = 0

    def _storage_of(self, t):
        local = getattr(t, "_local_tensor", t)  # a DTensor: its shard
        if not isinstance(local, torch.Tensor) or local.device.type != self.device or local.is_sparse:
            return None
        if self.dtype is not None and local.dtype != self.dtype:
            return None
        storage = local.untyped_storage()
        return storage if storage.data_ptr() and storage.nbytes() else None

    def alive(self) -> int:
        self.live = {ptr: (ref, n) for ptr, (ref, n) in self.live.items() if not ref.expired()}
        return sum(n for _, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {s.data_ptr() for s in map(self._storage_of, tree_leaves((args, kwargs))) if s is not None}
        for t in tree_leaves(out):
            storage = self._storage_of(t)
            if storage is None or storage.data_ptr() in given:  # an in-place op or a view: not a new storage
                continue
            ptr = storage.data_ptr()
            known = self.live.get(ptr)
            if known is None or known[0].expired():
                self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
                self.allocated += storage.nbytes()
        self.peak = max(self.peak, self.alive())
        return out
