"""Flow-GRPO's batch-level advantages in the runtime (flowgrpo/batch_rewards.py, main.TrainerRank.train_batch):

- the trainer loop and the colocated loop train exactly the advantages of Flow-GRPO's own code (the
  PerPromptStatTracker and train_sd3.py block re-typed in tests/test_advantages.py, from
  yifan123/flow_grpo flow_grpo/stat_tracking.py and scripts/train_sd3.py) on a fixed reward table
  with several prompts, prompts repeated over groups, global_std on and off;
- the store exchange: fragments posted by 3 producers in any order and restated on a trainer that
  holds only some of them equal the one-process computation, bit for bit; forget leaves no key
  behind;
- the guard for collapsed groups drops or floors them as config.py says;
- validation names the bad value;
- a one-step run of main.py with batch statistics, dealt over 2 trainers (the store path), makes the
  same update as the one-process run (the local path) on a batch whose prompts repeat.

Run: python -m pytest -q tests/test_batch_rewards.py
"""
import dataclasses
import os
import random
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from flowgrpo import batch_rewards
import cli
import config
import comm
import grpo
import models
import rewards
from conftest import checkpoint_weights, read_metrics, run_forked, trainer_rank_of
from fragment import Fragment
from test_advantages import flow_grpo_train_sd3_advantages

pytestmark = pytest.mark.timeout(600)
G = 4
# 6 groups of 4 over 4 prompts: red and blue twice (their groups pool), grey's rewards all equal
# (collapsed), cat's spread 0.007 (near-collapsed: normalised, its noise becomes unit advantages)
PROMPTS = ["red", "blue", "red", "grey", "cat", "blue"]
IDS = {"red": 0, "blue": 1, "grey": 2, "cat": 3}
CUT = [(0, 2), (2, 1), (3, 3)]  # the batch's fragments: (first group, groups)


def _table(seed: int = 0) -> torch.Tensor:
    """The batch's rewards [6 G] in group order."""
    g = torch.Generator().manual_seed(seed)
    rows = {"red": lambda: torch.rand(G, generator=g),
            "blue": lambda: torch.rand(G, generator=g) - 1,
            "grey": lambda: torch.full((G,), 0.25),
            "cat": lambda: 0.6 + 0.007 * torch.randn(G, generator=g)}
    return torch.cat([rows[p]() for p in PROMPTS])


def _fragment(rewards: torch.Tensor, first: int, count: int, step: int = 0) -> Fragment:
    """Groups [first, first + count) of the batch, advantages per group (as rollout makes them)."""
    r = rewards[first * G:(first + count) * G]
    m, z = r.numel(), torch.zeros
    ids = torch.tensor([IDS[p] for p in PROMPTS[first:first + count] for _ in range(G)])
    return Fragment(step=step, first_group=first, policy_version=0, producer=first,
                    group_size=G, prompt_ids=ids, cond={}, latents=z(m, 1, 2),
                    next_latents=z(m, 1, 2), timestep_index=z(m, 1, dtype=torch.long),
                    sigmas=z(m, 1), sigmas_next=z(m, 1),
                    log_probs=z(m, 1), rewards=r, reward_parts=r[:, None],
                    advantages=grpo.group_advantages(r, G))


def _cfg(**kw) -> config.Config:
    return config.Config(group_size=G, prompts_per_step=len(PROMPTS), **{"minibatches": "groups", **kw})


def _rewards_of(cfg, store=None) -> batch_rewards.BatchRewards:
    return batch_rewards.BatchRewards(store, len(PROMPTS), G, batch_rewards.run_advantages(cfg),
                                      poll_s=0.001)


def _trained(fragments: dict[int, torch.Tensor]) -> torch.Tensor:
    """The advantages the loop trained, in group order [6 G]."""
    return torch.cat([fragments[first] for first in sorted(fragments)])


