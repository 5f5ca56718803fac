"""EMA of the trained weights (Flow-GRPO's `train.ema`): evaluation uses it when on, checkpoints
save it, and the saved LoRA file is the EMA's (Flow-GRPO's save_ckpt swaps it in to save).

Flow-GRPO (flow_grpo/ema.py `step`, decay 0.9 and update_step_interval 8) is stepped by
scripts/train_sd3.py line 955 (train_flux.py the same) with `global_step`, the optimizer updates
taken so far, once after every *sampled sub-batch* of the training loop, i.e.
gradient_accumulation_steps (GA) times per optimizer update. So when (g + 1) is a multiple of
`every` for g = global_step,
    ema <- ema + (1 - d_g) (theta_g - ema),   d_g = min((1 + g) / (10 + g), decay)  (a warm-up),
is applied GA times with the same weights theta_g (no update happens between those calls): an
effective decay d_g^GA per trigger (0.81 for its SD3 recipes' GA 2, 0.53 for FLUX's GA 6). Here
`update(params, g)` runs once after each update with g = the updates taken, applying the trigger's
`repeats` (= GA, config.ema_repeats) at once. Flow-GRPO spreads them over the next update's
accumulation; the values differ only if an evaluation or a checkpoint falls in between, which
with its two updates per epoch and an even `every` never happens (g + 1 even: g is a step's first
update).
The shadow has the parameters' own layout (an FSDP shard per trainer), so it costs one more copy of
the trainable weights per trainer (LoRA: the adapters only). Sampling and publishing use the trained
weights, as in Flow-GRPO; only evaluation and the saved LoRA swap the shadow in.
"""
import contextlib

import torch


def decay_at(global_step: int, decay: float) -> float:
    """d_g: Flow-GRPO's warm-up (its ema.py get_current_decay), so the first updates are not
    averaged with the initial weights at `decay`."""
    return min((1 + global_step) / (10 + global_step), decay)


class Ema:
    def __init__(self, params: list[torch.Tensor], decay: float, every: int, repeats: int = 1):
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in params]
        self.decay, self.every, self.repeats = decay, every, repeats

    @torch.no_grad()
    def update(self, params: list[torch.Tensor], global_step: int) -> None:
        """After an optimizer update, `global_step` = the updates taken so far over the run (1 after
        the first): Flow-GRPO's ema.step(params, global_step), `repeats` times."""
        if (global_step + 1) % self.every:
            return
        keep_new = 1.0 - decay_at(global_step, self.decay)
        for _ in range(self.repeats):
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
