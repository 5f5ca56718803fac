"""Flow-GRPO's advantage options (grpo.batch_advantages, grpo.collapsed_prompts) against Flow-GRPO's own code,
re-typed below, on fixed reward tables: several prompts, prompts repeated over several groups of one batch, in
shuffled order (as its DistributedKRepeatSampler deals them), global_std on and off, per-prompt tracking off.

Run: python -m pytest -q tests/test_advantages.py
"""
import numpy as np
import pytest
import torch

import grpo

pytestmark = pytest.mark.timeout(60)


# --- Flow-GRPO: yifan123/flow_grpo, flow_grpo/stat_tracking.py, `PerPromptStatTracker`, commit
# 94e23ee5405ab7241fc1f75d30cac8147e2b1f53, re-typed for type='grpo' (the path every train_*.py script takes; the
# gardo / rwr / sft / dpo branches are left out).
class PerPromptStatTracker:
    def __init__(self, global_std=False):
        self.global_std = global_std
        self.stats = {}
        self.history_prompts = set()

    def update(self, prompts, rewards, dists=None, type='grpo'):
        prompts = np.array(prompts)
        rewards = np.array(rewards, dtype=np.float64)
        unique = np.unique(prompts)
        advantages = np.empty_like(rewards) * 0.0
        for prompt in unique:
            prompt_rewards = rewards[prompts == prompt]
            if prompt not in self.stats:
                self.stats[prompt] = []
            self.stats[prompt].extend(prompt_rewards)
            self.history_prompts.add(hash(prompt))
        for prompt in unique:
            self.stats[prompt] = np.stack(self.stats[prompt])
            prompt_rewards = rewards[prompts == prompt]
            mean = np.mean(self.stats[prompt], axis=0, keepdims=True)
            if self.global_std:
                std = np.std(rewards, axis=0, keepdims=True) + 1e-4
            else:
                std = np.std(self.stats[prompt], axis=0, keepdims=True) + 1e-4
            if type == 'grpo':
                advantages[prompts == prompt] = (prompt_rewards - mean) / std
        return advantages

    def clear(self):
        self.stats = {}


# --- Flow-GRPO: scripts/train_sd3.py (commit 74db69191de9a0a54869c9c3341ce4b54db7005f), the advantage block: rewards
# repeated over the trained timesteps, the tracker (cleared after every batch) or the batch-wide normalisation, the
# clamp to +-adv_clip_max in the training loop, and the mask of samples whose advantages are all zero (dropped).
def flow_grpo_train_sd3_advantages(prompts, rewards, per_prompt_stat_tracking, global_std, num_train_timesteps=3,
                                   adv_clip_max=5):
    avg = np.asarray(rewards, dtype=np.float32)[:, None].repeat(num_train_timesteps, axis=1)  # [N, T] (torch float)
    if per_prompt_stat_tracking:
        stat_tracker = PerPromptStatTracker(global_std)
        advantages = stat_tracker.update(prompts, avg)
        stat_tracker.clear()
    else:
        advantages = (avg - avg.mean()) / (avg.std() + 1e-4)
    advantages = torch.as_tensor(advantages)
    mask = advantages.abs().sum(dim=1) != 0
    clipped = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    return clipped, mask


def _batch(seed=0):
    """A batch of 6 groups of 4 over 4 prompts: "red" has 2 groups and "blue" 2 (pooled per prompt), "grey" 1 group
    whose rewards are all equal (collapsed), "cat" 1 group with a spread of 0.007 (near-collapsed); shuffled."""
    g = torch.Generator().manual_seed(seed)
    table = {"red": torch.rand(8, generator=g), "blue": torch.rand(8, generator=g) * 0.5 - 1.0,
             "grey": torch.full((4,), 0.25), "cat": 0.6 + 0.007 * torch.randn(4, generator=g)}
    prompts = [p for p, r in table.items() for _ in range(len(r))]
    rewards = torch.cat(list(table.values()))
    order = torch.randperm(len(prompts), generator=g)
    return [prompts[i] for i in order], rewards[order]


