"""Injected into a real run (tests/inject/sitecustomize.py, DIGENRL_TEST_INJECT=scripted_part_claim): at step
PART_STEP the TAG leader claims part of a group, and a rollout rank generates the rest of it, whatever the
machine's speed.

- The leader claims nothing at step boundaries and, inside step PART_STEP, exactly once: as soon as the rollout
  rank has claimed its first fragment (the first FRAGMENT trajectories), the first trajectory after it
  (the real queue's claim_samples, as the real Assistant claims; the predictor is not asked).
- The rollout rank's next claim of that step waits until the leader's claim is in the store, so it is the rest
  of the split group (the real queue's rule: a rollout claim ends on a group boundary).

Needs one rollout rank, --tag --tag-part-groups, and no TCSS (a boundary claim is whole groups anyway).
"""
import time

import gap
import tag

PART_STEP = 1
_KEY = "scripted_part_claim/{}"
_claim = gap.FragmentQueue.claim


def _scripted_consider(self, step, samples_done, before_publish=False):
    if before_publish or step != PART_STEP or self.taken[step]:
        return False
    while self.claimed(step) == 0:  # the rollout rank's first claim
        time.sleep(0.001)
    claimed = self.claim(step, 1)
    first, count, *part = claimed
    g = self.group_size
    lo = first * g + (part[0][0] if part else 0)
    self.pending[step].append((lo, lo + 1))
    self.taken[step] += 1
    _store["queue"].store.set(_KEY.format(step), "claimed")
    return True


def _scripted_claim(self, step, num_groups):
    if step == PART_STEP and self.num_claimed_samples(step) > 0:  # the rollout rank's later claims
        while not self.store.check([_KEY.format(step)]):
            time.sleep(0.001)
    return _claim(self, step, num_groups)


_store = {}
_init = gap.FragmentQueue.__init__


def _remember(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    _store["queue"] = self


gap.FragmentQueue.__init__ = _remember
gap.FragmentQueue.claim = _scripted_claim
tag.Assistant.consider = _scripted_consider