def _rank(cfg, batch, fragments, trained, colocated=False):
    """main.TrainerRank on a trainer rank receiving `fragments` (or a colocated rank generating its share
    from the reward table), recording the advantages each fragment is trained with."""
    groups = comm.Groups(0, 1, [0], [0]) if colocated else comm.Groups(1, 2, [0], [1])
    books = types.SimpleNamespace(optimizer_step=lambda step: {}, update=lambda step: None,
                                  end_step=lambda step, metrics: None)
    rank = trainer_rank_of(cfg, types.SimpleNamespace(current_version=lambda: 0), books, batch, groups,
                           generate=lambda step, ranges, version, producer: [
                               _fragment(_table(2), first, count, step) for first, count in ranges])
    rank.fragments = lambda step: iter(fragments)
    rank.train = lambda f: trained.__setitem__(f.first_group, f.advantages)
    return rank


@pytest.mark.parametrize("global_std", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_trainer_loop_trains_flow_grpos_advantages(global_std, seed):
    """Catches: restate not called (per-group advantages trained), called per fragment (a prompt's
    two groups in different fragments would not pool), a fragment's slice of the batch off by a
    group, the fragments' arrival order leaking into the statistics, global_std ignored."""
    rewards = _table(seed)
    cfg = _cfg(per_prompt_stat_tracking=True, global_std=global_std)
    theirs, keep = flow_grpo_train_sd3_advantages([p for p in PROMPTS for _ in range(G)], rewards,
                                                  True, global_std)
    fragments = [_fragment(rewards, first, count) for first, count in CUT]
    random.Random(seed).shuffle(fragments)  # arrival order
    for streaming in (True, False):  # GAP and the naive barrier
        trained = {}
        on = dataclasses.replace(cfg, gap=streaming)
        _rank(on, _rewards_of(on), fragments, trained).run()
        torch.testing.assert_close(_trained(trained), theirs[:, 0].float(), rtol=1e-5, atol=1e-5)
    assert not keep.all()  # grey (all equal) is one Flow-GRPO drops: here its advantages are 0 too
    assert float(_trained(trained)[~keep].abs().max()) == 0
    per_group = torch.cat([_fragment(rewards, f, c).advantages for f, c in CUT])
    assert float((per_group - theirs[:, 0]).abs().max()) > 0.1  # pooling / global std changed them
    trained = {}  # without the hook the loop trains what the fragments carry: per group
    _rank(cfg, None, fragments, trained).run()
    torch.testing.assert_close(_trained(trained), per_group)


def test_batch_wide_statistics_and_the_colocated_loop():
    """--no-per-prompt-stat-tracking is train_sd3.py's else-branch (one mean and std); the colocated
    loop restates its generated share before training it."""
    rewards = _table(2)
    theirs, _ = flow_grpo_train_sd3_advantages(PROMPTS, rewards, False, False)  # prompts unused
    trained = {}
    cfg = _cfg(per_prompt_stat_tracking=False, mode="colocated", fragment_groups=4)  # calls of 4 and 2 groups
    _rank(cfg, _rewards_of(cfg), [], trained, colocated=True).run()
    assert sorted(trained) == [0, 3, 4]  # groups 0-3 and 4-5 generated; M = 2 cuts the first at group 3
    torch.testing.assert_close(_trained(trained), theirs[:, 0].float(), rtol=1e-5, atol=1e-5)


class _NoStore:
    def __getattr__(self, name):
        raise AssertionError(f"the store was used ({name}), the trainer holds the whole batch")


def test_the_store_exchange_equals_the_one_process_computation():
    """Three producers post their fragments from threads in a shuffled order, after a delay, while
    a trainer that holds only fragment 1 waits; it restates exactly what one process holding the
    whole batch computes. A trainer holding the whole batch never touches the store. Catches: the
    wait not waiting (a KeyError or missing groups), rewards rounded on the way (JSON of float32
    values must be exact), the groups put together in arrival order, keys left behind."""
    rewards = _table(3)
    cfg = _cfg(per_prompt_stat_tracking=True, global_std=True, collapsed_std=0.01)
    fragments = [_fragment(rewards, first, count, step=5) for first, count in CUT]
    whole = _rewards_of(cfg, _NoStore()).restate(5, fragments)
    store = dist.HashStore()
    producers = _rewards_of(cfg, store)

    def produce(fragment, delay):
        time.sleep(delay)
        producers.post(fragment)
    order = [2, 0, 1]
    threads = [threading.Thread(target=produce, args=(fragments[i], 0.05 * (k + 1)))
               for k, i in enumerate(order)]
    for t in threads:
        t.start()
    mine = _rewards_of(cfg, store).restate(5, [fragments[1]])  # waits for the others' posts
    for t in threads:
        t.join()
    assert torch.equal(mine[0].advantages, whole[1].advantages)
    assert mine[0].first_group == 2 and torch.equal(mine[0].rewards, fragments[1].rewards)
    other = _rewards_of(cfg, store).restate(5, [fragments[2], fragments[0]])  # any subset/order
    assert torch.equal(other[0].advantages, whole[2].advantages)
    assert torch.equal(other[1].advantages, whole[0].advantages)
    assert not torch.equal(whole[1].advantages, fragments[1].advantages)  # restating changed them
    keys = store.num_keys()
    producers.forget(5)
    assert keys - store.num_keys() == len(PROMPTS)  # one key per group, all gone
    assert not store.check([f"5/{g}" for g in range(len(PROMPTS))])


def test_one_rank_without_the_whole_batch_is_an_error_not_a_hang():
    rewards = _table(0)
    with pytest.raises(RuntimeError, match=r"groups \[0, 1, 3, 4, 5\] are not in hand"):
        _rewards_of(_cfg(per_prompt_stat_tracking=True)).restate(0, [_fragment(rewards, 2, 1)])


@pytest.mark.parametrize("per_prompt", [None, True])
def test_the_guard_drops_or_floors_collapsed_groups(per_prompt):
    """--collapsed-std 0.05: drop zeroes grey's and cat's advantages and leaves the others
    unchanged; floor divides cat's by 0.05 + 1e-4 instead of its std 0.007. The default (0, drop)
    zeroes only the all-equal group. Per group (None, the rollout's path) and per prompt alike.
    Catches: the guard applied to every group, the threshold compared the wrong way, floor and drop
    swapped."""
    rewards = _table(4)
    ids = torch.tensor([IDS[p] for p in PROMPTS for _ in range(G)])
    prompt = [p for p in PROMPTS for _ in range(G)]
    grey = torch.tensor([p == "grey" for p in prompt])
    cat = torch.tensor([p == "cat" for p in prompt])

    def adv(**kw):
        return grpo.advantages(rewards, ids, G, per_prompt=per_prompt, **kw)
    plain = adv(collapsed_std=0.0)
    assert float(plain[grey].abs().max()) == 0 and float(plain[cat].abs().max()) > 0.8
    dropped = adv(collapsed_std=0.05, collapsed="drop")
    assert float(dropped[grey | cat].abs().max()) == 0
    torch.testing.assert_close(dropped[~(grey | cat)], plain[~(grey | cat)])
    floored = adv(collapsed_std=0.05, collapsed="floor")
    r = rewards[cat].double()
    torch.testing.assert_close(floored[cat], ((r - r.mean()) / (0.05 + 1e-4)).float())
    torch.testing.assert_close(floored[~cat], plain[~cat])  # real spreads (> 0.05) untouched
    with pytest.raises(ValueError, match="'clip' is not one of drop, floor"):
        adv(collapsed="clip")


def test_validation_names_the_bad_value():
    check = cli._check_advantages
    with pytest.raises(ValueError, match=r"--global-std needs --per-prompt-stat-tracking.*unset"):
        check(_cfg(global_std=True))
    with pytest.raises(ValueError, match=r"--global-std needs .*off"):
        check(_cfg(global_std=True, per_prompt_stat_tracking=False))
    with pytest.raises(ValueError, match="--collapsed-std must be a number >= 0.*got -0.1"):
        check(_cfg(collapsed_std=-0.1))
    with pytest.raises(ValueError, match="--collapsed-groups 'keep' is not one of drop, floor"):
        check(_cfg(collapsed_groups="keep"))
    with pytest.raises(ValueError, match="floor with --collapsed-std 0 floors nothing"):
        check(_cfg(collapsed_groups="floor"))
    check(_cfg(global_std=True, per_prompt_stat_tracking=True, collapsed_std=0.01,
               collapsed_groups="floor"))
    parsed = config.parse_args(["--per-prompt-stat-tracking", "--global-std", "--collapsed-std",
                                "0.02", "--collapsed-groups", "floor"])
    assert (parsed.per_prompt_stat_tracking, parsed.global_std, parsed.collapsed_std,
            parsed.collapsed_groups) == (True, True, 0.02, "floor")
    assert config.parse_args(["--no-per-prompt-stat-tracking"]).per_prompt_stat_tracking is False
    assert config.parse_args([]).per_prompt_stat_tracking is None


ONE_STEP = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--num-steps", "3",
            "--eval-every", "0", "--save-every", "1", "--seed", "3", "--timeout-s", "60",
            "--optimizer", "sgd", "--lr", "1", "--no-trace", "--noise-level", "0.7",
            "--fragment-groups", "1",
            "--per-prompt-stat-tracking", "--global-std"]


