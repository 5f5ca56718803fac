"""Trainer: what a trainer is. Loss over (sample, timestep) pairs, gradient accumulation, clipping, AdamW,
one step per batch; checkpoints; FSDP2 sharding.

Every pair carries weight 1/(N T_train) (gap.pair_weights, docs/DESIGN.md section 3), so whichever rank
trains whichever pair, in whatever packing and order, the summed gradient is the full-batch mean's
gradient; a stale pair's PPO ratio is against its recorded log-prob (tcss.behaviour_log_prob). Which
fragments reach this rank and which of their pairs it trains is decided by the mechanisms main.py plugs
in (gap.trainer_loop, tsp.lockstep_fragments / gap.dealt_fragments, tag.Assistant); this file trains.
Gradients are summed on the compute plane (comm.py: device tensors, main thread); metrics go over
the trainers' data group (gloo, CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from typing import ContextManager

import torch
import torch.distributed as dist

import gap
import grpo
import models
import tag
import tcss
from rollout import step_fn
from tsp import gather_pairs


@dataclasses.dataclass
class TrainConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    clip_range: float = 1e-2
    max_grad_norm: float = 1.0
    beta: float = 0.0  # KL weight against the reference policy
    noise_level: float = 0.7
    algo: str = "flow_grpo"
    max_bad_steps: int = 3
    optimizer: str = "adamw"  # or "sgd": plain gradient descent, the update is exactly -lr x gradient
    collapsed_std: float = 0.0  # a group whose rewards' std is <= this has collapsed (the metric)

    @staticmethod
    def of(cfg) -> "TrainConfig":
        """From the run's config.Config (Adam's eps stays at its default)."""
        return TrainConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, clip_range=cfg.clip_range,
                           max_grad_norm=cfg.max_grad_norm, beta=cfg.beta, noise_level=cfg.noise_level,
                           algo=cfg.algo, max_bad_steps=cfg.max_bad_steps, optimizer=cfg.optimizer,
                           collapsed_std=cfg.collapsed_std)


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

    def reduce(self, group, names: tuple[list[str], list[str], list[str]] | None = None) -> None:
        """Sum/min/max over `group`; every rank must hold the same key sets (pass `names` to force them)."""
        if group is None or dist.get_world_size(group) == 1:
            return
        for store, op, empty in ((self.sums, dist.ReduceOp.SUM, 0.0), (self.mins, dist.ReduceOp.MIN, math.inf),
                                 (self.maxs, dist.ReduceOp.MAX, -math.inf)):
            keys = sorted(store)
            gathered: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, keys, group=group)
            keys = sorted(set().union(*gathered))
            values = torch.tensor([store.get(k, empty) for k in keys], dtype=torch.float64)
            dist.all_reduce(values, op=op, group=group)
            store.clear()
            store.update(zip(keys, values.tolist()))


class Trainer:
    def __init__(self, policy, cfg: TrainConfig, compute_group=None, data_group=None, sharded: bool = False,
                 progress=None):
        """`progress` (infra.progress.Progress): bumped per pack and per gathered tensor, told which collective
        the trainer is in (liveness names it when the job is stuck)."""
        self.policy, self.cfg, self.sharded, self.progress = policy, cfg, sharded, progress
        self.compute_group, self.data_group = compute_group, data_group  # comm.py's two planes
        trainable = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in trainable], [p for _, p in trainable]
        if not self.params:
            raise ValueError("the transformer has no trainable parameters")
        if cfg.beta > 0:
            policy.freeze_reference()  # the KL reference is the weights as they are now (main.py: before resume)
        if cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.step_fn = step_fn(cfg.algo)
        self.version = 0  # the weights version this trainer holds (= optimizer steps taken)
        self.bad_steps_in_a_row = 0
        self.metrics = MetricSums()

    def current_version(self) -> int:
        return self.version

    def _inside(self, name: str):
        return self.progress.inside(name) if self.progress is not None else contextlib.nullcontext()

    def _bump(self) -> None:
        if self.progress is not None:
            self.progress.bump()

    # --- whole weights (FSDP shards are gathered: a collective, so every trainer calls these) ---------
    def iter_full_weights(self) -> Iterable[torch.Tensor]:
        """The trainable weights as whole tensors, in `self.params` order, gathered one at a time when
        sharded (a compute-plane collective: every trainer iterates, in the same order)."""
        for p in self.params:
            with torch.no_grad():
                yield p.full_tensor() if _is_sharded(p) else p.detach()

    def checkpoint_state(self, keep: bool = True) -> dict | None:
        """{"weights": name -> CPU tensor, "optimizer": state dict with whole CPU tensors}: the same format
        sharded or not. Gathered one tensor at a time; only a rank with `keep` (the leader, which writes
        the file) holds the result, so the others never hold more than one whole tensor beyond their shard."""
        weights, gathered = {}, self.iter_full_weights()
        for name in self.names:  # not zip/enumerate: their reused result tuple would keep the last tensor alive
            whole = next(gathered)
            if keep:
                weights[name] = whole.to("cpu")
            del whole
            self._bump()
        optimizer = self.optimizer.state_dict()
        state = {}
        for i, entry in optimizer["state"].items():
            state[i] = {}
            for k, v in entry.items():
                whole = v.full_tensor() if _is_sharded(v) else v
                if keep:
                    state[i][k] = whole.to("cpu")
                del whole
                self._bump()
        if not keep:
            return None
        optimizer["state"] = state
        return {"weights": weights, "optimizer": optimizer, "bad_steps_in_a_row": self.bad_steps_in_a_row}

    def load_checkpoint_state(self, state: dict) -> None:
        """Inverse of checkpoint_state; re-shards whole tensors onto this rank's FSDP shards when sharded."""
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                p.copy_(_like(state["weights"][name], p))
        optimizer = dict(state["optimizer"])
        optimizer["state"] = {i: {k: (_like(v, self.params[i]) if v.ndim else v) for k, v in s.items()}
                              for i, s in optimizer["state"].items()}
        self.optimizer.load_state_dict(optimizer)
        self.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)  # --max-bad-steps counts across a resume

    # --- one pack of pairs -------------------------------------------------------------------
    def pair_loss(self, batch, weights: torch.Tensor, stale: bool):
        """Loss of packed pairs (per-sample timesteps in one forward), weighted; returns (loss, stats, logp)."""
        policy = self.policy
        v = policy.velocity(batch["latents"], batch["sigma"], batch["cond"])  # [p, ...] float32
        _, logp, mean, std = self.step_fn(v, batch["latents"], batch["sigma"], batch["sigma_next"],
                                          self.cfg.noise_level, prev_sample=batch["next_latents"])
        old = tcss.behaviour_log_prob(logp, batch["old_log_prob"], stale)  # TCSS's stale-pair rule
        adv = batch["advantages"].to(logp.device)
        loss, stats = grpo.policy_loss(logp, old, adv, self.cfg.clip_range, weights)
        if self.cfg.beta > 0:
            with torch.no_grad(), policy.reference() as ref:
                v_ref = policy.velocity(batch["latents"], batch["sigma"], batch["cond"], transformer=ref)
                _, _, ref_mean, _ = self.step_fn(v_ref, batch["latents"], batch["sigma"], batch["sigma_next"],
                                                 self.cfg.noise_level, prev_sample=batch["next_latents"])
            kl = grpo.kl_loss(mean, ref_mean, std)  # [p]
            loss = loss + self.cfg.beta * (kl * weights).sum()
            stats["kl"] = (kl.detach() * (weights > 0)).sum() / (weights > 0).sum().clamp(min=1)
        return loss, stats, logp.detach()

    def accumulate(self, fragment, packs, masks, total_pairs: int) -> None:
        """Forward+backward over this rank's packs of a fragment; gradients add into .grad."""
        stale = tcss.check_staleness(self.version, fragment.policy_version, tcss_on=True) == 1
        kind = "stale" if stale else "fresh"
        for pack, mask in zip(packs, masks):
            batch = gather_pairs(fragment, pack)
            mask_t = torch.tensor(mask, dtype=torch.float32, device=self.policy.device)  # [p]
            weights = gap.pair_weights(mask_t, total_pairs)  # 1/(N T_train) per real pair, 0 for padding
            loss, stats, logp = self.pair_loss(batch, weights, stale)
            loss.backward()
            self._bump()
            real = float(mask_t.sum())
            if real == 0:
                continue
            m = self.metrics
            m.add("loss", loss.detach())
            m.add("pairs", real)
            m.add(f"pairs_{kind}", real)
            for k in ("approx_kl", "clipfrac", "ratio_mean") + (("kl",) if "kl" in stats else ()):
                m.add(k, stats[k] * real)
            m.add(f"ratio_mean_{kind}", stats["ratio_mean"] * real)
            m.add(f"clipfrac_{kind}", stats["clipfrac"] * real)  # stale pairs the clip discards (TCSS's cost)
            m.low("ratio_min", stats["ratio_min"]); m.high("ratio_max", stats["ratio_max"])  # noqa: E702
            m.low(f"ratio_min_{kind}", stats["ratio_min"])
            m.high(f"ratio_max_{kind}", stats["ratio_max"])
            logprob_gap = ((logp - batch["old_log_prob"].to(logp.device)).abs() * mask_t).sum()
            m.add("logprob_gap", logprob_gap)  # |trainer log-prob - rollout log-prob|: numerics, or staleness

    def count_fragment(self, fragment, reward_names: list[str]) -> None:
        """Reward and staleness metrics of a fragment (call on exactly one trainer per fragment)."""
        m, n = self.metrics, fragment.num_samples
        staleness = self.version - fragment.policy_version
        m.add("trajectories", n)
        m.add("stale_trajectories", n * (staleness > 0))
        m.add("staleness_sum", n * staleness)
        m.add("fragments", 1)
        m.add("stale_fragments", int(staleness > 0))
        m.add("tag_fragments", int(fragment.producer == tag.TAG_PRODUCER))
        r = fragment.rewards.to(torch.float64)
        m.add("reward_sum", r.sum()); m.add("reward_sq", (r**2).sum())  # noqa: E702
        for i, name in enumerate(reward_names):
            part = fragment.reward_parts[:, i].to(torch.float64)
            m.add(f"reward_{name}_sum", part.sum()); m.add(f"reward_{name}_sq", (part**2).sum())  # noqa: E702
        groups = r.reshape(-1, fragment.group_size)
        m.add("groups", groups.shape[0])
        # the guard's own rule (grpo.advantages, --collapsed-std; float64, so equal rewards give 0)
        collapsed = groups.std(dim=1, unbiased=False) <= self.cfg.collapsed_std
        m.add("collapsed_groups", collapsed.sum())

    # --- the optimizer step --------------------------------------------------------------------
    def step(self, reward_names: list[str]) -> dict[str, float]:
        """Sum gradients over the trainers, clip the global norm, AdamW step; returns the step metrics."""
        self.all_reduce_gradients()
        with self._inside("grad-norm all-reduce"):
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)  # the global norm
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        with self._inside("metrics all-reduce"):
            self.metrics.reduce(self.data_group)
        finite = math.isfinite(grad_norm) and math.isfinite(self.metrics.sums.get("loss", 0.0))
        if finite:
            self.optimizer.step()
            self.bad_steps_in_a_row = 0
        else:  # skip: weights and optimizer state stay as they were
            self.bad_steps_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        out = summarize(self.metrics, reward_names)
        out.update(grad_norm=grad_norm, skipped_step=float(not finite),
                   bad_steps_in_a_row=float(self.bad_steps_in_a_row))
        self.metrics = MetricSums()
        if self.bad_steps_in_a_row >= self.cfg.max_bad_steps:
            raise FloatingPointError(f"{self.bad_steps_in_a_row} optimizer steps in a row had a non-finite loss or "
                                     f"gradient (--max-bad-steps {self.cfg.max_bad_steps}); aborting")
        return out


    def all_reduce_gradients(self) -> None:
        """Compute plane: one flat all-reduce (sum) of every gradient, on the policy device, main thread.
        Under FSDP the gradients are reduce-scattered during backward instead."""
        if self.sharded or self.compute_group is None or dist.get_world_size(self.compute_group) == 1:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])  # [total numel] on the policy device
        with self._inside("all-reduce"):
            dist.all_reduce(flat, group=self.compute_group)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()


