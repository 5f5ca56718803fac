"""Which tensors of a rehearsed rank are fake and which are real, and what each rank holds.

The rank code runs under `RealSmallMode`, a FakeTensorMode with three changes:
- An op on real CPU tensors only, allocating at most REAL_BYTES when it is a factory, runs for real:
  the values that drive control flow stay real (wire headers, TSP commands, store counters, prompt
  ids, sigmas, rewards, advantages, metric tensors), and everything that touches the stand-in GPU
  (tools/rehearsal/fake_gpu.py) or is large is fake (weights, activations, latents, images,
  checkpoint and publish buffers).
- A small real tensor that goes to the GPU keeps its value beside the fake one (a "shadow"); ops
  whose fake inputs all have one compute it too, and a CPU result that is fully known comes back
  real. So a mask built on the host and moved to the device still sums to a number. A 1-D buffer
  concatenated from real and fake pieces (transport's fragment payload) keeps its real pieces: a
  slice inside one of them is real again after the wire (the names, the rewards, the prompt ids).
- Reading a number out of a value that only the device knows (a loss, a gradient norm, a ratio)
  gives 0 and is recorded with its call site: such a value must not decide anything but a metric.
`Holdings` counts what a rank holds: every storage its threads create, by device ("gpu" is device
memory, the CPU is host memory), with the peak by phase.
"""
from __future__ import annotations

import contextlib
import threading
import traceback
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from tools.rehearsal import fake_gpu

REAL_BYTES = 1 << 20  # a host allocation larger than this is fake (a real one would cost real RAM)
SHADOW_NUMEL = 1 << 16  # a value kept beside a fake tensor: at most this many elements
aten = torch.ops.aten
FACTORIES = {aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default,
             aten.ones.default, aten.full.default, aten.randn.default, aten.randn.generator,
             aten.rand.default, aten.rand.generator, aten.new_empty.default,
             aten.new_zeros.default, aten.new_full.default, aten.new_ones.default,
             aten.empty_like.default, aten.zeros_like.default, aten.randn_like.default}
SLICES = {aten.slice.Tensor, aten.narrow.default}


def _shadow(t):
    return getattr(t, "_rehearsal_shadow", None) if isinstance(t, FakeTensor) else None


def _segments(t):
    return getattr(t, "_rehearsal_segments", None) if isinstance(t, FakeTensor) else None


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * (dtype or torch.get_default_dtype()).itemsize


def _on_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == fake_gpu.NAME
    if isinstance(value, str):
        return value.startswith(fake_gpu.NAME)
    return isinstance(value, torch.Tensor) and value.device.type == fake_gpu.NAME


