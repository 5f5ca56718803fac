"""The run's evaluation: what `eval_reward` measures, the captioned eval grids and the before/after image.

    ev = Evaluator(train_prompts, heldout_prompts, sampling, reward_fn, seeds_per_prompt=8, run_path="runs/x")
    metrics = ev(policy, updates=0)      # before training: eval/step_000000.png
    metrics = ev(policy, updates=300)    # eval/step_000300.png and before_after.png (step 0 | step 300)

--eval-split test (Flow-GRPO's eval, the default with --pretrained): `train_prompts` is empty and
  `eval_reward` is the mean over the held-out split (a Flow-GRPO dataset's test split), every prompt from the same
  held-out noises, deterministic sampling (noise level 0).
--eval-split train+test (the tiny pipelines' default):
- `eval_reward`: the TRAINING prompts from held-out initial noises (rollout.EVAL_SEED and up, the same noises for
  every prompt), deterministic sampling (noise level 0): did the policy learn what the reward asks for the prompts
  it was trained on, on samples it never saw (the demo's curve).
- `eval_reward_heldout_prompts`: the same for prompts never trained on (for the colour task, other phrasings of
  the three colours). It measures generalisation across phrasings, which a tiny model with a random text encoder
  and three training prompts may not show; it is reported apart so it cannot hide learning.
The samples (prompt-major, `seeds_per_prompt` each) are spread over the evaluating ranks (`share`: this rank's
place among them; the trainers, which hold the evaluated weights, the EMA's with --ema), each generating its
contiguous share `sampling.batch_size` at a time (Flow-GRPO's sample.test_batch_size), scored with each sample's
own prompt and dataset row; `gather` (an all-gather over the trainers' data group) brings every rank the rewards
and the writer the grid's images (the first GRID_PROMPTS prompts: a large evaluation never holds its images
together). Under FSDP (`lockstep`) every rank runs the same number of forward batches. Videos give GIFs. Only the
writer (the trainer leader) writes files and calls `on_images` (TensorBoard, W&B).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from infra.rundir import save_panels

GRID_SCALE = 2  # tiny 32 px samples are drawn at 64 px in the grids
GRID_PROMPTS = 16  # prompts shown in the grids (all of them are scored)


def share_of(count: int, index: int, ranks: int) -> tuple[int, int]:
    """[lo, hi) of `count` samples for rank `index` of `ranks`: contiguous, sizes within one."""
    return count * index // ranks, count * (index + 1) // ranks


class Evaluator:
    def __init__(self, prompts: list[str], heldout_prompts: list[str] | None, sampling, reward_fn,
                 seeds_per_prompt: int, run_path: str | None, writer: bool = True,
                 metadata: list[dict] | None = None, heldout_metadata: list[dict] | None = None, on_images=None,
                 guidance: float | None = None, share: tuple[int, int] = (0, 1),
                 gather: Callable[[object], list] | None = None, lockstep: bool = False):
        """metadata / heldout_metadata: one dataset row per prompt, for rewards that read it (infra/prompts.py).
        on_images(updates, images, captions, rewards): the writer's extra sink (RunDir.log_eval_media).
        guidance: the evaluation's (--eval-guidance), set on the policy while it evaluates; None = the policy's.
        share: (this rank's index, evaluating ranks); gather(x) -> [x of every evaluating rank] (None: one rank);
        lockstep: the same number of forward batches on every rank (FSDP)."""
        self.guidance = guidance
        self.prompts, self.heldout = list(prompts), list(heldout_prompts or [])
        if metadata is not None or heldout_metadata is not None:
            metadata = (list(metadata or [{}] * len(self.prompts))
                        + list(heldout_metadata or [{}] * len(self.heldout)))
        self.metadata = metadata
        self.sampling, self.reward_fn, self.seeds = sampling, reward_fn, seeds_per_prompt
        self.run_path, self.writer, self.on_images = run_path, writer and run_path is not None, on_images
        self.share, self.gather, self.lockstep = share, gather, lockstep
        self.first = None  # (updates, images, rewards) of the first evaluation: the "before" of before_after

    def __call__(self, policy, updates: int) -> dict[str, float]:
        training_guidance = policy.guidance
        policy.guidance = training_guidance if self.guidance is None else self.guidance
        try:
            rewards, images = self._scores(policy)  # [(P + P_heldout) S] on every rank; the grid's images
        finally:
            policy.guidance = training_guidance
        n_train = len(self.prompts) * self.seeds
        main = rewards[:n_train] if self.prompts else rewards  # test only: the held-out split
        metrics = {"eval_reward": float(main.mean())}
        if self.prompts and self.heldout:
            metrics["eval_reward_heldout_prompts"] = float(rewards[n_train:].mean())
        if self.writer:
            self._write(updates, images, rewards, metrics)
            if self.on_images is not None:
                captions = [p for p in self._grid_prompts() for _ in range(self.seeds)]
                self.on_images(updates, images, captions, rewards[:len(captions)])
        return metrics

    def _scores(self, policy) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share generated and scored, then every rank's gathered: (total rewards [n], the grid's
        images [g, ...] in sample order)."""
        from rollout import batch_sizes, eval_samples, evaluate_samples

        samples = eval_samples(len(self.prompts) + len(self.heldout), self.seeds)
        index, ranks = self.share
        lo, hi = share_of(len(samples), index, ranks)
        calls = 0
        if self.lockstep:  # every rank as many forward batches as the largest share needs
            largest = max(b - a for a, b in (share_of(len(samples), r, ranks) for r in range(ranks)))
            calls = len(batch_sizes(largest, self.sampling.batch_size))
        shown = len(self._grid_prompts()) * self.seeds
        scores, images = evaluate_samples(policy, self.prompts + self.heldout, self.metadata, samples[lo:hi],
                                          self.sampling, self.reward_fn, calls,
                                          keep_image=lambda i: lo + i < shown)
        total = scores["total"].float().tolist() if scores else []
        mine = (lo, total, {lo + i: _to_uint8(image) for i, image in images.items()})
        parts = self.gather(mine) if self.gather is not None else [mine]
        rewards = torch.empty(len(samples))
        grid = {}
        for start, values, shown_images in parts:
            rewards[start:start + len(values)] = torch.tensor(values, dtype=torch.float32)
            grid.update(shown_images)
        if not self.writer:  # only the writer draws the grids
            return rewards, torch.empty(0)
        return rewards, torch.stack([grid[i] for i in range(shown)]).float() / 255

    def _grid_prompts(self) -> list[str]:
        """The prompts the grids show: the first GRID_PROMPTS of those evaluated (training prompts first)."""
        return (self.prompts + self.heldout)[:GRID_PROMPTS]

    # --- files ------------------------------------------------------------------------------------
    def _row_labels(self, rewards: torch.Tensor) -> list[str]:
        prompts = self._grid_prompts()
        means = rewards[: len(prompts) * self.seeds].view(len(prompts), self.seeds).mean(dim=1)
        marks = [""] * len(self.prompts) + [" (held out)"] * len(self.heldout)
        return [f'"{p}"{m}: {r:+.2f}' for p, m, r in zip(prompts, marks, means.tolist())]

    def _write(self, updates: int, images: torch.Tensor, rewards: torch.Tensor, metrics: dict) -> None:
        ext = "gif" if images.ndim == 5 else "png"
        shown = images.shape[0]
        labels = [f"{r:+.2f}" for r in rewards[:shown].tolist()]
        what = "training prompts, held-out seeds" if self.prompts else "held-out prompts"
        title = f"step {updates}: eval_reward {metrics['eval_reward']:+.3f} ({what})"
        if "eval_reward_heldout_prompts" in metrics:
            title += f"; held-out prompts {metrics['eval_reward_heldout_prompts']:+.3f}"
        os.makedirs(os.path.join(self.run_path, "eval"), exist_ok=True)
        save_panels([(title, images, labels)], os.path.join(self.run_path, "eval", f"step_{updates:06d}.{ext}"),
                    nrow=self.seeds, row_labels=self._row_labels(rewards), scale=GRID_SCALE)
        # before | after: eval_reward's prompts (the training ones, or with --eval-split test the held-out ones)
        main = min(len(self.prompts or self.heldout) * self.seeds, shown)
        if self.first is None:
            self.first = (updates, images[:main], rewards[:main], metrics["eval_reward"])
            return
        panels = []
        for name, step, imgs, rew, mean in (("before", *self.first),
                                            ("after", updates, images[:main], rewards[:main],
                                             metrics["eval_reward"])):
            panels.append((f"{name}: step {step}, eval_reward {mean:+.3f}", imgs,
                           [f"{r:+.2f}" for r in rew.tolist()]))
        rows = [f'"{p}"' for p in self._grid_prompts()[:main // self.seeds]]
        save_panels(panels, os.path.join(self.run_path, f"before_after.{ext}"), nrow=self.seeds, row_labels=rows,
                    scale=GRID_SCALE)


def _to_uint8(image: torch.Tensor) -> torch.Tensor:
    """An image in [0, 1] as uint8 (a quarter of the bytes through the gather)."""
    return (image.float().clamp(0, 1) * 255).round().to(torch.uint8)
