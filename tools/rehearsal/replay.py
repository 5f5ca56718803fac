"""Replaying repeated calls: what makes a real-size rehearsal take minutes, not hours.

A FakeTensorMode op costs about a millisecond of Python on these CPUs, so one forward of a 12-20B
transformer is 10-20 s and one training pack 30-40 s; a step runs hundreds of them. Their memory
does not depend on the values: two calls with the same inputs (shapes, dtypes, devices), grad mode
and module state allocate and free the same bytes. So the first call of each kind runs for real and
is measured (the highest bytes held above what was held when it began: its transient; what it leaves
behind: its output), and a later call of the same kind is replayed: its output is a new fake tensor
of the recorded shape, the rank's peak is raised by the recorded transient on top of what it holds
now, and the compute-plane collectives it ran are recorded again. Replayed: a transformer forward
without gradients (sampling, evaluation, TAG generation, update_kl's probe), a VAE decode, and a
training pack (Trainer.train_pack: forward, loss, backward), keyed by whether the gradients it
accumulates into exist (the first pack after an optimizer update allocates them: replayed, it leaves
them as the measured one did). A call that leaves more than its output behind (FSDP2's root stays
gathered after a forward without backward; a lazy initialisation) is not recorded: the next one
runs too, and FSDP2's root state is part of the key. `--no-replay` runs every call (tests/test_rehearse.py: both give the
same figures).
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import torch
from torch.utils import _pytree as pytree


LEFT_BEHIND_BYTES = 1 << 20  # less than this left behind by a call: noise (a cached small tensor)


@dataclasses.dataclass
class Recorded:
    transient: dict[str, int]  # bytes above the holdings at the call's start, by kind
    outputs: object  # pytree of (shape, dtype, device) or plain values
    compute: list  # the compute-plane collectives the call ran
    extra: dict = dataclasses.field(default_factory=dict)


def _meta(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device), value.requires_grad)
    return value


def signature(*values) -> tuple:
    """The call's kind: every tensor's shape, dtype and device; other values as they are."""
    leaves, spec = pytree.tree_flatten(values)
    return (str(spec), tuple(_meta(v) if isinstance(v, torch.Tensor) else
                             (v if isinstance(v, (int, float, bool, str, type(None), torch.dtype))
                              else type(v).__name__) for v in leaves))


class Replay:
    """One rank's record of measured calls, and the counts of every call (for the time model)."""

    def __init__(self, holdings, compute_log: list, enabled: bool = True):
        self.holdings, self.compute_log, self.enabled = holdings, compute_log, enabled
        self.recorded: dict[tuple, Recorded] = {}
        self.recorded_grads: dict[tuple, list[bool]] = {}  # a pack's key -> the gradients it made
        # (phase, what, detail) -> calls: what the time model reads (timing.py)
        self.calls: collections.Counter = collections.Counter()
        self.replayed: collections.Counter = collections.Counter()
        self.local = threading.local()

    def count(self, what: str, detail) -> None:
        self.calls[(self.holdings.innermost(), what, detail)] += 1

    def run(self, what: str, key: tuple, detail, call, rebuild=None):
        """call() measured the first time `key` is seen, replayed after (rebuild(recorded) makes
        the outputs; default: new fake tensors of the recorded shapes)."""
        self.count(what, detail)
        if getattr(self.local, "inside", False):  # a call inside a measured call: part of it
            return call()
        found = self.recorded.get(key) if self.enabled else None
        if found is not None:
            self.replayed[(what, detail)] += 1
            self.holdings.bump(found.transient)
            self.compute_log.extend(found.compute)
            return rebuild(found) if rebuild is not None else _fresh(found.outputs)
        start, log_start = dict(self.holdings.live), len(self.compute_log)
        self.local.inside = True
        try:
            with self.holdings.watermark() as high:
                out = call()
        finally:
            self.local.inside = False
        # what the call left behind besides its output (FSDP's gathered root after a forward
        # without backward, a lazy init, new gradients): a later call would not leave it again, so
        # such a call is not recorded (the next one runs too), except a pack's gradients (rebuilt)
        outputs = sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor))
        left = sum(self.holdings.live.values()) - sum(start.values()) - outputs
        if left <= LEFT_BEHIND_BYTES or what == "pack":
            transient = {k: max(high[k] - start[k], 0) for k in start}
            self.recorded[key] = Recorded(transient, pytree.tree_map(_meta, out),
                                          list(self.compute_log[log_start:]))
        return out


