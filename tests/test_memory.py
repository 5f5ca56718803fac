"""Publishing and checkpointing under FSDP with full fine-tuning hold at most one whole tensor beyond the
shards on ranks that do not write, and the leader gathers one tensor at a time for publishing (it then sends buckets of at most async_policy.PUBLISH_BUCKET_BYTES) (issue: every trainer used to gather all weights and Adam state at once).

Two gloo processes shard the tiny FLUX transformer with trainer.shard_for_fsdp (the real FSDP2 path); every
whole tensor that DTensor.full_tensor returns is tracked with a weak reference, and the most whole-tensor bytes
alive at once are compared with the largest single tensor.
"""
import collections
import datetime

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(180)


def _worker(rank, master, cache, results):
    import os
    import weakref

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    os.environ["DIGENRL_CACHE"] = cache
    import async_policy
    import models
    from trainer import TrainConfig, Trainer, shard_for_fsdp

    torch.set_num_threads(1)
    from infra.launch import open_store
    store = open_store(master, 2, is_master=rank == 0, timeout_s=60)  # rank 0 serves on the parent's held socket
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    models.enable_full_training(policy)
    shard_for_fsdp(policy, dist.group.WORLD, keep_reference=False)
    trainer = Trainer(policy, TrainConfig(), compute_group=dist.group.WORLD, data_group=dist.group.WORLD, sharded=True)
    for p in trainer.params:  # an optimizer step creates the Adam state (sharded like the weights)
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()

    alive, peak = weakref.WeakSet(), [0]
    original = DTensor.full_tensor

    def tracked(self, *args, **kwargs):
        whole = original(self, *args, **kwargs)
        alive.add(whole)
        peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in alive))
        return whole

    DTensor.full_tensor = tracked
    leader = rank == 0
    alone = dist.new_group([0], backend="gloo")  # the leader publishes to a group of its own (no receivers here)
    if leader:
        async_policy.publish(trainer.iter_full_weights(), len(trainer.params), 1, 0, alone)
    else:
        collections.deque(trainer.iter_full_weights(), maxlen=0)  # a non-leader's part in a publish (main.py)
    publish_peak, peak[0] = peak[0], 0
    state = trainer.checkpoint_state(keep=leader)
    largest = max(max(p.numel() * p.element_size() for p in trainer.params),
                  max(v.numel() * v.element_size() for s in trainer.optimizer.state.values() for v in s.values()
                      if v.ndim))
    sharded = sum(p.to_local().numel() * p.element_size() for p in trainer.params)
    results.put((rank, publish_peak, peak[0], largest, sharded, state is None))
    dist.barrier()
    dist.destroy_process_group()


def test_non_leaders_hold_one_whole_tensor_at_a_time(tiny_cache):
    from infra.launch import HOST, listening_socket

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    listener = listening_socket()  # held from bind to use: no other job can take the port meanwhile
    master = (HOST, listener.getsockname()[1])
    procs = [ctx.Process(target=_worker, args=(r, master + ((listener,) if r == 0 else ()), tiny_cache, results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    rows = {row[0]: row[1:] for row in (results.get(), results.get())}
    publish_peak, checkpoint_peak, largest, sharded, kept_nothing = rows[1]
    print(f"non-leader: sharded weights {sharded} B; largest whole tensor {largest} B; most whole-tensor bytes alive "
          f"at once: publish {publish_peak} B, checkpoint {checkpoint_peak} B")
    assert kept_nothing and 0 < publish_peak <= largest and 0 < checkpoint_peak <= largest
    leader_publish_peak, _, _, _, leader_kept_nothing = rows[0]
    assert 0 < leader_publish_peak <= largest  # the leader too gathers one tensor at a time
    assert not leader_kept_nothing  # the leader, which writes the file, kept the state
