"""The run's evaluation: what `eval_reward` measures, the captioned eval grids and the before/after image.

    ev = Evaluator(train_prompts, heldout_prompts, sampling, reward_fn, seeds_per_prompt=8, run_path="runs/x")
    metrics = ev(policy, updates=0)      # before training: eval/step_000000.png
    metrics = ev(policy, updates=300)    # eval/step_000300.png and before_after.png (step 0 | step 300)

- `eval_reward`: the TRAINING prompts from held-out initial noises (rollout.EVAL_SEED and up, the same noises for
  every prompt), deterministic sampling (noise level 0). This is the main learning curve: did the policy learn
  what the reward asks for the prompts it was trained on, on samples it never saw.
- `eval_reward_heldout_prompts`: the same for prompts never trained on (for the colour task, other phrasings of
  the three colours). It measures generalisation across phrasings, which a tiny model with a random text encoder
  and three training prompts may not show; it is reported apart so it cannot hide learning.
Videos give GIFs. Only the writer (the trainer leader) writes files and calls `on_images` (TensorBoard, W&B);
under FSDP every trainer rank calls the evaluator (the sharded forward is a collective) and the others only compute.
"""
from __future__ import annotations

import os

import torch

from infra.rundir import save_panels

GRID_SCALE = 2  # tiny 32 px samples are drawn at 64 px in the grids


class Evaluator:
    def __init__(self, prompts: list[str], heldout_prompts: list[str] | None, sampling, reward_fn,
                 seeds_per_prompt: int, run_path: str | None, writer: bool = True,
                 metadata: list[dict] | None = None, heldout_metadata: list[dict] | None = None, on_images=None,
                 guidance: float | None = None):
        """metadata / heldout_metadata: one dataset row per prompt, for rewards that read it (infra/prompts.py).
        on_images(updates, images, captions, rewards): the writer's extra sink (RunDir.log_eval_media).
        guidance: the evaluation's (--eval-guidance), set on the policy while it evaluates; None = the policy's."""
        self.guidance = guidance
        self.prompts, self.heldout = list(prompts), list(heldout_prompts or [])
        if metadata is not None:
            metadata = list(metadata) + list(heldout_metadata or [{}] * len(self.heldout))
        self.metadata = metadata
        self.sampling, self.reward_fn, self.seeds = sampling, reward_fn, seeds_per_prompt
        self.run_path, self.writer, self.on_images = run_path, writer and run_path is not None, on_images
        self.first = None  # (updates, images, rewards) of the first evaluation: the "before" of before_after

    def __call__(self, policy, updates: int) -> dict[str, float]:
        from rollout import evaluate

        training_guidance = policy.guidance
        policy.guidance = training_guidance if self.guidance is None else self.guidance
        try:
            scores, images = evaluate(policy, self.prompts + self.heldout, self.sampling, self.reward_fn,
                                      seeds_per_prompt=self.seeds, metadata=self.metadata)
        finally:
            policy.guidance = training_guidance
        rewards = scores["total"].float()  # [(P + P_heldout) S]
        n_train = len(self.prompts) * self.seeds
        metrics = {"eval_reward": float(rewards[:n_train].mean())}
        if self.heldout:
            metrics["eval_reward_heldout_prompts"] = float(rewards[n_train:].mean())
        if self.writer:
            self._write(updates, images, rewards, metrics)
            if self.on_images is not None:
                captions = [p for p in self.prompts + self.heldout for _ in range(self.seeds)]
                self.on_images(updates, images, captions, rewards)
        return metrics

    # --- files ------------------------------------------------------------------------------------
    def _row_labels(self, rewards: torch.Tensor, heldout_too: bool) -> list[str]:
        prompts = self.prompts + (self.heldout if heldout_too else [])
        means = rewards[: len(prompts) * self.seeds].view(len(prompts), self.seeds).mean(dim=1)
        marks = [""] * len(self.prompts) + [" (held out)"] * (len(prompts) - len(self.prompts))
        return [f'"{p}"{m}: {r:+.2f}' for p, m, r in zip(prompts, marks, means.tolist())]

    def _write(self, updates: int, images: torch.Tensor, rewards: torch.Tensor, metrics: dict) -> None:
        ext = "gif" if images.ndim == 5 else "png"
        labels = [f"{r:+.2f}" for r in rewards.tolist()]
        title = f"step {updates}: eval_reward {metrics['eval_reward']:+.3f} (training prompts, held-out seeds)"
        if self.heldout:
            title += f"; held-out prompts {metrics['eval_reward_heldout_prompts']:+.3f}"
        os.makedirs(os.path.join(self.run_path, "eval"), exist_ok=True)
        save_panels([(title, images, labels)], os.path.join(self.run_path, "eval", f"step_{updates:06d}.{ext}"),
                     nrow=self.seeds, row_labels=self._row_labels(rewards, heldout_too=True), scale=GRID_SCALE)
        n_train = len(self.prompts) * self.seeds
        if self.first is None:
            self.first = (updates, images[:n_train], rewards[:n_train])
            return
        before_updates, before_images, before_rewards = self.first
        panels = []
        for name, step, imgs, rew in (("before", before_updates, before_images, before_rewards),
                                      ("after", updates, images[:n_train], rewards[:n_train])):
            panels.append((f"{name}: step {step}, eval_reward {float(rew.mean()):+.3f}", imgs,
                           [f"{r:+.2f}" for r in rew.tolist()]))
        rows = [f'"{p}"' for p in self.prompts]
        save_panels(panels, os.path.join(self.run_path, f"before_after.{ext}"), nrow=self.seeds, row_labels=rows,
                    scale=GRID_SCALE)
