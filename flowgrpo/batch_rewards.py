"""Flow-GRPO's batch-level advantages across ranks: a step's rewards, through the job's store.

    rewards = BatchRewards(store, groups_per_step, group_size, advantages)  # batch -> [N]
    rewards.post(fragment)                   # a producer, as it scores a fragment (Rank.generate)
    fragments = rewards.restate(step, mine)  # a trainer, holding all its fragments of the step
    rewards.forget(step)                     # the leader, at the step's end (books.forgetting)

Per-group advantages (the default) need nothing of this: a fragment is self-contained. Flow-GRPO's
per-prompt statistics (several groups of one prompt pool) and global_std need every reward of the
batch before any advantage is final, but rollout ranks and TAG's trainers produce fragments on
different ranks, and a trainer without TSP sees only the fragments dealt to it. So each producer
posts each group's (prompt id, rewards) under `{step}/{group}` when it scores it; a trainer restates
its fragments' advantages from grpo.advantages over the whole batch once every group of the step is
posted. Store only (CPU, the data plane), no collective.

Deadlocks: restate runs after the step's fragment iterator is exhausted
(main.TrainerRank.train_batch, a trainer's and a colocated rank's), and by then every group of the
step has been produced. Rollout ranks generate a step's groups without waiting for that step's
training; under TSP's lockstep with TAG the trainers generate their groups inside the iterator
itself, so exhausting it means all groups are in;
colocated ranks generate their static share before they restate. A post happens inside generation,
before the fragment is announced or sent, so a fragment a trainer holds has always been posted. The
wait has no deadline (a dead producer ends the job through liveness). Forgetting step s at its end
is safe: every trainer has restated s before the optimizer step's all-reduce, and no producer posts
for s after all of s's groups are in.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from typing import ContextManager

import torch

import grpo
from fragment import Fragment


def is_batch_level(cfg) -> bool:
    """Whether the run's advantage statistics span the batch (per_prompt_stat_tracking set)."""
    return cfg.per_prompt_stat_tracking is not None


def run_advantages(cfg) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """advantages(rewards [N], prompt_ids [N]) of a whole batch, with the run's settings."""
    return functools.partial(grpo.advantages, group_size=cfg.group_size,
                             per_prompt=cfg.per_prompt_stat_tracking, global_std=cfg.global_std,
                             collapsed_std=cfg.collapsed_std, collapsed=cfg.collapsed_groups,
                             clip=cfg.adv_clip)


def for_run(cfg, store, tracer) -> "BatchRewards | None":
    """The run's BatchRewards (waits in "wait" spans), or None with per-group statistics."""
    if not is_batch_level(cfg):
        return None

    def wait_span(step: int) -> ContextManager:
        return tracer.span("wait", step=step, what="rewards")
    return BatchRewards(store, cfg.prompts_per_step, cfg.group_size, run_advantages(cfg), wait_span)


class BatchRewards:
    """Each group's (prompt id, rewards) in a store, per step; fragments restated from the batch.

    store None (one rank): nothing is posted and restate needs the whole batch in hand.
    advantages(rewards, prompt_ids) -> [N] over the batch in group order (run_advantages);
    wait_span(step): a context around a wait for other ranks' rewards (a tracing span)."""

    def __init__(self, store, groups_per_step: int, group_size: int,
                 advantages: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 wait_span: Callable[[int], ContextManager] | None = None, poll_s: float = 0.002):
        self.store, self.groups_per_step, self.group_size = store, groups_per_step, group_size
        self.advantages, self.poll_s = advantages, poll_s
        self.wait_span = wait_span or (lambda step: contextlib.nullcontext())
        self._last: tuple[int, torch.Tensor] | None = None  # (step, its batch advantages)

    def post(self, fragment: Fragment) -> None:
        """Publish the fragment's groups: one key per group, so any cut of the batch, posted in any
        order, by any producer, fills the same keys."""
        if self.store is None:
            return
        for group, (prompt, rewards) in _groups(fragment).items():
            self.store.set(f"{fragment.step}/{group}", json.dumps([prompt, rewards]))

    def batch(self, step: int, fragments: list[Fragment]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards [N] float32, prompt ids [N]) of the whole batch in group order: the fragments'
        own, the other groups' from the store (waiting until every one is posted)."""
        have = {g: v for f in fragments for g, v in _groups(f).items()}
        missing = [g for g in range(self.groups_per_step) if g not in have]
        if missing:
            if self.store is None:
                raise RuntimeError(f"step {step}: groups {missing} are not in hand and there is "
                                   "no store (one rank)")
            keys = [f"{step}/{g}" for g in missing]
            with self.wait_span(step):
                while not self.store.check(keys):  # polled: no wait holds the store connection
                    time.sleep(self.poll_s)
            have.update({g: tuple(json.loads(self.store.get(k)))
                         for g, k in zip(missing, keys)})
        rewards = [r for g in range(self.groups_per_step) for r in have[g][1]]
        prompts = [have[g][0] for g in range(self.groups_per_step) for _ in range(self.group_size)]
        return torch.tensor(rewards, dtype=torch.float32), torch.tensor(prompts, dtype=torch.long)

    def restate(self, step: int, fragments: list[Fragment]) -> list[Fragment]:
        """The fragments with their advantages computed over the whole batch of `step`."""
        if not fragments:
            return fragments  # a trainer dealt nothing this step trains nothing: no wait
        advantages = self.batch_advantages(step, fragments)  # [N]
        out = []
        for f in fragments:
            first = f.first_group * self.group_size
            mine = advantages[first:first + f.num_samples]
            out.append(dataclasses.replace(f, advantages=mine.to(f.advantages.device,
                                                                  f.advantages.dtype)))
        return out

    def batch_advantages(self, step: int, fragments: list[Fragment]) -> torch.Tensor:
        """[N] advantages of the whole batch of `step` in group order (computed once per step)."""
        if self._last is None or self._last[0] != step:
            rewards, prompts = self.batch(step, fragments)
            self._last = (step, self.advantages(rewards, prompts))
        return self._last[1]

    def forget(self, step: int) -> None:
        """Delete step `step`'s keys (the leader, at the step's end): the store must not grow."""
        if self.store is None:
            return
        for g in range(self.groups_per_step):
            self.store.delete_key(f"{step}/{g}")


def _groups(fragment: Fragment) -> dict[int, tuple[int, list[float]]]:
    """Group index in the batch -> (its prompt id, its G rewards: float32 values, exact in JSON)."""
    g = fragment.group_size
    prompts = fragment.prompt_ids.reshape(-1, g)[:, 0].tolist()
    rewards = fragment.rewards.to("cpu", torch.float32).reshape(-1, g).tolist()
    return {fragment.first_group + i: (prompts[i], rewards[i]) for i in range(fragment.num_groups)}