@pytest.mark.parametrize("global_std", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_prompt_advantages_equal_flow_grpos_stat_tracker(global_std, seed):
    """Catches: statistics per group instead of per prompt over the batch (the two groups of "red" must share one
    mean and std), global_std ignored or computed over one prompt, an unbiased std (Flow-GRPO's np.std is ddof 0),
    eps inside the square root or missing, the clip at 5 missing."""
    prompts, rewards = _batch(seed)
    theirs, _ = flow_grpo_train_sd3_advantages(prompts, rewards, True, global_std)
    ours = grpo.batch_advantages(rewards, prompts, global_std=global_std)
    for column in theirs.T:  # Flow-GRPO repeats the advantage over the trained timesteps
        torch.testing.assert_close(ours, column.float(), rtol=1e-5, atol=1e-5)
    ids = {p: i for i, p in enumerate(sorted(set(prompts)))}  # prompt ids key the same statistics as texts
    torch.testing.assert_close(grpo.batch_advantages(rewards, torch.tensor([ids[p] for p in prompts]),
                                                     global_std=global_std), ours)
    # the table is not degenerate: pooling differs from per-group statistics, global from per-prompt std
    per_group = grpo.group_advantages(rewards[torch.argsort(torch.tensor([ids[p] for p in prompts]), stable=True)], 4)
    assert not torch.allclose(torch.sort(per_group).values, torch.sort(ours).values, atol=1e-3)
    other = grpo.batch_advantages(rewards, prompts, global_std=not global_std)
    assert float((other - ours).abs().max()) > 0.1


def test_batch_wide_advantages_equal_flow_grpos_without_per_prompt_tracking():
    """per_prompt_stat_tracking off: one mean and std over the batch (train_sd3.py's else-branch)."""
    prompts, rewards = _batch(3)
    theirs, _ = flow_grpo_train_sd3_advantages(prompts, rewards, False, False)
    ours = grpo.batch_advantages(rewards, per_prompt=False)
    torch.testing.assert_close(ours, theirs[:, 0].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_prompt, global_std", [(True, True), (False, False)])
def test_outliers_are_clamped_at_five_as_flow_grpo_clamps(per_prompt, global_std):
    """One success among 32 samples (a sparse reward) lies more than 5 stds above the mean with global_std or
    batch-wide statistics; Flow-GRPO clamps it to adv_clip_max = 5. Catches the clamp missing."""
    prompts = ["a"] * 16 + ["b"] * 16
    rewards = torch.zeros(32)
    rewards[3] = 1.0
    theirs, _ = flow_grpo_train_sd3_advantages(prompts, rewards, per_prompt, global_std)
    ours = grpo.batch_advantages(rewards, prompts, global_std=global_std, per_prompt=per_prompt)
    torch.testing.assert_close(ours, theirs[:, 0].float(), rtol=1e-5, atol=1e-5)
    assert float(ours[3]) == 5.0 and float(grpo.batch_advantages(rewards, prompts, global_std=global_std,
                                                                  per_prompt=per_prompt, clip=None)[3]) > 5


def test_collapsed_groups_are_flow_grpos_dropped_samples_and_the_floor_tames_near_collapse():
    """min_std 0 drops exactly the samples Flow-GRPO's mask drops (a prompt whose rewards are all equal); a threshold
    also drops the near-collapsed prompt, and a std floor keeps its advantages at the scale of its spread instead of
    normalising noise to unit size. Catches: the mask inverted, computed per group instead of per prompt, the floor
    applied to every prompt (it must leave prompts with a real spread unchanged)."""
    prompts, rewards = _batch(4)
    _, keep = flow_grpo_train_sd3_advantages(prompts, rewards, True, False)
    dropped = grpo.collapsed_prompts(rewards, prompts, min_std=0.0)
    assert torch.equal(~dropped, keep) and dropped.sum() == 4
    assert all(p == "grey" for p, d in zip(prompts, dropped) if d)
    guarded = grpo.collapsed_prompts(rewards, prompts, min_std=0.05)
    assert {p for p, d in zip(prompts, guarded) if d} == {"grey", "cat"}

    cat = torch.tensor([p == "cat" for p in prompts])
    plain = grpo.batch_advantages(rewards, prompts, clip=None)
    floored = grpo.batch_advantages(rewards, prompts, std_floor=0.1, clip=None)
    assert float(plain[cat].abs().max()) > 0.8  # noise of std 0.007 normalised to unit advantages
    assert float(floored[cat].abs().max()) < 0.2  # the floor keeps it at its real scale
    torch.testing.assert_close(floored[~cat], plain[~cat])  # prompts with a real spread (> 0.1) are untouched


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(ValueError, match="prompt keys for 3 rewards"):
        grpo.batch_advantages(torch.zeros(3), ["a", "b"])
    with pytest.raises(ValueError, match="prompt_keys"):
        grpo.batch_advantages(torch.zeros(3))
    with pytest.raises(ValueError, match="std_floor -1"):
        grpo.batch_advantages(torch.zeros(3), [0, 0, 0], std_floor=-1)