def test_a_dealt_run_with_batch_statistics_makes_the_one_process_update(tiny_cache, tmp_path):
    """Two prompts, 4 groups a step: each prompt is in the batch twice (fragment.fragment_spec permutes
    max(prompts, groups) indices modulo the prompts). Disaggregated with 2 trainers and no TSP, each
    trainer holds half the fragments and restates them from the store; its update (SGD, lr 1: minus
    the gradient) equals the one-process run's, which holds the whole batch, and differs from the
    per-group update. Catches: the flags not reaching the trainers, a trainer that trains its
    per-group advantages, or restates from the wrong groups' rewards, or hangs."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(rewards.color_prompts("train")[:2]) + "\n")
    common = [*ONE_STEP, "--prompt-file", str(prompts)]
    run_forked([*common, "--mode", "colocated", "--nproc", "1"], tmp_path, "one", tiny_cache)
    per_group = [a for a in common if a not in ("--per-prompt-stat-tracking", "--global-std")]
    run_forked([*per_group, "--mode", "colocated", "--nproc", "1"], tmp_path, "group", tiny_cache)
    run_forked([*common, "--placement", "disaggregated", "--gap", "--nproc", "3"], tmp_path, "dealt",
               tiny_cache)
    one, dealt, group = (checkpoint_weights(os.path.join(tmp_path, n), 1)
                         for n in ("one", "dealt", "group"))
    initial = _initial_weights()
    scale = max(float((one[k] - initial[k]).abs().max()) for k in one)
    assert scale > 0
    apart = max(float((one[k] - group[k]).abs().max()) for k in one)
    assert apart > 0.01 * scale  # batch statistics were in effect: not the per-group update
    for key in one:
        torch.testing.assert_close(dealt[key] - initial[key], one[key] - initial[key], rtol=1e-4,
                                   atol=1e-5 * scale + 1e-7)
    rows = read_metrics(os.path.join(tmp_path, "dealt"))
    assert len(rows) == 1 and rows[0]["trajectories"] == 8 and "collapsed_group_frac" in rows[0]


def _initial_weights() -> dict[str, torch.Tensor]:
    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    return {k: v.detach().clone() for k, v in policy.transformer.named_parameters()}
