"""Process groups and the two communication planes: the rules that make the GPU path the tested
path.

    groups = comm.build_groups(rank, world, "disaggregated", rollout_ranks=1)
    groups.compute      # trainers, default backend (NCCL on GPUs): gradients and FSDP2, main
                        # thread only
    groups.trainer_data # trainers, gloo: commands, fragment broadcast, TAG shares, metrics
    groups.publish      # trainer leader + rollout ranks, gloo: weights (received by a mailbox
                        # thread)
    groups.world_data   # every rank, gloo: fragments point to point, trace gathering, the last
                        # barrier

The rules (docs/DESIGN.md section 4; tests/test_comm_contract.py enforces them on CPU):
1. Data plane: everything that crosses between rollout and trainer, every control message, metric
   and trace, and anything a background thread touches, goes over an explicit gloo group with CPU
   tensors, whatever the default backend. Under NCCL, a blocking collective in a background thread
   makes the device's current stream wait for it: the weight mailbox would stall generation until
   the next publish, which needs that generation (a deadlock at the first publish). A CPU tensor on
   an NCCL group raises ("No backend type associated with device type cpu").
2. Compute plane: the trainer group's gradient all-reduce and FSDP2's collectives, on the default
   backend with tensors on the policy device, issued from the main thread only.
3. Each background thread has a group of its own (the fragment sender uses world_data only while the
   main thread does not; the mailbox only ever uses publish), so no two threads interleave
   collectives on one group.
4. No collective ever runs on the default (world) group: under NCCL its ranks may share a GPU.
5. Collectives have no deadline (`NO_DEADLINE`): a step may take many minutes. A dead or frozen rank
   is found by infra/liveness.py (heartbeats in the store) instead, within --timeout-s.

NCCL is the default backend when every compute-plane rank has a GPU of its own: the ranks exchange
the identity of the GPU each will use (its UUID) through the store, so 1 x 8, 2 x 8 and one visible
GPU per process (SLURM --gpus-per-task=1: device_count() is 1 everywhere) all give NCCL, and ranks
sharing a GPU gloo.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

# A collective waits as long as its peers are alive; liveness (not a deadline) ends a job whose rank
# died.
NO_DEADLINE = datetime.timedelta(days=7)
DATA_PLANE = "data"
COMPUTE_PLANE = "compute"


def choose_backend(use_cuda: bool, compute_devices: list[str],
                   requested: str = "auto") -> tuple[str, str]:
    """The default (compute-plane) backend and why: NCCL when every rank of the compute plane has a
    GPU of its own.

    `compute_devices`: one identity per compute-plane rank (trainers; every rank when colocated) of
    the GPU it will use (`device_identity`), gathered from all ranks. NCCL refuses two ranks on one
    GPU, so equal identities mean gloo. How many GPUs a process *sees* says nothing: SLURM
    `--gpus-per-task=1` or a Kubernetes pod shows each process one GPU (device_count() 1) although
    every rank has its own.
    `requested` "nccl" forces NCCL (e.g. two ranks on one GPU whose NCCL groups hold one rank
    each)."""
    if requested not in ("auto", "nccl", "gloo"):
        raise ValueError(f"--backend {requested!r} is not one of auto, nccl, gloo")
    if requested != "auto":
        if requested == "nccl" and not use_cuda:
            raise ValueError("--backend nccl needs CUDA (--device cuda); on CPU use gloo")
        return requested, f"--backend {requested}"
    if not use_cuda:
        return "gloo", "no CUDA device"
    shared = len(compute_devices) - len(set(compute_devices))
    if shared:
        return "gloo", (f"{len(compute_devices)} compute-plane ranks share "
                        f"{len(set(compute_devices))} GPU(s): "
                        "NCCL needs one GPU per rank (gloo with CUDA tensors is much slower)")
    return "nccl", f"each of the {len(compute_devices)} compute-plane ranks has a GPU of its own"


def device_identity(uuid: str | None, host: str, visible_devices: str | None, index: int) -> str:
    """Which physical GPU `cuda:index` of this process is: its UUID when the driver reports one,
    else the host and the index CUDA_VISIBLE_DEVICES maps it to (each process may see a different
    one as cuda:0)."""
    if uuid:
        return str(uuid)
    visible = [v.strip() for v in visible_devices.split(",")] if visible_devices else []
    return f"{host}:gpu{visible[index] if index < len(visible) else index}"


def this_device_identity(device) -> str:
    """device_identity of the CUDA device this process will use."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return device_identity(str(uuid) if uuid is not None else None, socket.gethostname(),
                           os.environ.get("CUDA_VISIBLE_DEVICES"), index)