class RealSmallMode(FakeTensorMode):
    """FakeTensorMode for a rehearsed rank (the module docstring); `holdings` counts storages."""

    def __init__(self, holdings: "Holdings"):
        self._kernel_flags = threading.local()
        super().__init__(allow_non_fake_inputs=True)
        self.holdings = holdings
        self.nested = threading.local()  # inside FakeTensorMode's own handling of an op
        # the rank's threads share this mode (their tensors mix): one op at a time
        self.lock = threading.RLock()
        self.on_collective = lambda func, args: None  # a functional collective (the compute plane)
        self.on_activity = lambda: None  # any op: the rehearsal's deadlock watch
        self.blind_reads: dict[str, int] = {}  # call site -> reads of device-only values

    def __deepcopy__(self, memo) -> "RealSmallMode":
        """The mode itself: copy.deepcopy of a fake tensor copies its __dict__, fake_mode included
        (models.frozen_copy copies a transformer's buffers: Wan's rotary tables), and the copy must
        belong to the rank's mode (tensors of two fake modes in one op raise; the per-thread state
        here cannot be copied at all)."""
        return self

    @property
    def in_kernel_invocation(self) -> bool:
        """FakeTensorMode's flag "inside a meta kernel" (fake tensors then say they are on "meta"),
        per thread: the rank's threads share this mode, and one thread's kernel must not change
        what another sees."""
        return getattr(self._kernel_flags, "value", False)

    @in_kernel_invocation.setter
    def in_kernel_invocation(self, value: bool) -> None:
        self._kernel_flags.value = value

    @property
    def avoid_device_init(self) -> bool:
        """torch.tensor(data, device="gpu") builds on the CPU, then moves under this mode (the
        stand-in device has no real kernels)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(self.nested, "depth", 0):  # a decomposition of a fake op: fake throughout
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if not self.nested.fused:
                self.holdings.track(out)
            return out
        with self.lock:
            self.on_activity()
            if func.namespace == "_c10d_functional":
                self.on_collective(func, args)
            return self._rehearse_op(func, types, args, kwargs)

    def _rehearse_op(self, func, types, args, kwargs):
        flat = pytree.arg_tree_leaves(*args, **kwargs)
        fakes = [t for t in flat if isinstance(t, FakeTensor)]
        if func is aten._local_scalar_dense.default and fakes:
            return self._read(fakes[0])
        if func is aten._fused_sdp_choice.default and _on_device(args[0]):
            return fake_gpu.sdp_choice(args[0], args[3] if len(args) > 3 else kwargs.get(
                "attn_mask"))
        if not fakes and self._stays_real(func, args, flat, kwargs):
            out = func(*args, **kwargs)
        elif func in SLICES and _segments(args[0]) is not None and (
                real := self._real_slice(func, args, kwargs)) is not None:
            return real
        else:
            self.nested.depth, self.nested.fused = 1, _fused(func)
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.nested.depth = 0
            self._follow_values(func, args, kwargs, flat, fakes, out)
            out = self._realize(out)
        self.holdings.track(out)
        return out

    def _stays_real(self, func, args, flat, kwargs) -> bool:
        if any(_on_device(v) for v in flat) or _on_device(kwargs.get("device")):
            return False
        if func in FACTORIES:
            return self._factory_bytes(func, args, kwargs) <= REAL_BYTES
        return True

    @staticmethod
    def _factory_bytes(func, args, kwargs) -> int:
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):  # new_*(self, size) or *_like(self)
            size = args[1] if len(args) > 1 and func.__name__.startswith("new_") else first.shape
            return _nbytes(size, kwargs.get("dtype") or first.dtype)
        return _nbytes(first or [], kwargs.get("dtype"))

    def _read(self, fake):
        """item() of a fake tensor: its shadow's value, else 0 (recorded: a blind read)."""
        shadow = _shadow(fake)
        if shadow is not None:
            return shadow.item()
        site = next((f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                     for f in reversed(traceback.extract_stack()[:-3])
                     if "torch/" not in f.filename and "rehearsal" not in f.filename), "?")
        self.blind_reads[site] = self.blind_reads.get(site, 0) + 1
        return False if fake.dtype == torch.bool else 0 if not fake.is_floating_point() else 0.0

    def _follow_values(self, func, args, kwargs, flat, fakes, out) -> None:
        """Shadows through an op (module docstring); segments through cat and copy_."""
        if func is aten._to_copy.default and not fakes and isinstance(args[0], torch.Tensor):
            if args[0].numel() <= SHADOW_NUMEL and isinstance(out, FakeTensor):
                out._rehearsal_shadow = args[0].detach().clone()
            return
        if func is aten.cat.default and isinstance(out, FakeTensor) and out.ndim == 1 and any(
                _shadow(t) is None for t in args[0] if isinstance(t, FakeTensor)):
            self._cat_segments(args[0], out)
            return
        if func is aten.copy_.default and isinstance(out, FakeTensor):
            source = args[1]
            out._rehearsal_segments = _segments(source)
            out._rehearsal_shadow = (source.detach().clone() if not isinstance(source, FakeTensor)
                                     and source.numel() <= SHADOW_NUMEL else _shadow(source))
            return
        real_args = [_shadow(t) if isinstance(t, FakeTensor) else t for t in flat]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if (not fakes and (seeded or not _on_device(kwargs.get("device")))) or any(
                r is None for r in real_args):  # a device factory (arange, full, ...) has a value
            self._forget_written(func, args)
            return
        if not fakes and isinstance(out, FakeTensor) and out.numel() > SHADOW_NUMEL:
            return
        try:
            values = func(*pytree.tree_map(_to_shadow, args), **pytree.tree_map(_to_shadow, kwargs))
        except Exception:  # noqa: BLE001  (no value: the result stays fake, reads are blind)
            return
        for fake, value in zip(pytree.tree_leaves(out), pytree.tree_leaves(values)):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor) \
                    and value.numel() <= SHADOW_NUMEL:
                fake._rehearsal_shadow = value

    @staticmethod
    def _forget_written(func, args) -> None:
        """An in-place op from values not all known: the written tensor's value is unknown now."""
        if func._schema.is_mutable and args and isinstance(args[0], FakeTensor):
            args[0]._rehearsal_shadow = None
            args[0]._rehearsal_segments = None

    @staticmethod
    def _cat_segments(pieces, out) -> None:
        segments, offset = [], 0
        for piece in pieces:
            real = piece if not isinstance(piece, FakeTensor) else _shadow(piece)
            if real is not None:
                segments.append((offset, offset + piece.numel(), real.reshape(-1)))
            elif _segments(piece):
                segments += [(offset + a, offset + b, r) for a, b, r in _segments(piece)]
            offset += piece.numel()
        out._rehearsal_segments = segments or None

    @staticmethod
    def _real_slice(func, args, kwargs):
        """A slice of a 1-D buffer inside one of its real pieces: that piece's values, real."""
        buffer = args[0]
        if buffer.ndim != 1:
            return None
        if func is aten.narrow.default:
            start, stop = args[2], args[2] + args[3]
        else:
            start = args[2] if len(args) > 2 and args[2] is not None else 0
            stop = args[3] if len(args) > 3 and args[3] is not None else buffer.numel()
            stop = min(stop, buffer.numel())
        for a, b, real in _segments(buffer):
            if a <= start and stop <= b:
                return real[start - a:stop - a]
        return None

    def _realize(self, out):
        """A fake CPU result whose value is fully known is returned as that (real) value."""
        def real(t):
            shadow = _shadow(t)
            if shadow is not None and t.device.type == "cpu" and shadow.shape == t.shape:
                return shadow
            return t
        return pytree.tree_map_only(FakeTensor, real, out)