def summarize(m: MetricSums, reward_names: list[str]) -> dict[str, float]:
    s = m.sums
    pairs, traj = max(s.get("pairs", 0.0), 1.0), max(s.get("trajectories", 0.0), 1.0)
    out = {"loss": s.get("loss", 0.0)}
    for k in ("approx_kl", "clipfrac", "ratio_mean", "kl"):
        if k in s:
            out[k] = s[k] / pairs
    out["logprob_gap"] = s.get("logprob_gap", 0.0) / pairs
    out["ratio_min"], out["ratio_max"] = m.mins.get("ratio_min", 1.0), m.maxs.get("ratio_max", 1.0)
    for kind in ("fresh", "stale"):
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


def _is_sharded(t) -> bool:
    return hasattr(t, "full_tensor")  # a DTensor (FSDP2 parameter or optimizer state)


def _like(whole: torch.Tensor, param) -> torch.Tensor:
    """`whole` placed like `param`: the local FSDP shard of it, or a plain tensor on param's device."""
    if _is_sharded(param):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh, param.placements)
    return whole.to(param.device, param.dtype)


# --- one fragment ---------------------------------------------------------------------------------------
def train_fragment(trainer: Trainer, fragment: gap.Fragment, *, pairs_of: Callable, total_pairs: int, count: bool,
                   tcss_on: bool, reward_names: list[str], tracer=None, on_trained: Callable | None = None,
                   pace: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
    """Train this rank's share of a fragment: pairs_of(m, T_train) -> (packs, masks) is TSP's share or the
    per-timestep loop. `count` on exactly one trainer per fragment (its rewards enter the metrics once).
    `tracer` (a "train" span) and `pace` (infra/emulate.py's benchmark emulation) hook in from outside."""
    tcss.check_staleness(trainer.version, fragment.policy_version, tcss_on)  # the TCSS bound
    if count:
        trainer.count_fragment(fragment, reward_names)
    packs, masks = pairs_of(*fragment.latents.shape[:2])
    start = time.perf_counter()
    pairs = sum(int(sum(mask)) for mask in masks)  # real pairs (TSP padding excluded)
    slots = sum(len(mask) for mask in masks)  # what the passes cost: padding included
    span = tracer.span("train", step=fragment.step, first_group=fragment.first_group, pairs=pairs, slots=slots) \
        if tracer is not None else contextlib.nullcontext()
    with span, pace():
        trainer.accumulate(fragment.to(trainer.policy.device), packs, masks, total_pairs)
    if on_trained is not None:
        on_trained(fragment, time.perf_counter() - start)


def shard_for_fsdp(policy, compute_group, keep_reference: bool) -> None:
    """FSDP2 over the trainers' compute group: each transformer block is a unit (gathered only while it
    runs), then the root. With `keep_reference` (full fine-tuning with a KL term) the reference, the initial
    weights in the policy dtype, is sharded the same way: built on the meta device, each unit filled from the
    policy's still-whole unit and sharded at once, so no trainer ever holds more than one unit of it whole.
    The caller must not keep references to the policy's parameters from before this call: FSDP2 frees a
    parameter's whole storage only when nothing else holds it (main.py collects its lists afterwards)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # a DeviceMesh may be passed in (tools/estimate_memory.py builds it outside FakeTensorMode)
    mesh = compute_group if isinstance(compute_group, DeviceMesh) else DeviceMesh.from_group(compute_group,
                                                                                            policy.device.type)
    # bf16 base + fp32 LoRA: gather and compute in the policy dtype, reduce gradients in fp32.
    mp = MixedPrecisionPolicy(param_dtype=policy.dtype, reduce_dtype=torch.float32)
    transformer = policy.transformer
    reference = models.frozen_copy(transformer, policy.dtype, on_meta=True) if keep_reference else None
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.endswith("blocks"):
            for i, block in enumerate(module):
                if reference is not None:
                    unit = reference.get_submodule(f"{name}.{i}")
                    models.fill_from(unit, block, policy.dtype)
                    fully_shard(unit, mesh=mesh, mp_policy=mp)
                fully_shard(block, mesh=mesh, mp_policy=mp)
    if reference is not None:
        models.fill_from(reference, transformer, policy.dtype)  # what is outside the blocks
        # reshard after forward even at the root: the reference never runs a backward, which is what would
        # reshard a root FSDP2 leaves gathered after its forward (its default for the root)
        fully_shard(reference, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        policy.reference_transformer = reference
    fully_shard(transformer, mesh=mesh, mp_policy=mp)
    for module in transformer.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # sum, not mean: pairs already carry 1/(N T_train)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives: gloo has no PREMUL_SUM
