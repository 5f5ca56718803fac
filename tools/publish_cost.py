"""What the data plane costs: weight publishing over gloo (CPU tensors) between processes on one host.

    python tools/publish_cost.py                         # 105 MB (LoRA r32 of FLUX.1-dev, bf16) .. 4 GB
    python tools/publish_cost.py --sizes-mb 210 --receivers 3
    python tools/publish_cost.py --sizes-mb 4096 24576 --tensor-mb 64 --wire-only   # full FLUX.1-dev weights

Runs transport.publish_weights on a leader and transport.Mailbox (transport.WeightReceiver) on `--receivers`
other processes (the real code path: (version, count), then flat buckets of at most PUBLISH_BUCKET_BYTES
over a gloo group, received by the mailbox thread, then swapped into the model's tensors), for weights of each size cut
into tensors of `--tensor-mb`, and prints seconds and GB/s per size. The leader yields one reused
tensor `count` times, as FSDP's just-in-time gather does, so it holds a bucket, not the model.
A mailbox holds the received weights beside the model's (2x the size per receiver): on a 24 GiB
machine that caps the real path near 8 GB. `--wire-only` receives the same broadcasts, cut into the
same buckets, into one reused buffer (no model, no swap): the transport's cost at any size, e.g. the
24 GB of full FLUX.1-dev weights in bf16, without holding them.
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


def receive_wire_only(src: int, group, shapes: list, bucket_bytes: int) -> int:
    """The mailbox's broadcasts (header, then buckets cut by transport.fits_bucket), into one reused buffer.
    Returns the version received."""
    import torch
    import torch.distributed as dist

    import transport

    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    buffer = torch.empty(0, dtype=torch.uint8)
    bucket: list = []

    def take() -> None:
        nonlocal buffer
        nbytes = sum(b for b, _ in bucket)
        if buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        dist.broadcast(buffer[:nbytes].view(bucket[0][1]), src=src, group=group)
        bucket.clear()

    for shape, dtype in shapes:
        nbytes = shape.numel() * dtype.itemsize
        if bucket and not transport.fits_bucket(bucket, nbytes, dtype, bucket_bytes):
            take()
        bucket.append((nbytes, dtype))
    if bucket:
        take()
    return int(header[0])


def _worker(rank, world, master, sizes_mb, tensor_mb, reps, wire_only, results):
    import torch
    import torch.distributed as dist

    import async_policy
    import transport
    from infra.launch import open_store

    torch.set_num_threads(1)
    store = open_store(master, world, is_master=rank == 0, timeout_s=1800)  # rank 0 serves on the held socket
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    group = dist.new_group(list(range(world)), backend="gloo")  # the publish group (the mailbox thread's)
    control = dist.new_group(list(range(world)), backend="gloo")  # the main threads' barriers (comm.py rule 3)
    for size_mb in sizes_mb:
        n = max(1, round(size_mb / tensor_mb))
        numel = int(size_mb * 2**20 / n / 2)  # bf16: 2 bytes per value
        like = torch.empty(numel, dtype=torch.bfloat16)
        shapes = [(like.shape, like.dtype)] * n
        if rank == 0:
            source = torch.full((numel,), 1.0, dtype=torch.bfloat16)  # yielded n times: one tensor held
            model, mailbox = None, None
        elif wire_only:
            model, mailbox = None, None
        else:
            model = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(n)]
            mailbox = transport.Mailbox(transport.WeightReceiver(0, group, shapes))
        times = []
        for version in range(reps):
            dist.barrier(group=control)
            start = time.perf_counter()
            if rank == 0:
                transport.publish_weights((source for _ in range(n)), n, version, 0, group)
            elif wire_only:
                assert receive_wire_only(0, group, shapes, transport.PUBLISH_BUCKET_BYTES) == version
            else:
                mailbox.wait_for(version)
                mailbox.swap_into(model)
            dist.barrier(group=control)
            times.append(time.perf_counter() - start)
        if rank == 0:
            if not wire_only:
                transport.publish_weights([], 0, async_policy.STOP, 0, group)
            results.put((size_mb, n, statistics.median(times)))
        elif mailbox is not None:
            mailbox.join()
            assert float(model[-1][-1]) == 1.0, "the published weights did not arrive"
        del model, mailbox
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[105, 210, 1024, 4096])
    parser.add_argument("--tensor-mb", type=float, default=16.0, help="size of each published tensor")
    parser.add_argument("--receivers", type=int, default=1, help="rollout ranks receiving each publish")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wire-only", action="store_true",
                        help="receive into one reused buffer (no model copy): sizes beyond the machine's memory")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from infra.launch import HOST, listening_socket

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    world = args.receivers + 1
    listener = listening_socket()  # held until rank 0's store serves on it
    master = (HOST, listener.getsockname()[1])
    procs = [ctx.Process(target=_worker, args=(r, world, master + ((listener,) if r == 0 else ()), args.sizes_mb,
                                               args.tensor_mb, args.reps, args.wire_only, results))
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
    how = "wire only (one reused receive buffer)" if args.wire_only else "mailbox + swap into the model"
    print(f"publish over gloo, 1 leader -> {args.receivers} receiver(s) on one host, tensors of {args.tensor_mb:g} MB, "
          f"{how}, median of {args.reps}")
    print(f"{'size MB':>9} {'tensors':>8} {'seconds':>9} {'GB/s':>7}")
    for size_mb, n, seconds in sorted(rows):
        print(f"{size_mb:9.0f} {n:8d} {seconds:9.3f} {size_mb / 1024 / seconds:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
