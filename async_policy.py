"""TCSS, the one-step-constrained asynchronous policy: versions, weight publishing, the mailbox, generate-ahead.

Paper: DigenRL, "tightly one-step constrained asynchronous strategy" (docs/DESIGN.md section 5).
Weights version k is the policy after k optimizer steps; batch k should be generated with version k.
After each optimizer step the trainer leader publishes the trainable weights (LoRA only when LoRA is
on) with their version to every rollout rank, in the rollout's dtype, over a gloo group with CPU
tensors: consecutive tensors are packed into flat buckets of at most PUBLISH_BUCKET_BYTES (one
broadcast each: a model of many small tensors costs one round trip, not one per tensor), a larger
tensor goes alone, so the sender never holds more than a bucket plus one whole tensor. A rollout
rank receives them in a background thread (the `Mailbox`) and swaps them into its model only
between fragments. With async on, once every group of batch k is
claimed and version k+1 has not arrived yet (the trainer is still on batch k's tail),
`generate_ahead` lets rollout ranks generate up to j fragments of batch k+1 with version k.

Invariants (asserted by `check_staleness`, not only tested): staleness = trainer version - fragment
version is 0 or 1; every trajectory and group is generated under one version (weights swap only
between fragments); with async off, a fragment's version always equals its step.

Departures from the paper: the stale budget j is per step and global (an atomic counter in the store,
`StaleBudget`) rather than per rank (the default j = R gives each rollout rank one on average);
stale fragments are trained with the PPO ratio against the recorded behaviour log-probs, on-policy
ones with the detached current log-prob (ratio exactly 1).

Try it: `python main.py --placement disaggregated --gap --tsp --async --max-stale-fragments 1`.
Only torch and the standard library are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

STOP = -1  # the version number that tells mailboxes to exit


def check_staleness(trainer_version: int, fragment_version: int, async_on: bool) -> int:
    """The TCSS bound: 0 or 1 with async, exactly 0 without. Returns the staleness."""
    staleness = trainer_version - fragment_version
    allowed = (0, 1) if async_on else (0,)
    if staleness not in allowed:
        raise AssertionError(f"a fragment generated with weights version {fragment_version} reached a trainer at "
                             f"version {trainer_version}: staleness {staleness} is outside {allowed}")
    return staleness


PUBLISH_BUCKET_BYTES = 32 << 20  # both ends cut the stream into the same buckets (fits_bucket)


def fits_bucket(bucket: list[tuple[int, torch.dtype]], nbytes: int, dtype: torch.dtype, limit: int) -> bool:
    """Whether a tensor of `nbytes` bytes in `dtype` joins the open bucket (same dtype, total <= limit)."""
    return bool(bucket) and bucket[0][1] == dtype and sum(b for b, _ in bucket) + nbytes <= limit


def publish(tensors: Iterable[torch.Tensor], count: int, version: int, src: int, group,
            dtypes: list[torch.dtype] | None = None, bucket_bytes: int = PUBLISH_BUCKET_BYTES) -> None:
    """Trainer leader: broadcast (version, count) then the `count` tensors as CPU tensors in `dtypes` (the
    rollout's parameter dtypes), packed into buckets. `tensors` may gather each one just in time (FSDP), so
    at most one bucket, its flat copy and one whole tensor are held here at once."""
    dist.broadcast(torch.tensor([version, count], dtype=torch.int64), src=src, group=group)
    if version == STOP:
        return
    bucket: list[torch.Tensor] = []
    plan: list[tuple[int, torch.dtype]] = []  # (bytes, dtype) of the bucket's tensors: what fits_bucket reads

    def flush() -> None:
        flat = bucket[0].reshape(-1) if len(bucket) == 1 else torch.cat([b.reshape(-1) for b in bucket])
        bucket.clear()
        plan.clear()
        dist.broadcast(flat, src=src, group=group)  # [bucket numel] in the bucket's dtype

    sent = 0
    for t in tensors:  # (not enumerate: its reused result tuple would keep the last tensor alive)
        wire = t.detach().to("cpu", dtypes[sent] if dtypes is not None else t.dtype).contiguous()
        del t  # let a just-in-time gathered tensor go before the next one is gathered
        nbytes = wire.numel() * wire.element_size()
        if bucket and not fits_bucket(plan, nbytes, wire.dtype, bucket_bytes):
            flush()
        bucket.append(wire)
        plan.append((nbytes, wire.dtype))
        del wire
        sent += 1
    if bucket:
        flush()
    if sent != count:
        raise RuntimeError(f"published {sent} tensors, announced {count}")


class Mailbox:
    """Rollout rank: a background thread receives published weights into CPU buffers; the main thread
    swaps them into the model between fragments. Waits have no deadline: liveness ends a dead job."""

    def __init__(self, src: int, group, like: list[torch.Tensor], bucket_bytes: int = PUBLISH_BUCKET_BYTES):
        self.src, self.group, self.bucket_bytes = src, group, bucket_bytes
        self.shapes = [(p.shape, p.dtype) for p in like]
        self._cond = threading.Condition()
        self._latest: tuple[int, list[torch.Tensor] | None] | None = None  # (version, buffers; None once swapped)
        self._held_version = -1  # version of the weights currently in the model
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-mailbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64)
                dist.broadcast(header, src=self.src, group=self.group)  # blocks until the next publish
                version, count = int(header[0]), int(header[1])
                if version == STOP:
                    break
                if count != len(self.shapes):
                    raise RuntimeError(f"published weights have {count} tensors, this model has {len(self.shapes)}")
                buffers = self._receive_buckets()
                with self._cond:
                    self._latest = (version, buffers)
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001  (surfaced to the main thread, which raises it)
            self.error = exc
        with self._cond:
            self._cond.notify_all()

    def _receive_buckets(self) -> list[torch.Tensor]:
        """The publisher's buckets, cut the same way (fits_bucket); returns one view per weight."""
        buffers: list[torch.Tensor] = []
        bucket: list[tuple[int, torch.dtype]] = []

        def take() -> None:
            flat = torch.empty(sum(b for b, _ in bucket) // bucket[0][1].itemsize, dtype=bucket[0][1])
            dist.broadcast(flat, src=self.src, group=self.group)
            offset = 0
            for shape, _ in self.shapes[len(buffers):len(buffers) + len(bucket)]:
                buffers.append(flat[offset:offset + shape.numel()].view(shape))
                offset += shape.numel()
            bucket.clear()

        for shape, dtype in self.shapes:
            nbytes = shape.numel() * dtype.itemsize
            if bucket and not fits_bucket(bucket, nbytes, dtype, self.bucket_bytes):
                take()
            bucket.append((nbytes, dtype))
        if bucket:
            take()
        return buffers

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"weight mailbox failed: {self.error}") from self.error

    def latest_version(self) -> int:
        with self._cond:
            return -1 if self._latest is None else self._latest[0]

    @property
    def held_version(self) -> int:
        return self._held_version

    def wait_for(self, version: int, also_check: Callable[[], None] = lambda: None) -> None:
        """Block until weights of at least `version` have arrived. `also_check` runs at least once a second
        while waiting and may raise: the rollout's fragment sender, whose failure means they never will."""
        with self._cond:
            while self._latest is None or self._latest[0] < version:
                self._raise_if_failed()
                also_check()
                if not self._thread.is_alive():
                    raise RuntimeError(f"weight mailbox stopped before version {version} arrived")
                self._cond.wait(1.0)

    def swap_into(self, params: list[torch.Tensor]) -> int:
        """Copy the latest weights into the model (call only between fragments); returns the held version."""
        self._raise_if_failed()
        with self._cond:
            latest = self._latest
            if latest is not None and latest[1] is not None:
                self._latest = (latest[0], None)  # the buffers are consumed: free them after the copy
        if latest is not None and latest[1] is not None and latest[0] > self._held_version:
            with torch.no_grad():
                for p, t in zip(params, latest[1]):
                    p.copy_(t)
            self._held_version = latest[0]
        return self._held_version

    def join(self) -> None:
        """Wait for the thread to finish (after the leader's STOP); a failure is raised here."""
        self._thread.join()
        self._raise_if_failed()


class StaleBudget:
    """The global per-step budget j of fragments generated one version stale (an atomic store counter)."""

    def __init__(self, store, max_stale: int):
        self.store, self.max_stale = store, max_stale

    def take(self, step: int) -> bool:
        return self.max_stale > 0 and self.store.add(f"stale/{step}", 1) <= self.max_stale

    def forget(self, step: int) -> None:
        self.store.delete_key(f"stale/{step}")


def generate_ahead(step: int, last_step: int, latest_version: Callable[[], int], take_budget: Callable[[int], bool],
                   claim: Callable[[int], tuple[int, int] | None], produce: Callable[[int, tuple[int, int]], None]) -> int:
    """TCSS on a rollout rank whose batch `step` is fully claimed: while version step + 1 has not arrived,
    generate fragments of batch step + 1 with the weights held (version step), within the budget.
    Returns how many it generated."""
    made = 0
    while step + 1 <= last_step and latest_version() < step + 1 and take_budget(step + 1):
        claimed = claim(step + 1)
        if claimed is None:
            break
        produce(step + 1, claimed)
        made += 1
    return made
