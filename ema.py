"""EMA of the trained weights (Flow-GRPO's `train.ema`): evaluation uses it when on, checkpoints
save it.

Flow-GRPO (flow_grpo/ema.py, stepped by scripts/train_*.py after every optimizer update with decay
0.9 and update_step_interval 8): after update u (0-based, counted over the whole run), when (u + 1)
is a multiple of `every`,
    ema <- ema + (1 - d_u) (theta - ema),   d_u = min((1 + u) / (10 + u), decay)
    (a warm-up of the decay).
The shadow has the parameters' own layout (an FSDP shard per trainer), so it costs one more copy of
the trainable weights per trainer (LoRA: the adapters only). Sampling and publishing use the trained
weights, as in Flow-GRPO; only evaluation swaps the shadow in.
"""
import contextlib

import torch


def decay_at(update: int, decay: float) -> float:
    """d_u: Flow-GRPO's warm-up, so the first updates are not averaged with the initial weights at
    `decay`."""
    return min((1 + update) / (10 + update), decay)


class Ema:
    def __init__(self, params: list[torch.Tensor], decay: float, every: int):
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in params]
        self.decay, self.every = decay, every

    @torch.no_grad()
    def update(self, params: list[torch.Tensor], update: int) -> None:
        """After optimizer update `update` (0-based over the run)."""
        if (update + 1) % self.every:
            return
        keep_new = 1.0 - decay_at(update, self.decay)
        for shadow, p in zip(self.shadow, params, strict=True):
            shadow.add_(keep_new * (p.detach() - shadow))

    @contextlib.contextmanager
    def swapped_in(self, params: list[torch.Tensor]):
        """The shadow in the parameters for the block (evaluation), the trained weights back
        after."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in params]
            for p, shadow in zip(params, self.shadow, strict=True):
                p.copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, kept in zip(params, trained, strict=True):
                    p.copy_(kept)
