"""TCSS, the one-step-constrained asynchronous policy: versions, the staleness bound,
generate-ahead, the stale-pair loss rule.

Paper: DigenRL, "tightly one-step constrained asynchronous strategy" (docs/DESIGN.md section 5).
Weights version k is the policy after k optimizer steps; batch k should be generated with version k.
After each optimizer step the trainer leader publishes the trainable weights (LoRA only when LoRA is
on) with their version to every rollout rank (`Publisher`; the buckets on the wire are
transport.publish_weights'). A rollout rank receives them in a background thread and swaps them
into its model only between fragments (`RolloutWeights`; the thread and the host buffers it reuses
are transport.Mailbox). With TCSS on, once every group of batch k is claimed and version k+1 has
not arrived yet (the trainer is still on batch k's tail), `generate_ahead` lets rollout ranks
generate up to j fragments of batch k+1 with version k.

Invariants (asserted by `check_staleness`, not only tested): staleness = trainer version - fragment
version is 0 or 1; every trajectory and group is generated under one version (weights swap only
between fragments); with TCSS off, a fragment's version always equals its step.

Departures from the paper: the stale budget j is per step and global (an atomic counter in the
store, `StaleBudget`) rather than per rank (the default j = R gives each rollout rank one on
average); stale fragments are trained with the PPO ratio against the recorded behaviour log-probs,
on-policy ones with the detached current log-prob (ratio exactly 1).

Try it: `python3 async_policy.py` (alone: a fragment generated ahead, its PPO ratio); in a run,
`python main.py --placement disaggregated --gap --tsp --tcss --max-stale-fragments 1`.
Only torch and the standard library are imported: this file can be copied into another codebase.
"""
from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterable

import torch

STOP = -1  # the version number that tells mailboxes (transport.Mailbox) to exit


def check_staleness(trainer_version: int, fragment_version: int, tcss_on: bool) -> int:
    """The TCSS bound: 0 or 1 with TCSS on, exactly 0 without. Returns the staleness."""
    staleness = trainer_version - fragment_version
    allowed = (0, 1) if tcss_on else (0,)
    if staleness not in allowed:
        raise AssertionError(f"a fragment generated with weights version {fragment_version} "
                             f"reached a trainer at version {trainer_version}: staleness "
                             f"{staleness} is outside {allowed}")
    return staleness


def behaviour_log_prob(current: torch.Tensor, recorded: torch.Tensor,
                       stale: torch.Tensor | bool) -> torch.Tensor:
    """The stale-pair loss rule: the PPO ratio's denominator. A stale pair (generated one version
    ago) is trained against the behaviour log-prob its rollout recorded, so the ratio corrects for
    the older policy and the clip bounds the step; an on-policy pair against its own detached
    log-prob (ratio exactly 1: the same gradient as Flow-GRPO's on-policy update, without trusting
    the rollout's numerics)."""
    stale = torch.as_tensor(stale, device=current.device)  # one flag, or one per pair [p]
    return torch.where(stale, recorded.to(current.device), current.detach())


class StaleBudget:
    """The global per-step budget j of fragments generated one version stale (an atomic store
    counter)."""

    def __init__(self, store, max_stale: int):
        self.store, self.max_stale = store, max_stale

    def take(self, step: int) -> bool:
        return self.max_stale > 0 and self.store.add(f"stale/{step}", 1) <= self.max_stale

    def forget(self, step: int) -> None:
        self.store.delete_key(f"stale/{step}")


def generate_ahead(step: int, last_step: int, latest_version: Callable[[], int],
                   take_budget: Callable[[int], bool],
                   claim: Callable[[int], tuple[int, int] | None],
                   produce: Callable[[int, tuple[int, int]], None]) -> int:
    """TCSS on a rollout rank whose batch `step` is fully claimed: while version step + 1 has not
    arrived, generate fragments of batch step + 1 with the weights held (version step), within the
    budget. Returns how many it generated."""
    made = 0
    while step + 1 <= last_step and latest_version() < step + 1 and take_budget(step + 1):
        claimed = claim(step + 1)
        if claimed is None:
            break
        produce(step + 1, claimed)
        made += 1
    return made


# --- the rollout side -----------------------------------------------------------------------------
class RolloutWeights:
    """A rollout rank's weights, for main.rollout_loop: batch k waits for version k; new weights are
    swapped in only between fragments (every trajectory and group is generated under one version);
    with a stale budget, once batch k is fully claimed and version k + 1 has not come, fragments of
    batch k + 1 with version k. `mailbox` receives the publishes: transport.Mailbox in a run
    (wait_for, swap_into, latest_version, held_version, join)."""

    def __init__(self, mailbox, params: list[torch.Tensor],
                 budget: StaleBudget | None = None, also_check: Callable[[], None] = lambda: None,
                 tracer=None, forgets: bool = False):
        self.mailbox, self.params, self.budget, self.also_check = (
            mailbox, params, budget, also_check)
        # infra.tracing.Tracer or None: a "wait" span while waiting for weights
        self.tracer = tracer
        self.forgets = forgets  # one rollout rank deletes the budget's old store keys

    def wait_for(self, step: int) -> None:
        span = (self.tracer.span("wait", step=step, what="weights") if self.tracer
                else contextlib.nullcontext())
        with span:  # a failed send means the weights never come: also_check raises it
            self.mailbox.wait_for(step, also_check=self.also_check)
        if self.forgets and self.budget is not None and step >= 2:
            # version `step` is out: no rank generates ahead into step - 1 or before
            self.budget.forget(step - 2)

    def between_fragments(self) -> None:
        self.mailbox.swap_into(self.params)

    def version(self, step: int, ahead: bool) -> int:
        """The version that generates the next fragment of batch `step`: on-policy unless generated
        ahead."""
        check_staleness(step, self.mailbox.held_version, tcss_on=ahead)
        return self.mailbox.held_version

    def after_claims(self, step: int, last_step: int,
                     claim: Callable[[int], tuple[int, int] | None],
                     produce: Callable[[int, tuple[int, int]], None]) -> None:
        if self.budget is not None:
            generate_ahead(step, last_step, self.mailbox.latest_version, self.budget.take, claim,
                           produce)

    def close(self) -> None:
        self.mailbox.join()


