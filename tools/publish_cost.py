"""What the data plane costs: weight publishing over gloo (CPU tensors) between processes on one host.

    python tools/publish_cost.py                         # 105 MB (LoRA r32 of FLUX.1-dev, bf16) .. 4 GB
    python tools/publish_cost.py --sizes-mb 210 --receivers 3

Runs async_policy.publish on a leader and async_policy.Mailbox on `--receivers` other processes (the
real code path: one broadcast per tensor over a gloo group, received by the mailbox thread, then
swapped into the model's tensors), for weights of each size cut into tensors of `--tensor-mb`, and
prints seconds and GB/s per size. Full FLUX.1-dev weights (24 GB in bf16) need 24 GB on each side,
more than this 24 GiB machine has: the table's GB/s is what to extrapolate with (the printed
"24 GB at this rate" line does that, and says so).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as `python tools/X.py`: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world, master, sizes_mb, tensor_mb, reps, results):
    import torch
    import torch.distributed as dist

    import async_policy

    torch.set_num_threads(1)
    from infra.launch import open_store
    store = open_store(master, world, is_master=rank == 0, timeout_s=1800)  # rank 0 serves on the held socket
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    group = dist.new_group(list(range(world)), backend="gloo")  # the publish group (the mailbox thread's)
    control = dist.new_group(list(range(world)), backend="gloo")  # the main threads' barriers (comm.py rule 3)
    for size_mb in sizes_mb:
        n = max(1, round(size_mb / tensor_mb))
        numel = int(size_mb * 2**20 / n / 2)  # bf16: 2 bytes per value
        tensors = [torch.full((numel,), float(rank), dtype=torch.bfloat16) for _ in range(n)]
        mailbox = async_policy.Mailbox(0, group, like=tensors) if rank else None
        times = []
        for version in range(reps):
            dist.barrier(group=control)
            start = time.perf_counter()
            if rank == 0:
                async_policy.publish(tensors, n, version, 0, group)
            else:
                mailbox.wait_for(version)
                mailbox.swap_into(tensors)
            dist.barrier(group=control)
            times.append(time.perf_counter() - start)
        if rank == 0:
            async_policy.publish([], 0, async_policy.STOP, 0, group)
            results.put((size_mb, n, statistics.median(times)))
        else:
            mailbox.join()
            assert float(tensors[0][0]) == 0.0, "the published weights did not arrive"
        del tensors, mailbox
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[105, 210, 1024, 4096])
    parser.add_argument("--tensor-mb", type=float, default=16.0, help="size of each published tensor")
    parser.add_argument("--receivers", type=int, default=1, help="rollout ranks receiving each publish")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from infra.launch import HOST, listening_socket

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    world = args.receivers + 1
    listener = listening_socket()  # held until rank 0's store serves on it
    master = (HOST, listener.getsockname()[1])
    procs = [ctx.Process(target=_worker, args=(r, world, master + ((listener,) if r == 0 else ()), args.sizes_mb,
                                               args.tensor_mb, args.reps, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print(f"error: a rank failed ({[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    rows = []
    while not results.empty():
        rows.append(results.get())
    print(f"publish over gloo, 1 leader -> {args.receivers} receiver(s) on one host, tensors of {args.tensor_mb:g} MB, "
          f"median of {args.reps}")
    print(f"{'size MB':>9} {'tensors':>8} {'seconds':>9} {'GB/s':>7}")
    for size_mb, n, seconds in sorted(rows):
        print(f"{size_mb:9.0f} {n:8d} {seconds:9.3f} {size_mb / 1024 / seconds:7.2f}")
    size_mb, _, seconds = max(rows)
    print(f"24 GB (full FLUX.1-dev, bf16) at the {size_mb:.0f} MB rate: about {24 * 1024 / size_mb * seconds:.0f} s "
          "(extrapolated, not measured: it does not fit in this machine's memory twice)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
