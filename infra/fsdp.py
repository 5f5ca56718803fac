"""FSDP2 on the trainers: the transformer sharded over the compute group (shard_for_fsdp), and its shards
made whole again (whole_tensor: publishing the weights, writing a checkpoint) or a whole tensor placed back
on a shard (placed_like: resuming).

    shard_for_fsdp(policy, compute_group, keep_reference=cfg.beta > 0 and not cfg.lora)  # main.py, once
    for p in trainer.params:
        whole = whole_tensor(p)  # a collective: every trainer calls it, in the same order

Unsharded (one trainer, or no --fsdp) each is the plain tensor, so the trainer and the checkpoint code take
the same path either way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import models


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


def is_sharded(t) -> bool:
    return hasattr(t, "full_tensor")  # a DTensor (FSDP2 parameter or optimizer state)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank of its mesh calls it), else `t`.

    Gathered with the all_gather_into_tensor FSDP2 itself runs, not DTensor.full_tensor(): on an
    H200 with the compute plane on gloo and CUDA tensors (tools/gpu_session.sh part a, torch 2.11,
    2026-12-04) full_tensor's functional all-gather segfaulted on both trainers at the first
    publish, after FSDP2's own gathers had run the training. Shard(0) follows torch.chunk: rank i
    holds rows [i c, (i + 1) c) of n, c = ceil(n / W), the last ones short or empty, so the padded
    blocks' first n rows are the tensor."""
    if not is_sharded(t):
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


def placed_like(whole: torch.Tensor, param) -> torch.Tensor:
    """`whole` placed like `param`: the local FSDP shard of it, or a plain tensor on param's
    device."""
    if is_sharded(param):
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(whole.to(param.device, param.dtype), param.device_mesh,
                                 param.placements)
    return whole.to(param.device, param.dtype)
