"""A trained pack's metrics (infra/step_metrics.count_pack, called by Trainer.train_pack), pinned to values
computed by hand from the pairs' log-probs: the pack's statistics weighted by its real pairs, the split by kind
(fresh, later, stale) over the real pairs of that kind only, and a pack of padding adding nothing."""
import math

import torch

import grpo
from infra.step_metrics import MetricSums, count_pack

CLIP = 0.1


def _pack():
    """Five pairs: four real (fresh, stale, fresh, later) and one padding pair (weight 0) marked fresh."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -1.2, -0.3])
    old = torch.tensor([-1.05, -0.8, -2.0, -1.1, -3.0])  # pair 1 (stale) and the padding pair lie outside the clip
    advantages = torch.tensor([1.0, -0.5, 0.3, 2.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    weights = mask / 40  # 1/(N T_train), padding 0
    kinds = ["fresh", "stale", "fresh", "later", "fresh"]
    return logp, old, advantages, mask, weights, kinds


def test_a_packs_metrics_are_its_real_pairs_split_by_kind():
    """Catches the padding pair counted in its kind (pairs_fresh 3, its ratio e^2.7 the fresh maximum), kinds
    mixed up, a kind's statistics not weighted by its pair count, and the pack's means not by its real pairs."""
    logp, old, advantages, mask, weights, kinds = _pack()
    loss, stats = grpo.policy_loss(logp, old, advantages, CLIP, weights)
    m = MetricSums()
    count_pack(m, loss.detach(), stats, mask, weights, kinds, logprob_gap=torch.tensor(0.75),
               stats_of=lambda w: grpo.policy_loss(logp, old, advantages, CLIP, w)[1])
    ratio = [math.exp(a - b) for a, b in zip(logp.tolist(), old.tolist())]
    s = m.sums
    assert s["pairs"] == 4 and s["loss"] == float(loss) and s["logprob_gap"] == 0.75
    assert math.isclose(s["ratio_mean"], sum(ratio[:4]), rel_tol=1e-6)  # a mean over 4 real pairs, times 4
    assert math.isclose(s["approx_kl"], sum(0.5 * (a - b) ** 2 for a, b in zip(logp[:4], old[:4])), rel_tol=1e-6)
    assert s["clipfrac"] == 1.0  # pair 1 alone: the padding pair's ratio (e^2.7) is not counted
    assert (s["pairs_fresh"], s["pairs_stale"], s["pairs_later"]) == (2, 1, 1)
    assert math.isclose(s["ratio_mean_fresh"], ratio[0] + ratio[2], rel_tol=1e-6)
    assert math.isclose(s["ratio_mean_stale"], ratio[1], rel_tol=1e-6)
    assert math.isclose(s["ratio_mean_later"], ratio[3], rel_tol=1e-6)
    assert (s["clipfrac_fresh"], s["clipfrac_stale"], s["clipfrac_later"]) == (0.0, 1.0, 0.0)
    assert math.isclose(m.mins["ratio_min_fresh"], min(ratio[0], ratio[2]), rel_tol=1e-6)
    assert math.isclose(m.maxs["ratio_max_fresh"], max(ratio[0], ratio[2]), rel_tol=1e-6)
    assert math.isclose(m.mins["ratio_min"], min(ratio[:4]), rel_tol=1e-6)
    assert math.isclose(m.maxs["ratio_max"], max(ratio[:4]), rel_tol=1e-6)


def test_a_pack_of_padding_adds_nothing():
    """Catches a padding-only pack (TSP fills a trainer's last pack with weight-0 pairs) counted as pairs or
    moving the ratio extremes."""
    logp, old, advantages, _, _, kinds = _pack()
    nothing = torch.zeros(5)
    loss, stats = grpo.policy_loss(logp, old, advantages, CLIP, nothing)
    m = MetricSums()
    count_pack(m, loss, stats, nothing, nothing, kinds, logprob_gap=torch.tensor(0.0),
               stats_of=lambda w: grpo.policy_loss(logp, old, advantages, CLIP, w)[1])
    assert (m.sums, m.mins, m.maxs) == ({}, {}, {})