def gather_device_identities(store, rank: int, world: int, mine: str) -> list[str]:
    """Every rank's device identity, through the store (before any process group exists)."""
    store.set(f"device/{rank}", mine)
    keys = [f"device/{r}" for r in range(world)]
    store.wait(keys, NO_DEADLINE)  # a late rank is liveness' to judge, not the store's timeout
    return [store.get(k).decode() for k in keys]


def gather_hosts(store, rank: int, world: int) -> list[str]:
    """Every rank's host name, through the store (before any process group exists): which ranks
    share a host is what the ranks say, not what a launcher's variables imply (LOCAL_WORLD_SIZE is
    per node under torchrun and unset under srun)."""
    store.set(f"host/{rank}", socket.gethostname())
    keys = [f"host/{r}" for r in range(world)]
    store.wait(keys, NO_DEADLINE)  # as above
    return [store.get(k).decode() for k in keys]


def loopback_data_plane(env, hosts: list[str], resolve=socket.gethostbyname,
                        hostname=socket.gethostname) -> str | None:
    """A warning when gloo (the data plane) would bind a loopback address on this host while the
    job spans several hosts (`hosts`: every rank's host name, gather_hosts).

    Without GLOO_SOCKET_IFNAME, gloo binds the address this host's name resolves to, and stock
    Ubuntu maps the hostname to 127.0.1.1 in /etc/hosts: peers on other hosts are then told to
    connect to a loopback address and the first cross-host send never arrives. (NCCL picks its own
    interface; NCCL_SOCKET_IFNAME pins it.) Several "nodes" on one host (torchrun --nnodes 2 on
    localhost) reach each other through loopback: no warning."""
    if len(set(hosts)) <= 1 or env.get("GLOO_SOCKET_IFNAME"):
        return None  # one host, or the interface is pinned
    world, name = len(hosts), hostname()
    try:
        address = resolve(name)
    except OSError as error:
        return (f"the hostname {name!r} does not resolve ({error}): gloo cannot pick an address "
                "for the data plane; set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the "
                "interface that reaches the other hosts, e.g. GLOO_SOCKET_IFNAME=eth0")
    if address.startswith("127.") or address == "::1":
        return (f"this job spans {len(set(hosts))} hosts ({world} ranks) but the hostname "
                f"{name!r} resolves to the loopback address {address}: gloo (the data plane: "
                "fragments, weights, commands) would bind it and ranks on other hosts could not "
                "connect. Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface that "
                "reaches the other hosts, e.g. GLOO_SOCKET_IFNAME=eth0 (`ip -br addr` lists them)")
    return None


@dataclasses.dataclass
class Groups:
    """This rank's place in the rank grid and the groups it talks on (None where it is not a
    member)."""

    rank: int
    world: int
    rollout_ranks: list[int]
    trainer_ranks: list[int]
    compute: object = None  # trainers, default backend, device tensors, main thread
    trainer_data: object = None  # trainers, gloo, CPU tensors
    publish: object = None  # [leader] + rollout ranks, gloo, CPU tensors
    world_data: object = None  # all ranks, gloo, CPU tensors

    @property
    def leader(self) -> int:
        return self.trainer_ranks[0]

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainer_ranks

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout_ranks

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def num_trainers(self) -> int:
        return len(self.trainer_ranks)

    @property
    def trainer_index(self) -> int:
        return self.trainer_ranks.index(self.rank)

    @property
    def role(self) -> str:
        if self.is_trainer and self.is_rollout:
            return "colocated"
        return "trainer" if self.is_trainer else "rollout"


def role_of(placement: str, rollout_ranks: int, rank: int, world: int) -> str:
    if placement == "colocated" or world == 1:
        return "colocated"
    return "rollout" if rank < rollout_ranks else "trainer"


def build_groups(rank: int, world: int, placement: str, rollout_ranks: int) -> Groups:
    """Every rank calls this with the same arguments: torch.distributed needs all ranks in every
    new_group, in the same order. At world size 1 there are no groups and every collective helper is
    a no-op."""
    if placement == "colocated" or world == 1:
        rollout, trainers = list(range(world)), list(range(world))
    else:
        rollout, trainers = list(range(rollout_ranks)), list(range(rollout_ranks, world))
    groups = Groups(rank, world, rollout, trainers)
    if world == 1:
        return groups

    def new(ranks, plane, backend):
        group = dist.new_group(ranks, timeout=NO_DEADLINE, backend=backend,
                               group_desc=f"{plane}:{len(ranks)}")
        if group is not None and rank in ranks:
            return group
        return None

    groups.world_data = new(list(range(world)), DATA_PLANE, "gloo")
    groups.compute = new(trainers, COMPUTE_PLANE, None)  # None: the default backend
    groups.trainer_data = new(trainers, DATA_PLANE, "gloo")
    if placement != "colocated":
        groups.publish = new([trainers[0]] + rollout, DATA_PLANE, "gloo")
    return groups

