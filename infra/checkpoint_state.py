"""A trainer's checkpoint state: its weights, AdamW state, EMA and counters, as a structure of tensors made
whole one at a time (under FSDP gathered from the shards) and loaded back onto this rank's shards.

    state = skeleton(trainer)              # the structure, a checkpoint_file.Deferred per tensor
    checkpoint_file.save(state, path, functools.partial(produce, trainer))  # streamed (infra/bookkeeping.py)
    load(trainer, torch.load(path, mmap=True, weights_only=True))          # --resume

Streamed, a checkpoint never sits whole in host memory: the leader holds one whole tensor beyond what it
already had, the other trainers none (they take part in the gathers and drop each). `whole_state` produces
every tensor into one dict: the reference the streamed file is checked against (tests), never a run's path.

`trainer` is trainer.Trainer (this file reads its names, params, optimizer, ema, bad_steps_in_a_row,
updates_total and progress); every tensor made whole or placed is a unit of progress (a 24-41 GB checkpoint
takes minutes).
"""
from __future__ import annotations

import torch

from infra import checkpoint_file, fsdp  # fsdp.whole_tensor through its module: tests wrap it
from infra.checkpoint_file import Deferred


def skeleton(trainer) -> dict:
    """The checkpoint's structure, the same sharded or not: {"weights": name -> tensor, "optimizer":
    the state dict, "bad_steps_in_a_row", "updates_total"[, "ema": name -> tensor]}, with a
    checkpoint_file.Deferred (shape, dtype, and this rank's tensor or FSDP shard as its source) in
    place of every weight, AdamW moment and EMA shadow; scalars (AdamW's step) as CPU tensors.
    `produce` makes each Deferred whole, in checkpoint_file.deferred_order."""
    def deferred(t: torch.Tensor):
        return Deferred(t.shape, t.dtype, t) if t.ndim else t.detach().to("cpu")

    optimizer = trainer.optimizer.state_dict()
    optimizer["state"] = {i: {k: deferred(v) for k, v in entry.items()}
                          for i, entry in optimizer["state"].items()}
    state = {"weights": {name: deferred(p) for name, p in zip(trainer.names, trainer.params)},
             "optimizer": optimizer, "bad_steps_in_a_row": trainer.bad_steps_in_a_row,
             "updates_total": trainer.updates_total}
    if trainer.ema is not None:
        state["ema"] = {name: deferred(t) for name, t in zip(trainer.names, trainer.ema.shadow)}
    return state


def produce(trainer, tensor: Deferred, keep: bool = True) -> torch.Tensor | None:
    """One Deferred of `skeleton` whole on the CPU. Under FSDP it is gathered now (a collective):
    every trainer produces the same ones in the same order, and only the leader, which writes the
    file, keeps each (`keep`) for as long as it writes it."""
    with torch.no_grad():
        whole = fsdp.whole_tensor(tensor.source)
        whole = whole.to("cpu") if keep else None
    _bump(trainer)
    return whole


def whole_state(trainer, keep: bool = True) -> dict | None:
    """The whole checkpoint in memory: `skeleton` with every tensor produced (whole, on the CPU) and
    kept where `keep`; other ranks take part in the gathers and keep nothing. The reference the
    streamed file is checked against (tests); a run writes it streamed (infra/bookkeeping.py), never
    holding it all."""
    state = skeleton(trainer)
    produced = {}
    for tensor in checkpoint_file.deferred_order(state):
        whole = produce(trainer, tensor, keep)
        if keep:
            produced[id(tensor)] = whole
        del whole
    return checkpoint_file.filled(state, produced) if keep else None


def load(trainer, state: dict) -> None:
    """Inverse of whole_state; re-shards whole tensors onto this rank's FSDP shards when sharded."""
    with torch.no_grad():
        for name, p in zip(trainer.names, trainer.params):  # read from the memory-mapped file here
            p.copy_(fsdp.placed_like(state["weights"][name], p))
            _bump(trainer)
    optimizer = dict(state["optimizer"])
    optimizer["state"] = {i: {k: _placed(trainer, v, trainer.params[i]) for k, v in s.items()}
                          for i, s in optimizer["state"].items()}
    trainer.optimizer.load_state_dict(optimizer)
    # --max-bad-steps counts across a resume
    trainer.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)
    trainer.updates_total = state.get("updates_total", 0)
    # a checkpoint without an EMA (--ema turned on at resume) starts it here
    if trainer.ema is not None:
        with torch.no_grad():
            for name, shadow, p in zip(trainer.names, trainer.ema.shadow, trainer.params):
                shadow.copy_(fsdp.placed_like(state["ema"][name], p) if "ema" in state else p.detach())


def _placed(trainer, value: torch.Tensor, param) -> torch.Tensor:
    """An optimizer state tensor placed like `param` (a scalar stays), a unit of progress."""
    if not value.ndim:
        return value
    placed = fsdp.placed_like(value, param)
    _bump(trainer)
    return placed


def _bump(trainer) -> None:
    if trainer.progress is not None:
        trainer.progress.bump()
