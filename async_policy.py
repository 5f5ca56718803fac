"""Policy versions, weight publishing, the rollout-side mailbox, and the one-step staleness bound (TCSS).

Paper: DigenRL, "tightly one-step constrained asynchronous strategy" (DESIGN.md section 5). After each
optimizer step the trainer leader publishes the trainable weights (LoRA only when LoRA is on) with
their version to every rollout rank over a dedicated process group. A rollout rank receives them in a
background thread (the mailbox) and swaps them in only between fragments. Batch k should be generated
with version k. With async on, once every fragment of batch k is claimed and version k+1 has not yet
arrived, a rollout rank may generate up to `max_stale` fragments of batch k+1 with version k.

Invariants (asserted, not only tested): staleness = trainer version - fragment version is 0 or 1;
every trajectory and group is generated under one version (weights swap only between fragments);
with async off, a fragment's version always equals its step.

Departures from the paper: the stale budget j is per step and global (an atomic counter in the
store) rather than per rank (main.py's default j = R gives each rollout rank one fragment on average); stale fragments are trained with the PPO ratio against the recorded
behaviour log-probs, on-policy ones with the detached current log-prob (ratio exactly 1).

Try it: `python main.py --placement disaggregated --gap --tsp --async --max-stale-fragments 1`.
Only torch is imported: this file can be copied into another codebase as it is.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

STOP = -1  # the version number that tells mailboxes to exit


def flatten(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])  # [total numel]


def unflatten_into(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p).to(p.device, p.dtype))
            offset += n
    if offset != flat.numel():
        raise RuntimeError(f"published weights have {flat.numel()} values, this model expects {offset}")


def publish(params: list[torch.Tensor], version: int, src: int, group, device="cpu") -> None:
    """Trainer leader: broadcast (version, weights) to every rank of the publish group."""
    header = torch.tensor([version, sum(p.numel() for p in params)], dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    if version != STOP:
        dist.broadcast(flatten(params).to(device), src=src, group=group)


class Mailbox:
    """Rollout rank: a background thread receives published weights; the main thread swaps between fragments."""

    def __init__(self, src: int, group, device="cpu", timeout_s: float = 600.0, on_receive=None):
        self.src, self.group, self.device, self.timeout_s = src, group, device, timeout_s
        self.on_receive = on_receive  # optional callback(version, seconds) for tracing
        self._cond = threading.Condition()
        self._latest: tuple[int, torch.Tensor] | None = None
        self._held_version = -1  # version of the weights currently in the model
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-mailbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64, device=self.device)
                dist.broadcast(header, src=self.src, group=self.group)  # blocks until the next publish
                start = time.perf_counter()
                version, numel = int(header[0]), int(header[1])
                if version == STOP:
                    break
                flat = torch.empty(numel, dtype=torch.float32, device=self.device)
                dist.broadcast(flat, src=self.src, group=self.group)
                with self._cond:
                    self._latest = (version, flat)
                    self._cond.notify_all()
                if self.on_receive:
                    self.on_receive(version, start)
        except BaseException as exc:  # noqa: BLE001  (surfaced to the main thread, which raises it)
            self.error = exc
        with self._cond:
            self._cond.notify_all()

    def latest_version(self) -> int:
        with self._cond:
            return -1 if self._latest is None else self._latest[0]

    @property
    def held_version(self) -> int:
        return self._held_version

    def wait_for(self, version: int, timeout_s: float | None = None) -> None:
        """Block until weights of at least `version` have arrived (bounded; mailbox errors re-raised)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        with self._cond:
            while self._latest is None or self._latest[0] < version:
                if self.error is not None:
                    raise RuntimeError(f"weight mailbox failed: {self.error}") from self.error
                if not self._thread.is_alive():
                    raise RuntimeError(f"weight mailbox stopped before version {version} arrived")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no weights of version {version} after {timeout_s or self.timeout_s:.0f}s")
                self._cond.wait(min(left, 1.0))

    def swap_into(self, params: list[torch.Tensor]) -> int:
        """Copy the latest weights into the model (call only between fragments); returns the held version."""
        if self.error is not None:
            raise RuntimeError(f"weight mailbox failed: {self.error}") from self.error
        with self._cond:
            latest = self._latest
        if latest is not None and latest[0] > self._held_version:
            unflatten_into(latest[1], params)
            self._held_version = latest[0]
        return self._held_version

    def join(self, timeout_s: float = 30.0) -> None:
        self._thread.join(timeout_s)


def check_staleness(trainer_version: int, fragment_version: int, async_on: bool) -> int:
    """The TCSS bound: 0 or 1 with async, exactly 0 without. Returns the staleness."""
    staleness = trainer_version - fragment_version
    allowed = (0, 1) if async_on else (0,)
    assert staleness in allowed, (f"fragment generated with version {fragment_version} reached a trainer at version "
                                  f"{trainer_version}: staleness {staleness} is outside {allowed}")
    return staleness


def may_generate_stale(claim_stale_budget, max_stale: int) -> bool:
    """Take one unit of the step's global stale budget (an atomic counter); False once j are taken."""
    if max_stale <= 0:
        return False
    return claim_stale_budget() <= max_stale


def version_for_step(step: int) -> int:
    """Batch k is generated, on-policy, with the weights produced by k optimizer steps."""
    return step
