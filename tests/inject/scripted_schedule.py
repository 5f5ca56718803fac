"""Injected into a real run (tests/inject/sitecustomize.py, DIGENRL_TEST_INJECT=scripted_schedule): TAG and TCSS act
at scripted moments, so a test that needs a TAG fragment or a stale fragment gets one however fast or loaded the
machine is, and two runs of one seed make the same schedule (who generates which groups, with which weights).

- TAG's predictor (tag.assist_groups, unchanged) is fed scripted times instead of measured ones: a rollout rank
  generates a group in GEN_ROLLOUT_S, a trainer in GEN_TRAINER_S, training a group takes TRAIN_S and a publish
  PUBLISH_S. The trainers generate 5x faster than the rollout rank, so at a step boundary the predictor claims
  every group still unclaimed.
- The leader decides only right before it publishes (Assistant.consider with before_publish=True), never
  mid-step, where the counts it would see depend on how far the rollout rank has got.
- TCSS: with --tcss, before publishing version v the leader waits until the rollout rank's fragment of step v
  generated ahead (with version v - 1) is announced; the rollout rank cannot miss it (it generates ahead as soon
  as step v - 1 is all claimed, and version v, which would stop it, is what the leader holds back). TAG then
  claims the groups the stale fragment left, and the step trains the stale fragment first, then TAG's. In the
  steps listed in DIGENRL_SCRIPTED_NO_AHEAD (e.g. "2"), the rollout rank does not generate ahead and TAG does
  not claim: the rollout rank generates that step, as in the first step of a run resumed there.

Needs one rollout rank (R = 1) and, with --tcss, --max-stale-fragments >= 1.
"""
import os
import time

import async_policy
import tag
from infra import bookkeeping

GEN_ROLLOUT_S, GEN_TRAINER_S, TRAIN_S, PUBLISH_S = 0.5, 0.1, 0.01, 0.05
NO_AHEAD = {int(s) for s in os.environ.get("DIGENRL_SCRIPTED_NO_AHEAD", "").split(",") if s.strip()}
_tcss = {"on": False}  # whether the leader's run has TCSS on (read from its config when its bookkeeping is built)

_budget_take = async_policy.StaleBudget.take
_consider = tag.Assistant.consider
_bookkeeping_init = bookkeeping.Bookkeeping.__init__


def _bookkeeping_reads_the_config(self, cfg, *args, **kwargs):  # every trainer builds one, before TAG's Assistant
    _tcss["on"] = bool(cfg.use_tcss) and (cfg.max_stale_fragments or 0) > 0
    _bookkeeping_init(self, cfg, *args, **kwargs)


def _take(self, step):
    return step not in NO_AHEAD and _budget_take(self, step)


def _scripted_consider(self, step, groups_done, before_publish=False):
    if not before_publish:
        return False
    if _tcss["on"]:
        if step in NO_AHEAD:
            return False
        while self.announced(step) < self.fragment_groups * self.group_size:  # the fragment generated ahead
            time.sleep(0.001)
    self.rollout_gen_s = lambda: GEN_ROLLOUT_S * self.fragment_groups
    g = self.group_size  # the Assistant's estimates are per trajectory
    self.train.value, self.gen_trainer.value, self.publish.value = TRAIN_S / g, GEN_TRAINER_S / g, PUBLISH_S
    return _consider(self, step, groups_done, before_publish)


async_policy.StaleBudget.take = _take
bookkeeping.Bookkeeping.__init__ = _bookkeeping_reads_the_config
tag.Assistant.consider = _scripted_consider