_FUSED: dict = {}


def _fused(func) -> bool:
    """Whether `func` is one kernel on a device (it has a backend kernel: CPU's stands for CUDA's,
    which a CPU-only torch does not register), so that FakeTensorMode's Python decomposition of it
    (no meta kernel: gelu_backward; addmm, layer norm and its backward in float32 steps) allocates
    temporaries the real kernel does not: only its outputs count. An op composite on every backend
    (_to_copy, slice_backward) runs its pieces on the GPU too: they count."""
    if func not in _FUSED:
        try:
            _FUSED[func] = func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CPU)
        except RuntimeError:  # an operator the dispatcher does not list (prim::device): no kernel
            _FUSED[func] = False
    return _FUSED[func]


def _to_shadow(value):
    if isinstance(value, FakeTensor):
        return _shadow(value)
    if _on_device(value):
        return torch.device("cpu") if isinstance(value, torch.device) else "cpu"
    return value


class Holdings:
    """The storages one rehearsed rank holds, by device (device memory: the stand-in GPU; host:
    the CPU), counted when an op creates them and until they are freed; the peak of each while
    each phase is open (a phase: a tracing span or a named section; several may be open)."""

    def __init__(self, name: str):
        self.name, self.lock = name, threading.Lock()
        self.live = {"device": 0, "host": 0}
        self.peak = {"device": 0, "host": 0}
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.at_end: dict[str, dict[str, int]] = {}  # phase -> bytes held when it last closed
        self.open_phases: dict[int, list[str]] = {}  # thread id -> its open phases
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.excluded = threading.local()  # a thread inside `apart()` allocates for nobody
        self._watermarks: list[dict[str, int]] = []

    def open(self, name: str) -> None:
        """Phase `name` opens on this thread (a tracing span or named section, infra/progress)."""
        self.open_phases.setdefault(threading.get_ident(), []).append(name)
        with self.lock:
            self._note_peak()

    def innermost(self) -> str:
        """The innermost phase open on this thread ("outside" when none is)."""
        stack = self.open_phases.get(threading.get_ident())
        return stack[-1] if stack else "outside"

    def close(self, name: str) -> None:
        """Phase `name` closes on this thread; what the rank holds then is kept (`at_end`)."""
        stack = self.open_phases.get(threading.get_ident(), [])
        if name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name)]
        with self.lock:
            self.at_end[name] = dict(self.live)

    @contextlib.contextmanager
    def opened(self, name: str):
        self.open(name)
        try:
            yield
        finally:
            self.close(name)

    @contextlib.contextmanager
    def apart(self):
        """Allocations the rank itself would not make (a stand-in's data): not counted."""
        self.excluded.on = True
        try:
            yield
        finally:
            self.excluded.on = False

    def track(self, out) -> None:
        if getattr(self.excluded, "on", False):
            return
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.add_storage(t)

    def add_storage(self, t: torch.Tensor) -> None:
        """Count `t`'s storage (once), until it is freed; an empty one too, since FSDP2 frees and
        refills its unsharded parameters by resizing their storage (`resized`)."""
        storage = t.untyped_storage()
        kind = "device" if t.device.type == fake_gpu.NAME else "host"
        with self.lock:
            if storage in self._seen:
                return
            record = [kind, storage.nbytes()]
            self._seen[storage] = record
            self.live[kind] += record[1]
            self._note_peak()
        weakref.finalize(storage, self._free, record)

    def resized(self, storage, nbytes: int) -> None:
        """A storage this rank holds now has `nbytes` (UntypedStorage.resize_, which no dispatch
        mode sees: ranks.py reports it)."""
        with self.lock:
            record = self._seen.get(storage)
            if record is None or record[1] == nbytes:
                return
            self.live[record[0]] += nbytes - record[1]
            record[1] = nbytes
            self._note_peak()

    def _free(self, record: list) -> None:
        with self.lock:
            self.live[record[0]] -= record[1]

    def _note_peak(self) -> None:
        for kind, value in self.live.items():
            self.peak[kind] = max(self.peak[kind], value)
            for high in self._watermarks:
                high[kind] = max(high[kind], value)
        for stack in self.open_phases.values():
            for name in stack:
                peaks = self.phase_peaks.setdefault(name, {"device": 0, "host": 0})
                for kind, value in self.live.items():
                    peaks[kind] = max(peaks[kind], value)

    @contextlib.contextmanager
    def watermark(self):
        """Yields a dict that holds, after the block, the most bytes held by kind during it."""
        high = dict(self.live)
        with self.lock:
            self._watermarks.append(high)
        try:
            yield high
        finally:
            with self.lock:
                self._watermarks.remove(high)

    def bump(self, extra: dict[str, int]) -> None:
        """A replayed call's transient (tools/rehearsal/replay.py): the peak it would reach now."""
        with self.lock:
            for kind, value in extra.items():
                self.live[kind] += value
            self._note_peak()
            for kind, value in extra.items():
                self.live[kind] -= value


@contextlib.contextmanager
def sharding_propagation_apart():
    """DTensor finds an op's output shape by running it on fake copies of its arguments at their GLOBAL shape
    (torch.distributed.tensor._sharding_prop, `_propagate_tensor_meta_non_cached`), in whatever FakeTensorMode is
    active. On a GPU that is a FakeTensorMode of its own and holds no memory; under a rehearsed rank's mode (or
    tools/estimate_memory.py's) it was that mode, so those copies were counted: every AdamW step on FSDP2 shards
    a whole-model copy of the weights, gradients and both moments (FLUX full fine-tuning at K = 8: 231 GiB per
    trainer in the estimate, issue 38 defect 4), gradient clipping a copy of each gradient. Inside this block the
    propagation runs in a FakeTensorMode of its own (one per thread: a rehearsal's ranks are threads), as on a
    GPU."""
    from torch.distributed.tensor import _sharding_prop

    modes = threading.local()

    def own_mode(*args, **kwargs):
        if not hasattr(modes, "mode"):
            modes.mode = FakeTensorMode(allow_non_fake_inputs=True)
        return modes.mode

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = own_mode
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original
