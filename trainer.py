"""Trainer: what a trainer is. Loss over (sample, timestep) pairs, gradient accumulation, clipping,
AdamW, one step per batch; checkpoints; FSDP2 sharding.

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
from torch.distributed.tensor import Shard

import async_policy
import gap
import grpo
import models
from flowgrpo import ema as ema_lib
from infra import checkpoint_file, step_metrics
from infra.checkpoint_file import Deferred
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
            raise ValueError("fp32 masters were left to trainer.shard_for_fsdp "
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
                yield whole_tensor(p)
            self._bump()

    def evaluation_weights(self) -> ContextManager:
        """The weights evaluation uses: the EMA's (--ema) swapped in for the block, else the trained
        ones."""
        return (self.ema.swapped_in(self.params) if self.ema is not None
                else contextlib.nullcontext())

    # --- checkpoints: streamed tensor by tensor (infra/checkpoint_file.py) -----------------------
    def checkpoint_skeleton(self) -> dict:
        """The checkpoint's structure, the same sharded or not: {"weights": name -> tensor,
        "optimizer": the state dict, "bad_steps_in_a_row", "updates_total"[, "ema": name ->
        tensor]},
        with a checkpoint_file.Deferred (shape, dtype, and this rank's tensor or FSDP shard as its
        source) in place of every weight, AdamW moment and EMA shadow; scalars (AdamW's step) as CPU
        tensors. `produce` makes each Deferred whole, in checkpoint_file.deferred_order."""
        def deferred(t: torch.Tensor):
            return Deferred(t.shape, t.dtype, t) if t.ndim else t.detach().to("cpu")

        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {i: {k: deferred(v) for k, v in entry.items()}
                              for i, entry in optimizer["state"].items()}
        state = {"weights": {name: deferred(p) for name, p in zip(self.names, self.params)},
                 "optimizer": optimizer, "bad_steps_in_a_row": self.bad_steps_in_a_row,
                 "updates_total": self.updates_total}
        if self.ema is not None:
            state["ema"] = {name: deferred(t) for name, t in zip(self.names, self.ema.shadow)}
        return state

    def produce(self, tensor: Deferred, keep: bool = True) -> torch.Tensor | None:
        """One Deferred of checkpoint_skeleton whole on the CPU. Under FSDP it is gathered now (a
        collective): every trainer produces the same ones in the same order, and only the leader,
        which writes the file, keeps each (`keep`) for as long as it writes it."""
        with torch.no_grad():
            whole = whole_tensor(tensor.source)
            whole = whole.to("cpu") if keep else None
        self._bump()
        return whole

    def checkpoint_state(self, keep: bool = True) -> dict | None:
        """The whole checkpoint in memory: checkpoint_skeleton with every tensor produced (whole, on
        the CPU) and kept where `keep`; other ranks take part in the gathers and keep nothing. The
        reference the streamed file is checked against (tests); a run writes it streamed
        (infra/bookkeeping.py), never holding it all."""
        state = self.checkpoint_skeleton()
        produced = {}
        for tensor in checkpoint_file.deferred_order(state):
            whole = self.produce(tensor, keep)
            if keep:
                produced[id(tensor)] = whole
            del whole
        return checkpoint_file.filled(state, produced) if keep else None

    def load_checkpoint_state(self, state: dict) -> None:
        """Inverse of checkpoint_state; re-shards whole tensors onto this rank's FSDP shards when
        sharded."""
        with torch.no_grad():
            for name, p in zip(self.names, self.params):  # read from the memory-mapped file here
                p.copy_(_like(state["weights"][name], p))
                self._bump()
        optimizer = dict(state["optimizer"])
        optimizer["state"] = {i: {k: self._placed(v, self.params[i]) for k, v in s.items()}
                              for i, s in optimizer["state"].items()}
        self.optimizer.load_state_dict(optimizer)
        # --max-bad-steps counts across a resume
        self.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)
        self.updates_total = state.get("updates_total", 0)
        # a checkpoint without an EMA (--ema turned on at resume) starts it here
        if self.ema is not None:
            with torch.no_grad():
                for name, shadow, p in zip(self.names, self.ema.shadow, self.params):
                    shadow.copy_(_like(state["ema"][name], p) if "ema" in state else p.detach())

    def _placed(self, value: torch.Tensor, param) -> torch.Tensor:
        """An optimizer state tensor placed like `param` (a scalar stays), a unit of progress."""
        if not value.ndim:
            return value
        placed = _like(value, param)
        self._bump()
        return placed

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
        real = float(mask_t.sum())
        if real == 0:
            return
        m = self.metrics
        m.add("loss", loss.detach())
        m.add("pairs", real)
        for k in ("approx_kl", "clipfrac", "ratio_mean") + (("kl",) if "kl" in stats else ()):
            m.add(k, stats[k] * real)
        m.low("ratio_min", stats["ratio_min"])
        m.high("ratio_max", stats["ratio_max"])
        old = async_policy.behaviour_log_prob(logp, batch["old_log_prob"], recorded)
        for kind in sorted(set(kinds)):
            of_kind = weights * torch.tensor([k == kind for k in kinds], device=dev)  # [p]
            count = float((of_kind > 0).sum())
            if count == 0:
                continue
            _, part = grpo.policy_loss(logp, old, batch["advantages"].to(dev), self.cfg.clip_range,
                                       of_kind)
            m.add(f"pairs_{kind}", count)
            m.add(f"ratio_mean_{kind}", part["ratio_mean"] * count)
            # pairs the clip discards (TCSS's cost)
            m.add(f"clipfrac_{kind}", part["clipfrac"] * count)
            m.low(f"ratio_min_{kind}", part["ratio_min"])
            m.high(f"ratio_max_{kind}", part["ratio_max"])
        logprob_gap = ((logp - batch["old_log_prob"].to(dev)).abs() * mask_t).sum()
        # |trainer log-prob - rollout log-prob|: numerics, or staleness
        m.add("logprob_gap", logprob_gap)

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


def _is_sharded(t) -> bool:
    return hasattr(t, "full_tensor")  # a DTensor (FSDP2 parameter or optimizer state)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank of its mesh calls it), else `t`.

    Gathered with the all_gather_into_tensor FSDP2 itself runs, not DTensor.full_tensor(): on an
    H200 with the compute plane on gloo and CUDA tensors (tools/gpu_session.sh part a, torch 2.11,
    2026-12-04) full_tensor's functional all-gather segfaulted on both trainers at the first
    publish, after FSDP2's own gathers had run the training. Shard(0) follows torch.chunk: rank i
    holds rows [i c, (i + 1) c) of n, c = ceil(n / W), the last ones short or empty, so the padded
    blocks' first n rows are the tensor."""
    if not _is_sharded(t):
        return t.detach()
    if t.ndim == 0 or tuple(t.placements) != (Shard(0),):
        return t.full_tensor()  # not FSDP2's layout: left to DTensor
    local = t.to_local().detach()
    group = t.device_mesh.get_group()
    rows = -(-t.shape[0] // dist.get_world_size(group))  # c = ceil(n / W)
    block = local.new_zeros((rows, *t.shape[1:]))  # [c, ...]
    block[:local.shape[0]] = local
    gathered = local.new_empty((rows * dist.get_world_size(group), *t.shape[1:]))  # [W c, ...]
    dist.all_gather_into_tensor(gathered, block, group=group)
    return gathered[:t.shape[0]]  # [n, ...]


def _like(whole: torch.Tensor, param) -> torch.Tensor:
    """`whole` placed like `param`: the local FSDP shard of it, or a plain tensor on param's
    device."""
    if _is_sharded(param):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh,
                                 param.placements)
    return whole.to(param.device, param.dtype)


def shard_for_fsdp(policy, compute_group, keep_reference: bool) -> None:
    """FSDP2 over the trainers' compute group: each transformer block is a unit (gathered only while
    it runs), then the root. With `keep_reference` (full fine-tuning with a KL term) the reference,
    the initial weights in the policy dtype, is sharded the same way: built on the meta device, each
    unit filled from the policy's still-whole unit and sharded at once, so no trainer ever holds
    more than one unit of it whole. The caller must not keep references to the policy's parameters
    from before this call: FSDP2 frees a parameter's whole storage only when nothing else holds it
    (main.py collects its lists afterwards)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # a DeviceMesh may be passed in (tools/estimate_memory.py builds it outside FakeTensorMode)
    mesh = (compute_group if isinstance(compute_group, DeviceMesh)
            else DeviceMesh.from_group(compute_group, policy.device.type))
    # bf16 base + fp32 LoRA: gather and compute in the policy dtype, reduce gradients in fp32.
    mp = MixedPrecisionPolicy(param_dtype=policy.dtype, reduce_dtype=torch.float32)
    transformer = policy.transformer
    reference = (models.frozen_copy(transformer, policy.dtype, on_meta=True) if keep_reference
                 else None)
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
        # reshard after forward even at the root: the reference never runs a backward, which is
        # what would reshard a root FSDP2 leaves gathered after its forward (its default for the
        # root)
        fully_shard(reference, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        policy.reference_transformer = reference
    fully_shard(transformer, mesh=mesh, mp_policy=mp)
    if getattr(policy, "masters_pending", False):  # fp32 masters of the shards only
        models.make_fp32_masters(transformer)
        policy.masters_pending = False
    for module in transformer.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # sum, not mean: pairs already carry 1/(N T_train)
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has no PREMUL_SUM
            module.set_force_sum_reduction_for_comms(True)