# --- the trainer side -----------------------------------------------------------------------------
class Publisher:
    """After each optimizer step the trainer leader publishes the trainable weights with their
    version.

    weights() yields them whole (gathered one at a time under FSDP: every trainer must iterate,
    `gathers`); send(tensors, count, version) is the transport (transport.publish_weights) on the
    leader (`sends`)."""

    def __init__(self, weights: Callable[[], Iterable[torch.Tensor]], count: int,
                 send: Callable[[Iterable[torch.Tensor], int, int], None], sends: bool,
                 gathers: bool, on_published: Callable[[float], None] | None = None, tracer=None):
        self.weights, self.count, self.send, self.sends, self.gathers = (
            weights, count, send, sends, gathers)
        self.on_published, self.tracer = on_published, tracer

    def publish(self, version: int) -> None:
        if not (self.sends or self.gathers):
            return
        start = time.perf_counter()
        span = (self.tracer.span("publish", version=version) if self.tracer
                else contextlib.nullcontext())
        with span:
            if self.sends:
                self.send(self.weights(), self.count, version)
            else:
                # take part in each gather, keep nothing
                collections.deque(self.weights(), maxlen=0)
        if self.on_published is not None:
            self.on_published(time.perf_counter() - start)

    def stop(self) -> None:
        """Tell every mailbox to exit."""
        if self.sends:
            span = (self.tracer.span("publish", version=STOP) if self.tracer
                    else contextlib.nullcontext())
            with span:
                self.send([], 0, STOP)


# --- python3 async_policy.py: the mechanism alone, on fake ranks ----------------------------------
class _DemoStore:
    """The job's store, as the demo needs it: an atomic counter per key."""

    def __init__(self):
        self.counts = collections.Counter()

    def add(self, key: str, n: int) -> int:
        self.counts[key] += n
        return self.counts[key]

    def delete_key(self, key: str) -> None:
        self.counts.pop(key, None)


class _DemoMailbox:
    """transport.Mailbox in a run (a thread receiving publishes into reused host buffers); here a
    publish is in as soon as it is sent."""

    def __init__(self):
        self.published, self.held_version = [], -1  # [(version, tensors)], oldest first

    def latest_version(self) -> int:
        return self.published[-1][0] if self.published else -1

    def wait_for(self, version: int, also_check: Callable[[], None]) -> None:
        assert self.latest_version() >= version

    def swap_into(self, params: list[torch.Tensor]) -> None:
        self.held_version, tensors = self.published[-1]
        for p, t in zip(params, tensors):
            p.copy_(t)


def _demo() -> None:
    theta = torch.zeros(3)  # the trainer's weights (the policy: x ~ N(theta, 1))
    rollout_theta = torch.zeros(3)  # the rollout's copy
    mailbox = _DemoMailbox()
    weights = RolloutWeights(mailbox, [rollout_theta], StaleBudget(_DemoStore(), max_stale=1))

    def log_prob(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        return -0.5 * ((x - mean) ** 2).sum()

    made = []
    claims = iter([(0, 1), (1, 1), None])  # batch 1's groups, claimed from the queue

    def produce(step: int, claimed: tuple[int, int]) -> None:
        version = weights.version(step, ahead=True)
        x = rollout_theta + torch.randn(3, generator=torch.Generator().manual_seed(claimed[0]))
        made.append((step, version, x, log_prob(x, rollout_theta)))
        print(f"rollout: batch {step} groups {claimed} generated AHEAD with weights version "
              f"{version}")

    mailbox.published.append((0, [theta.clone()]))  # the leader publishes version 0
    weights.wait_for(0)
    weights.between_fragments()
    print(f"rollout: holds version {mailbox.held_version}; batch 0 fully claimed, version 1 not "
          "here yet")
    weights.after_claims(0, 1, lambda step: next(claims), produce)
    print(f"rollout: stale budget j = 1 spent after {len(made)} fragment(s)")
    theta += torch.tensor([0.1, -0.1, 0.05])  # the trainer's step on batch 0
    mailbox.published.append((1, [theta.clone()]))  # version 1: no more generating ahead
    step, version, x, recorded = made[0]
    staleness = check_staleness(1, version, tcss_on=True)
    new = log_prob(x, theta)
    ratio = torch.exp(new - behaviour_log_prob(new, recorded, stale=staleness == 1))
    print(f"trainer at version 1: fragment of version {version} is stale by {staleness}; "
          f"PPO ratio {ratio:.4f} (on-policy it would be exactly 1)")
    try:
        check_staleness(2, version, tcss_on=True)
    except AssertionError:
        print("a fragment two versions old is refused: the one-step bound holds")


if __name__ == "__main__":
    _demo()
