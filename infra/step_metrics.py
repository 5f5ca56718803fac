"""A training step's metrics: sums, minima and maxima over the step's packs and fragments, reduced
over the trainers' data group in one collective per kind, then summarised (trainer.Trainer.step)."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist


class MetricSums:
    """Per-step metric accumulators, reduced across a process group in one collective per kind."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}

    def add(self, name: str, value) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value)

    def low(self, name: str, value) -> None:
        self.mins[name] = min(self.mins.get(name, math.inf), float(value))

    def high(self, name: str, value) -> None:
        self.maxs[name] = max(self.maxs.get(name, -math.inf), float(value))

    def reduce(self, group, names: tuple[list[str], list[str], list[str]] | None = None,
               on_done: Callable[[], None] = lambda: None) -> None:
        """Sum/min/max over `group`; every rank must hold the same key sets (pass `names` to force
        them). `on_done()` after each of the six collectives (a unit of progress)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        for store, op, empty in ((self.sums, dist.ReduceOp.SUM, 0.0),
                                 (self.mins, dist.ReduceOp.MIN, math.inf),
                                 (self.maxs, dist.ReduceOp.MAX, -math.inf)):
            keys = sorted(store)
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, keys, group=group)
            on_done()
            keys = sorted(set().union(*gathered))
            values = torch.tensor([store.get(k, empty) for k in keys], dtype=torch.float64)
            dist.all_reduce(values, op=op, group=group)
            on_done()
            store.clear()
            store.update(zip(keys, values.tolist()))


def summarize(m: MetricSums, reward_names: list[str]) -> dict[str, float]:
    s = m.sums
    pairs, traj = max(s.get("pairs", 0.0), 1.0), max(s.get("trajectories", 0.0), 1.0)
    out = {"loss": s.get("loss", 0.0)}
    for k in ("approx_kl", "clipfrac", "ratio_mean", "kl"):
        if k in s:
            out[k] = s[k] / pairs
    out["logprob_gap"] = s.get("logprob_gap", 0.0) / pairs
    out["ratio_min"], out["ratio_max"] = m.mins.get("ratio_min", 1.0), m.maxs.get("ratio_max", 1.0)
    out["update_kl"] = s.get("update_kl_sum", 0.0) / max(s.get("update_kl_pairs", 0.0), 1.0)
    for kind in ("fresh", "later", "stale"):
        if s.get(f"pairs_{kind}", 0) > 0:
            out[f"ratio_mean_{kind}"] = s[f"ratio_mean_{kind}"] / s[f"pairs_{kind}"]
            out[f"clipfrac_{kind}"] = s.get(f"clipfrac_{kind}", 0.0) / s[f"pairs_{kind}"]
            out[f"ratio_min_{kind}"] = m.mins[f"ratio_min_{kind}"]
            out[f"ratio_max_{kind}"] = m.maxs[f"ratio_max_{kind}"]
    mean = s.get("reward_sum", 0.0) / traj
    out["reward_mean"] = mean
    out["reward_std"] = max(s.get("reward_sq", 0.0) / traj - mean**2, 0.0) ** 0.5
    for name in reward_names:
        mu = s.get(f"reward_{name}_sum", 0.0) / traj
        out[f"reward_{name}_mean"] = mu
        out[f"reward_{name}_std"] = max(s.get(f"reward_{name}_sq", 0.0) / traj - mu**2, 0.0) ** 0.5
    out["collapsed_group_frac"] = s.get("collapsed_groups", 0.0) / max(s.get("groups", 0.0), 1.0)
    out["stale_frac"] = s.get("stale_trajectories", 0.0) / traj
    out["staleness_mean"] = s.get("staleness_sum", 0.0) / traj
    out["stale_fragments"] = s.get("stale_fragments", 0.0)
    out["tag_fragments"] = s.get("tag_fragments", 0.0)
    out["trajectories"] = s.get("trajectories", 0.0)
    out["pairs"] = s.get("pairs", 0.0)
    return out


def count_pack(m: MetricSums, loss: torch.Tensor, stats: dict, mask: torch.Tensor,
               weights: torch.Tensor, kinds: list[str], logprob_gap: torch.Tensor,
               stats_of: Callable[[torch.Tensor], dict]) -> None:
    """A trained pack's loss statistics into `m` (trainer.Trainer.train_pack), weighted by its real
    pairs (`mask` [p], padding 0; a pack of padding only adds nothing), and split by the pairs'
    kinds (fresh, later, stale: Trainer.kind_of): `stats_of(w)` is grpo.policy_loss's stats over
    the pairs of loss weights `w` [p]. `logprob_gap`: the pack's summed |trainer log-prob - rollout
    log-prob| (numerics, or staleness)."""
    real = float(mask.sum())
    if real == 0:
        return
    m.add("loss", loss)
    m.add("pairs", real)
    for k in ("approx_kl", "clipfrac", "ratio_mean") + (("kl",) if "kl" in stats else ()):
        m.add(k, stats[k] * real)
    m.low("ratio_min", stats["ratio_min"])
    m.high("ratio_max", stats["ratio_max"])
    for kind in sorted(set(kinds)):
        of_kind = weights * torch.tensor([k == kind for k in kinds], device=weights.device)  # [p]
        count = float((of_kind > 0).sum())
        if count == 0:
            continue
        part = stats_of(of_kind)
        m.add(f"pairs_{kind}", count)
        m.add(f"ratio_mean_{kind}", part["ratio_mean"] * count)
        # pairs the clip discards (TCSS's cost)
        m.add(f"clipfrac_{kind}", part["clipfrac"] * count)
        m.low(f"ratio_min_{kind}", part["ratio_min"])
        m.high(f"ratio_max_{kind}", part["ratio_max"])
    m.add("logprob_gap", logprob_gap)


def count_fragment(m: MetricSums, fragment, version: int, reward_names: list[str],
                   collapsed_std: float) -> None:
    """Reward and staleness metrics of a fragment into `m`, against the trainer's weights `version`
    (call on exactly one trainer per fragment). A trainer-assisted (TAG) fragment has a negative
    producer (fragment.Fragment)."""
    n = fragment.num_samples
    staleness = version - fragment.policy_version
    m.add("trajectories", n)
    m.add("stale_trajectories", n * (staleness > 0))
    m.add("staleness_sum", n * staleness)
    # the parts of a fragment split between two updates count once
    whole = int(fragment.opens_fragment)
    m.add("fragments", whole)
    m.add("stale_fragments", whole * int(staleness > 0))
    m.add("tag_fragments", whole * int(fragment.producer < 0))
    r = fragment.rewards.to(torch.float64)
    m.add("reward_sum", r.sum()); m.add("reward_sq", (r**2).sum())  # noqa: E702
    for i, name in enumerate(reward_names):
        part = fragment.reward_parts[:, i].to(torch.float64)
        m.add(f"reward_{name}_sum", part.sum())
        m.add(f"reward_{name}_sq", (part**2).sum())
    groups = r.reshape(-1, fragment.group_size)
    m.add("groups", groups.shape[0])
    # the guard's own rule (grpo.advantages, --collapsed-std; float64, so equal rewards give 0)
    collapsed = groups.std(dim=1, unbiased=False) <= collapsed_std
    m.add("collapsed_groups", collapsed.sum())
