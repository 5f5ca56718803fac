"""FSDP2 shards made whole again (infra/fsdp.py whole_tensor: publishing, checkpoints), on 3 gloo ranks.

The gather runs FSDP2's own collective (all_gather_into_tensor), not DTensor.full_tensor(): full_tensor's
functional all-gather segfaulted on an H200 with gloo and CUDA tensors (tools/gpu_session.sh part a,
2026-12-04) while FSDP2's gathers ran. The values are pinned to the unsharded module (outside truth), with rows
that do not divide by the world size and a tensor with fewer rows than ranks (empty shards)."""
from __future__ import annotations

import torch

import dist_harness


def _gather_worker(rank, world, store):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from infra import fsdp

    torch.manual_seed(0)  # the same module on every rank
    module = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.Linear(7, 2), torch.nn.Linear(2, 1, bias=False))
    whole = {n: p.detach().clone() for n, p in module.named_parameters()}  # rows 7, 7, 2, 2, 1: uneven, < world
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fully_shard(module, mesh=mesh)

    def refuse(*args, **kwargs):
        raise AssertionError("DTensor.full_tensor() called: it segfaults with gloo and CUDA tensors")

    DTensor.full_tensor = refuse
    out = {}
    for name, p in module.named_parameters():
        assert isinstance(p, DTensor)
        gathered = fsdp.whole_tensor(p)
        out[name] = (torch.equal(gathered, whole[name]), tuple(gathered.shape), tuple(p.to_local().shape))
    dist.barrier()
    return out


def test_whole_tensor_is_the_unsharded_parameter_without_full_tensor():
    reports = dist_harness.check(dist_harness.run(_gather_worker, 3, timeout_s=120))
    for rank, rows in reports.items():
        for name, (equal, shape, local) in rows.items():
            assert equal, f"rank {rank}: {name} {shape} (local shard {local}) gathered wrong"
    shards = {name: [reports[r][name][2][0] for r in range(3)] for name in reports[0]}
    assert shards["2.weight"] == [1, 0, 0], shards  # 1 row over 3 ranks: two empty shards were gathered too
