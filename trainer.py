"""Trainer: what a trainer is. Loss over (sample, timestep) pairs, gradient accumulation, the
gradient all-reduce, clipping, AdamW, Flow-GRPO's M updates per RL step. Beside it in infra/: the
step's metrics (step_metrics.py), the checkpoint state (checkpoint_state.py), FSDP2 sharding and
whole tensors from shards (fsdp.py).

Every pair carries weight 1/(N T_train) (gap.pair_weights, docs/DESIGN.md section 3), so whichever
rank trains whichever pair, in whatever packing and order, the summed gradient is the full-batch
mean's gradient; a stale pair's PPO ratio is against its recorded log-prob
(async_policy.behaviour_log_prob). Which fragments reach this rank and which of their pairs it
trains is decided by the trainer rank's loop (main.TrainerRank: gap.dealt_fragments,
tsp.lockstep_fragments, tag.Assistant); this file trains. Gradients are summed on the compute plane
(comm.py: device tensors, main thread); metrics (infra/step_metrics.py) go over the trainers' data
group (gloo, CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import ContextManager

import torch
import torch.distributed as dist

import async_policy
import gap
import grpo
from flowgrpo import ema as ema_lib
from infra import fsdp, step_metrics
from infra.step_metrics import MetricSums, summarize
from rollout import step_fn
from tsp import gather_pairs, gather_spanning


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
    # or "sgd": plain gradient descent, the update is exactly -lr x gradient
    optimizer: str = "adamw"
    collapsed_std: float = 0.0  # a group whose rewards' std is <= this has collapsed (the metric)
    ema: bool = False  # an EMA of the trained weights for evaluation (flowgrpo/ema.py)
    ema_decay: float = 0.9
    ema_every: int = 8
    # the training forward runs CFG as the rollout did (Flow-GRPO's train.cfg)
    train_cfg: bool = True
    # with train_cfg, the unconditional branch carries no gradient (Flow-GRPO's train_sd3.py)
    detach_uncond: bool = False
    # the KL term divides by 2 g^2 (Flow-GRPO's) or by 2 g^2 |dt| ("step"): grpo.kl_loss
    kl_scale: str = "diffusion"
    # whose log-prob a pair's ratio is against: "rollout" (every pair the rollout's recorded one,
    # Flow-GRPO's) or "fresh" (on-policy pairs of a step's first update against their own, ratio 1)
    old_log_prob: str = "rollout"
    ema_repeats: int = 1  # EMA applications per trigger (Flow-GRPO: one per sampled sub-batch)

    @staticmethod
    def of(cfg) -> "TrainConfig":
        """From the run's config.Config (Adam's eps stays at its default)."""
        return TrainConfig(
            lr=cfg.lr, weight_decay=cfg.weight_decay, clip_range=cfg.clip_range,
            max_grad_norm=cfg.max_grad_norm, beta=cfg.beta, noise_level=cfg.noise_level,
            algo=cfg.algo, max_bad_steps=cfg.max_bad_steps, optimizer=cfg.optimizer,
            collapsed_std=cfg.collapsed_std, ema=cfg.ema, ema_decay=cfg.ema_decay,
            ema_every=cfg.ema_every, train_cfg=cfg.train_cfg, detach_uncond=cfg.detach_uncond,
            kl_scale=cfg.kl_scale, old_log_prob=cfg.old_log_prob, ema_repeats=cfg.ema_repeats)


class Trainer:
    def __init__(self, policy, cfg: TrainConfig, compute_group=None, data_group=None,
                 sharded: bool = False, progress=None):
        """`progress` (infra.progress.Progress): bumped per pack and per gathered tensor, told which
        collective the trainer is in (liveness names it when the job is stuck)."""
        self.policy, self.cfg, self.sharded, self.progress = policy, cfg, sharded, progress
        self.compute_group, self.data_group = compute_group, data_group  # comm.py's two planes
        if getattr(policy, "masters_pending", False):
            raise ValueError("fp32 masters were left to infra.fsdp.shard_for_fsdp "
                             "(masters_after_sharding), but the transformer was not sharded")
        trainable = [(n, p) for n, p in policy.transformer.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in trainable], [p for _, p in trainable]
        if not self.params:
            raise ValueError("the transformer has no trainable parameters")
        if cfg.beta > 0:
            # the KL reference is the weights as they are now (main.py: before resume)
            policy.freeze_reference()
        if cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            # fused: one kernel for every tensor (CPU and CUDA; 0.35 vs 1.1 ms per update on the
            # tiny model)
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr,
                                               weight_decay=cfg.weight_decay, eps=cfg.adam_eps,
                                               fused=fused_adamw_ok(self.params))
        self.step_fn = step_fn(cfg.algo)
        self.version = 0  # the weights version this trainer holds (= RL steps taken, whatever M)
        self.updates_in_step = 0  # optimizer updates already taken in this RL step (0 .. M - 1)
        # the last pack trained since the last update, for update_kl
        self.probe: tuple | None = None
        self.nonfinite_loss = False  # a pack since the last update had a non-finite loss
        # this RL step's updates (global norms: the same on every trainer)
        self.grad_norms: list[float] = []
        self.bad_steps_in_a_row = 0
        self.updates_total = 0  # optimizer updates over the run (the EMA's u)
        self.ema = (ema_lib.Ema(self.params, cfg.ema_decay, cfg.ema_every, cfg.ema_repeats)
                    if cfg.ema else None)
        self.metrics = MetricSums()

    def current_version(self) -> int:
        return self.version

    def _inside(self, name: str):
        return self.progress.inside(name) if self.progress is not None else contextlib.nullcontext()

    def _bump(self) -> None:
        if self.progress is not None:
            self.progress.bump()

    # --- whole weights (FSDP shards are gathered: a collective, so every trainer calls these) -----
    def iter_full_weights(self) -> Iterable[torch.Tensor]:
        """The trainable weights as whole tensors, in `self.params` order, gathered one at a time
        when sharded (a compute-plane collective: every trainer iterates, in the same order). A
        unit of progress per tensor, once the consumer is done with it (publishing 24-41 GB of full
        weights over gloo takes minutes)."""
        for p in self.params:
            with torch.no_grad():
                yield fsdp.whole_tensor(p)
            self._bump()

    def evaluation_weights(self) -> ContextManager:
        """The weights evaluation uses: the EMA's (--ema) swapped in for the block, else the trained
        ones."""
        return (self.ema.swapped_in(self.params) if self.ema is not None
                else contextlib.nullcontext())

    # --- one pack of pairs -------------------------------------------------------------------
    def pair_loss(self, batch, weights: torch.Tensor, recorded: torch.Tensor | bool):
        """Loss of packed pairs (per-sample timesteps in one forward), weighted; returns (loss,
        stats, logp). `recorded` [p]: which pairs' ratio is against the rollout's log-prob
        (async_policy.behaviour_log_prob)."""
        policy = self.policy
        # [p, ...]
        v = policy.velocity(batch["latents"], batch["sigma"], batch["cond"], cfg=self.cfg.train_cfg,
                            detach_uncond=self.cfg.detach_uncond)
        _, logp, mean, std = self.step_fn(v, batch["latents"], batch["sigma"], batch["sigma_next"],
                                          self.cfg.noise_level, prev_sample=batch["next_latents"])
        # TCSS's stale-pair rule
        old = async_policy.behaviour_log_prob(logp, batch["old_log_prob"], recorded)
        adv = batch["advantages"].to(logp.device)
        loss, stats = grpo.policy_loss(logp, old, adv, self.cfg.clip_range, weights)
        if self.cfg.beta > 0:
            with torch.no_grad(), policy.reference() as ref:
                v_ref = policy.velocity(batch["latents"], batch["sigma"], batch["cond"],
                                        transformer=ref, cfg=self.cfg.train_cfg)
                _, _, ref_mean, _ = self.step_fn(v_ref, batch["latents"], batch["sigma"],
                                                 batch["sigma_next"], self.cfg.noise_level,
                                                 prev_sample=batch["next_latents"])
            scale = std if self.cfg.kl_scale == "step" else grpo.diffusion_coefficient(
                self.cfg.algo, batch["sigma"], batch["sigma_next"], self.cfg.noise_level, mean)
            kl = grpo.kl_loss(mean, ref_mean, scale)  # [p]
            loss = loss + self.cfg.beta * (kl * weights).sum()
            stats["kl"] = (kl.detach() * (weights > 0)).sum() / (weights > 0).sum().clamp(min=1)
        return loss, stats, logp.detach()

    def kind_of(self, fragment) -> str:
        """fresh, later or stale (the metrics' split). A pair is scored against its recorded
        log-prob when stale (TCSS), when this step already took an update ("later": minibatch
        j > 0, Flow-GRPO's off-policy inner updates), and, with old_log_prob "rollout" (Flow-GRPO's
        train_*.py: every ratio is exp(log_prob - sample["log_probs"])), when fresh too; with
        "fresh" a fresh pair is scored against its own detached log-prob (ratio exactly 1)."""
        stale = async_policy.check_staleness(self.version, fragment.policy_version,
                                             tcss_on=True) == 1
        return "stale" if stale else ("later" if self.updates_in_step else "fresh")

    def accumulate(self, fragment, packs, masks, total_pairs: int) -> None:
        """Forward+backward over this rank's packs of one fragment; gradients add into .grad."""
        kind = self.kind_of(fragment)
        for pack, mask in zip(packs, masks):
            self.train_pack(gather_pairs(fragment, pack), mask, [kind] * len(pack),
                            [total_pairs] * len(pack))

    def accumulate_spanning(self, packs, total_pairs: Callable) -> None:
        """The same over packs whose pairs come from several fragments (tsp.PackStream's (items,
        mask))."""
        for items, mask in packs:
            kinds = {id(f): self.kind_of(f) for f, _ in items}
            denominators = {id(f): total_pairs(f) for f, _ in items}
            self.train_pack(gather_spanning(items), mask, [kinds[id(f)] for f, _ in items],
                            [denominators[id(f)] for f, _ in items])

    def train_pack(self, batch, mask: list[float], kinds: list[str],
                   total_pairs: list[int]) -> None:
        """One forward+backward of packed pairs; each pair weighs 1/(N_j T_train), padding 0."""
        dev = self.policy.device
        mask_t = torch.tensor(mask, dtype=torch.float32, device=dev)  # [p]
        weights = gap.pair_weights(mask_t, torch.tensor(total_pairs, dtype=torch.float32,
                                                        device=dev))  # [p]
        rollout = self.cfg.old_log_prob == "rollout"
        recorded = torch.tensor([rollout or k != "fresh" for k in kinds], device=dev)  # [p]
        loss, stats, logp = self.pair_loss(batch, weights, recorded)
        loss.backward()
        self.probe = (batch, logp, mask_t)
        self._bump()
        self.nonfinite_loss |= not math.isfinite(float(loss.detach()))
        old = async_policy.behaviour_log_prob(logp, batch["old_log_prob"], recorded)
        adv = batch["advantages"].to(dev)
        step_metrics.count_pack(
            self.metrics, loss.detach(), stats, mask_t, weights, kinds,
            logprob_gap=((logp - batch["old_log_prob"].to(dev)).abs() * mask_t).sum(),
            stats_of=lambda w: grpo.policy_loss(logp, old, adv, self.cfg.clip_range, w)[1])

    def count_fragment(self, fragment, reward_names: list[str]) -> None:
        """Reward and staleness metrics of a fragment (call on exactly one trainer per fragment)."""
        step_metrics.count_fragment(self.metrics, fragment, self.version, reward_names,
                                    self.cfg.collapsed_std)

    # --- the optimizer updates: M per RL step, the last one ends the step -------------------------
    def update(self) -> float:
        """One update from the gradients accumulated since the last: sum over the trainers, clip the
        global norm, AdamW (skipped, weights untouched, when a loss or the gradient is not finite).
        Returns the global gradient norm before clipping. Each part done is a unit of progress (a
        24 GB all-reduce or a 20B-parameter AdamW step takes seconds)."""
        self.all_reduce_gradients()
        self._bump()
        with self._inside("grad-norm all-reduce"):
            # the global norm
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                              else grad_norm)
        self._bump()
        finite = self._losses_finite() and math.isfinite(grad_norm)  # the collective first, always
        self._bump()
        if finite:
            self.optimizer.step()
            self._bump()
        # else skip: weights and optimizer state stay as they were
        self.optimizer.zero_grad(set_to_none=True)
        self.updates_total += 1
        if self.ema is not None:
            self.ema.update(self.params, self.updates_total)
        self.updates_in_step += 1
        self.grad_norms.append(grad_norm if finite else math.nan)
        self._score_probe()
        return grad_norm

    def step(self, reward_names: list[str]) -> dict[str, float]:
        """The RL step's last update, then its metrics over every update and trainer; the version
        moves on."""
        grad_norm = self.update()
        with self._inside("metrics all-reduce"):
            self.metrics.reduce(self.data_group, on_done=self._bump)
        norms, self.grad_norms = self.grad_norms, []
        finite = [n for n in norms if math.isfinite(n)]
        # --max-bad-steps counts RL steps with a skipped update, whatever M
        self.bad_steps_in_a_row = self.bad_steps_in_a_row + 1 if len(finite) < len(norms) else 0
        if self.bad_steps_in_a_row >= self.cfg.max_bad_steps:
            raise FloatingPointError(f"{self.bad_steps_in_a_row} optimizer steps in a row had a "
                                     "non-finite loss or gradient "
                                     f"(--max-bad-steps {self.cfg.max_bad_steps}); aborting")
        out = summarize(self.metrics, reward_names)
        out.update(grad_norm=grad_norm, grad_norm_mean=sum(finite) / max(len(finite), 1),
                   updates=len(norms), skipped_step=float(len(finite) < len(norms)),
                   skipped_updates=len(norms) - len(finite),
                   bad_steps_in_a_row=float(self.bad_steps_in_a_row))
        self.version += 1
        self.updates_in_step = 0
        self.metrics = MetricSums()
        return out

    def _losses_finite(self) -> bool:
        """Every trainer's loss since the last update is finite: agreed over the data group, so all
        skip."""
        bad = torch.tensor([float(self.nonfinite_loss)], dtype=torch.float64)
        self.nonfinite_loss = False
        if self.data_group is not None and dist.get_world_size(self.data_group) > 1:
            with self._inside("loss-check all-reduce"):
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.data_group)
        return not bool(bad.item())

    def _score_probe(self) -> None:
        """update_kl: the approx KL, 0.5 (log p_after - log p_before)^2, between the weights before
        and after this update on the last pack trained: how far an update moved the policy on the
        batch's own pairs (a fresh pair's ratio is 1 by construction, so the loss stats cannot show
        it). One forward, no backward, on every trainer (the same count under FSDP: every trainer
        trained a pack)."""
        if self.probe is None:
            return
        batch, before, mask = self.probe
        self.probe = None
        with torch.no_grad():
            v = self.policy.velocity(batch["latents"], batch["sigma"], batch["cond"],
                                     cfg=self.cfg.train_cfg)  # [p, ...]
            _, after, _, _ = self.step_fn(v, batch["latents"], batch["sigma"], batch["sigma_next"],
                                          self.cfg.noise_level, prev_sample=batch["next_latents"])
            self.metrics.add("update_kl_sum", (0.5 * (after - before) ** 2 * mask).sum())
            self.metrics.add("update_kl_pairs", mask.sum())
        # FSDP2 leaves a root gathered after a forward without backward: free it, or a whole copy
        # stays alive
        if hasattr(self.policy.transformer, "reshard"):
            self.policy.transformer.reshard()

    def all_reduce_gradients(self) -> None:
        """Compute plane: one flat all-reduce (sum) of every gradient, on the policy device, main
        thread. Under FSDP the gradients are reduce-scattered during backward instead."""
        if (self.sharded or self.compute_group is None
                or dist.get_world_size(self.compute_group) == 1):
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])  # [total numel] on the policy device
        with self._inside("all-reduce"):
            dist.all_reduce(flat, group=self.compute_group)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()


def fused_adamw_ok(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW takes floating-point tensors on CPU or CUDA (FSDP2's DTensors included);
    it gives the for-each update to float rounding (tests/test_truth.py pins both to a hand-computed
    one)."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