def _fresh(outputs):
    def make(value):
        if isinstance(value, tuple) and value and value[0] == "tensor":
            _, shape, dtype, device, requires_grad = value
            return torch.empty(shape, dtype=dtype, device=device, requires_grad=requires_grad)
        return value
    return pytree.tree_map(make, outputs, is_leaf=lambda v: isinstance(v, tuple) and v
                           and v[0] == "tensor")


def transformer_state(transformer) -> tuple:
    """What about a transformer changes a forward's memory besides its inputs: which module it is,
    adapters on or off (the LoRA reference), gradient checkpointing, training mode, and under FSDP2
    whether its root is gathered (a forward without backward leaves it so until a reshard)."""
    lora = next((m for m in transformer.modules() if hasattr(m, "disable_adapters")), None)
    group = transformer._get_fsdp_state()._fsdp_param_group if hasattr(
        transformer, "_get_fsdp_state") else None
    return (id(transformer), bool(lora.disable_adapters) if lora is not None else None,
            bool(getattr(transformer, "gradient_checkpointing", False)), transformer.training,
            group.is_unsharded if group is not None else None)


def install(families, trainer_cls, replay_of) -> None:
    """Wrap every family's forward and decode, and Trainer.train_pack: `replay_of()` is the calling
    rank's Replay (None outside a rehearsed rank)."""
    for family in families:
        _wrap_forward(family, replay_of)
        _wrap_decode(family, replay_of)
    _wrap_train_pack(trainer_cls, replay_of)


def _wrap_forward(family, replay_of) -> None:
    original = family.forward

    def forward(pipe, transformer, latents, sigma, cond, guidance, negative_cond=None,
                detach_uncond=False):
        replay = replay_of()
        def call():
            return original(pipe, transformer, latents, sigma, cond, guidance, negative_cond,
                            detach_uncond=detach_uncond)
        if replay is None:
            return call()
        grad = torch.is_grad_enabled()
        detail = ("forward", tuple(latents.shape), grad, negative_cond is not None)
        if grad:  # inside a training pack, replayed as a whole
            replay.count("forward", detail)
            return call()
        key = ("forward", transformer_state(transformer), torch.is_autocast_enabled(
            latents.device.type), signature(latents, sigma, cond, guidance, negative_cond))
        return replay.run("forward", key, detail, call)
    family.forward = forward


def _wrap_decode(family, replay_of) -> None:
    original = family.decode

    def decode(pipe, latents, height, width, frames):
        replay = replay_of()
        if replay is None:
            return original(pipe, latents, height, width, frames)
        key = ("decode", signature(latents, height, width, frames))
        with replay.holdings.opened("decode"):
            return replay.run("decode", key, ("decode", tuple(latents.shape)),
                              lambda: original(pipe, latents, height, width, frames))
    family.decode = decode


def _wrap_train_pack(trainer_cls, replay_of) -> None:
    """A pack is keyed by whether the gradients it accumulates into exist: the first pack after an
    optimizer update (zero_grad frees them) allocates them. Such a pack, replayed, raises the peak
    by its measured transient (the gradients grow inside it), then leaves the gradients it made."""
    original = trainer_cls.train_pack

    def train_pack(self, batch, mask, kinds, total_pairs):
        replay = replay_of()
        if replay is None:
            return original(self, batch, mask, kinds, total_pairs)
        grads = all(p.grad is not None for p in self.params)
        key = ("pack", id(self), grads, len(mask), signature(batch))
        detail = ("pack", len(mask), int(sum(mask)))

        def call():
            out = original(self, batch, mask, kinds, total_pairs)
            if not grads:  # which parameters the pack gave a gradient
                replay.recorded_grads[key] = [p.grad is not None for p in self.params]
            return out

        def rebuild(found):
            with torch.no_grad():
                for p, made in zip(self.params, replay.recorded_grads.get(key, ())):
                    if made and p.grad is None:
                        p.grad = torch.zeros_like(p)  # sharded like p under FSDP
            logp = torch.empty(len(mask), dtype=torch.float32, device=self.policy.device)
            mask_t = torch.tensor(mask, dtype=torch.float32, device=self.policy.device)
            self.probe = (batch, logp, mask_t)
            self._bump()
            real = float(sum(mask))
            if real:
                self.metrics.add("pairs", real)
        return replay.run("pack", key, detail, call, rebuild)
    trainer_cls.train_pack = train_pack
