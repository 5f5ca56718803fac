"""The mechanisms' protocol pieces, each against what it must do, with fakes and an in-memory store.

No process group and no model: a torch.distributed HashStore stands in for the job's TCPStore (the same
atomic `add`), and plain callables stand in for the ranks. Each test names the bug it catches:
- the staleness bound (TCSS): a fragment two versions old is refused, with TCSS on or off, by
  async_policy.check_staleness, by Trainer.accumulate and by main.TrainerRank.train (catches a bound relaxed to 2);
- the stale budget j is per step and never exceeded; generate_ahead stops at the budget, when the new
  weights arrive and after the last step (catches a budget ignored, generating ahead past new weights);
- FragmentQueue claims contiguous group ranges, the last one cut at the batch end (catches an off-by-one
  claim, a claim past the end);
- any cut of the batch gives the same trajectories (catches fragment-local seeds or prompts);
- concat_fragments keeps group order and the header (catches TAG shares joined in the wrong order, a
  version and producer swapped when a fragment is rebuilt);
- GAP trains a fragment before the next one is received; the barrier after all of them (main.TrainerRank.run);
- dealt fragments: trainer k of K gets announcements k, k + K, ... (catches a fragment trained twice);
- the TSP lockstep protocol trains each announced fragment once and counts groups, not fragments;
- TAG's assisted generation generates each claimed trajectory exactly once, at its global index,
  split over the trainers by trajectories, advantages only after the join;
- TAG's leader (tag.Assistant) on scripted times: no claim before both sides are measured, then the predictor
  sees the queue's counts and the measured times as they are (catches groups in flight counted as waiting, TAG's
  own claims counted as the rollout's, the publish time ignored before a publish) and its share is claimed;
- a non-finite step is skipped, and too many in a row abort.

Run: python -m pytest -q tests/test_protocol.py
"""
import datetime
import random
import threading
import types
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

import async_policy
import gap
import grpo
import tag
import tsp
import comm
import config
from conftest import trainer_rank_of
from fragment import Fragment, concat_fragments, fragment_spec
from trainer import TrainConfig, Trainer


def nothing(*args) -> None:
    """A hook that does nothing."""

pytestmark = pytest.mark.timeout(60)


# --- TCSS: the staleness bound ------------------------------------------------------------------------
def test_check_staleness_allows_0_or_1_with_tcss_and_only_0_without():
    assert async_policy.check_staleness(5, 5, tcss_on=False) == 0
    assert async_policy.check_staleness(5, 5, tcss_on=True) == 0
    assert async_policy.check_staleness(5, 4, tcss_on=True) == 1
    for trainer_version, fragment_version, tcss_on in [(5, 4, False), (5, 3, True), (5, 3, False), (4, 5, True)]:
        with pytest.raises(AssertionError, match="staleness"):
            async_policy.check_staleness(trainer_version, fragment_version, tcss_on)


class OneWeightPolicy:
    """The smallest policy a Trainer accepts: velocity = theta (one learnable vector)."""

    def __init__(self, dim=4):
        self.transformer = torch.nn.Module()
        self.transformer.theta = torch.nn.Parameter(torch.zeros(dim))
        self.device = torch.device("cpu")

    def velocity(self, latents, sigma, cond, transformer=None, cfg=True, detach_uncond=False):  # no CFG
        return self.transformer.theta.expand_as(latents)  # [B, dim]


def _fragment(version, m=2, t_train=2, dim=4, advantages=None):
    g = torch.Generator().manual_seed(0)
    return Fragment(step=version, first_group=0, policy_version=version, producer=0, group_size=2,
                    prompt_ids=torch.zeros(m, dtype=torch.long), cond={"e": torch.zeros(m, 1)},
                    latents=torch.randn(m, t_train, dim, generator=g),
                    next_latents=torch.randn(m, t_train, dim, generator=g),
                    timestep_index=torch.arange(t_train).repeat(m, 1), sigmas=torch.full((m, t_train), 0.8),
                    sigmas_next=torch.full((m, t_train), 0.6), log_probs=torch.zeros(m, t_train),
                    rewards=torch.linspace(0, 1, m), reward_parts=torch.zeros(m, 1),
                    advantages=torch.linspace(-1, 1, m) if advantages is None else advantages)


def _trainer(version, **kw):
    trainer = Trainer(OneWeightPolicy(), TrainConfig(noise_level=0.7, **kw))
    trainer.version = version
    return trainer


def _packs(fragment):
    packs = tsp.per_timestep_packs(*fragment.latents.shape[:2])
    return packs, [[1.0] * len(p) for p in packs]


def test_the_trainer_refuses_a_fragment_two_versions_old_and_trains_one_version_old():
    trainer = _trainer(version=3)
    with pytest.raises(AssertionError, match="staleness 2"):
        trainer.accumulate(_fragment(version=1), *_packs(_fragment(1)), total_pairs=4)
    assert trainer.params[0].grad is None  # refused before any backward
    trainer.accumulate(_fragment(version=2), *_packs(_fragment(2)), total_pairs=4)  # TCSS: one version old
    assert trainer.metrics.sums["pairs_stale"] == 4


def test_the_trainer_rank_refuses_a_stale_fragment_without_tcss():
    """main.TrainerRank.train checks the bound before it counts or trains (catches the check dropped there)."""
    trainer = _trainer(version=3)
    fragment = _fragment(version=2)
    cfg = config.Config(prompts_per_step=1, group_size=2, num_steps=3, updates_per_batch=1, use_tcss=False)
    with pytest.raises(AssertionError, match="staleness 1"):
        trainer_rank_of(cfg, trainer).train(fragment)
    assert "trajectories" not in trainer.metrics.sums  # refused before it was counted or trained
    trainer_rank_of(config.Config(prompts_per_step=1, group_size=2, num_steps=3, updates_per_batch=1,
                                  use_tcss=True), trainer).train(fragment)
    assert trainer.metrics.sums["stale_fragments"] == 1


def test_a_non_finite_step_is_skipped_and_too_many_in_a_row_abort():
    trainer = _trainer(version=0, optimizer="sgd", lr=1.0, max_bad_steps=2)
    nan = _fragment(0, advantages=torch.tensor([float("nan"), 1.0]))
    trainer.accumulate(nan, *_packs(nan), total_pairs=4)
    metrics = trainer.step(["c"])
    assert metrics["skipped_step"] == 1 and torch.equal(trainer.params[0], torch.zeros(4))
    assert trainer.version == 1  # a skipped step still ends the batch: the next fragments are version 1
    good = _fragment(1)
    trainer.accumulate(good, *_packs(good), total_pairs=4)
    assert trainer.step(["c"])["skipped_step"] == 0 and not torch.equal(trainer.params[0], torch.zeros(4))
    for version in (2, 3):
        nan = _fragment(version, advantages=torch.tensor([float("nan"), 1.0]))
        trainer.accumulate(nan, *_packs(nan), total_pairs=4)
        if version == 2:
            assert trainer.step(["c"])["bad_steps_in_a_row"] == 1
    with pytest.raises(FloatingPointError, match="--max-bad-steps 2"):
        trainer.step(["c"])


# --- TCSS: the stale budget and generate-ahead ---------------------------------------------------------
def test_the_stale_budget_is_j_per_step():
    budget = async_policy.StaleBudget(dist.HashStore(), max_stale=2)
    assert [budget.take(1) for _ in range(4)] == [True, True, False, False]
    assert [budget.take(2) for _ in range(3)] == [True, True, False]  # a new step has its own j
    budget.forget(1)
    assert budget.take(1)  # the key was deleted (the store must not grow per step)
    none = async_policy.StaleBudget(dist.HashStore(), max_stale=0)
    assert not any(none.take(1) for _ in range(3))


def _ahead(step, last_step, versions, budget, unclaimed=10):
    """Run generate_ahead with fakes: `versions` is what latest_version() returns call after call."""
    made, versions, left = [], list(versions), [unclaimed]

    def latest_version():
        return versions.pop(0) if len(versions) > 1 else versions[0]

    def claim(s):
        if left[0] == 0:
            return None
        left[0] -= 1
        return (10 - left[0] - 1, 1)

    count = async_policy.generate_ahead(step, last_step, latest_version, budget.take, claim,
                                        lambda s, c: made.append((s, c)))
    assert count == len(made)
    return made


def test_generate_ahead_stops_at_the_budget_at_new_weights_and_after_the_last_step():
    made = _ahead(3, 10, [3], async_policy.StaleBudget(dist.HashStore(), 2))
    assert made == [(4, (0, 1)), (4, (1, 1))]  # batch step + 1, never more than j fragments
    made = _ahead(3, 10, [3, 4], async_policy.StaleBudget(dist.HashStore(), 5))
    assert made == [(4, (0, 1))]  # version 4 arrived after one fragment: the rest is generated fresh
    assert _ahead(3, 10, [4], async_policy.StaleBudget(dist.HashStore(), 5)) == []
    assert _ahead(10, 10, [10], async_policy.StaleBudget(dist.HashStore(), 5)) == []  # no step 11
    assert len(_ahead(3, 10, [3], async_policy.StaleBudget(dist.HashStore(), 5), unclaimed=1)) == 1


# --- GAP: claims, specs, fragments, consumption ---------------------------------------------------------
def test_claims_are_contiguous_group_ranges_cut_at_the_batch_end():
    queue = gap.FragmentQueue(dist.HashStore(), groups_per_step=7)
    assert [queue.claim(0, 3) for _ in range(4)] == [(0, 3), (3, 3), (6, 1), None]
    assert queue.num_claimed_samples(0) == 7  # group size 1: trajectories are groups
    assert queue.claim(1, 2) == (0, 2) and queue.claim(1, 1) == (2, 1) and queue.num_claimed_samples(1) == 3
    seq, dst = queue.announce(1, 0, 2, producer=4, destinations=[10, 11])
    assert (seq, dst) == (0, 10) and queue.num_announced_samples(1) == 2
    assert queue.poll(1, 0) == gap.Announcement(4, 0, 2, 10) and queue.poll(1, 1) is None
    # the trainers in turn (main.py's rollout without TSP): the next announcement goes to the next one
    assert queue.announce(1, 2, 1, producer=4, destinations=[10, 11]) == (1, 11)
    assert queue.announce(1, 3, 1, producer=4, destinations=[10, 11]) == (2, 10)
    assert queue.poll(1, 1) == gap.Announcement(4, 2, 1, 11) and queue.num_announced_samples(1) == 4
    queue.forget(1)
    assert queue.claim(1, 2) == (0, 2)  # forgotten: the step starts from scratch
    queue = gap.FragmentQueue(dist.HashStore(), groups_per_step=4, group_size=3)  # the counter counts trajectories
    assert queue.claim(0, 1) == (0, 1) and queue.claim_samples(0, 6) == (1, 2) and queue.num_claimed_samples(0) == 9
    with pytest.raises(ValueError, match="not whole groups of 3"):
        queue.claim_samples(0, 4)  # TAG claims whole groups only
    assert queue.claim(0, 2) == (3, 1) and queue.claim(0, 1) is None and queue.claim_samples(0, 3) is None


def test_claims_racing_on_a_real_tcpstore_never_overlap_and_cover_the_batch():
    """Six claimers (five rollout ranks, one TAG leader) on their own TCPStore clients race for 20 steps: every
    trajectory is claimed exactly once, in whole groups. Catches claims that read the counter and write it back
    non-atomically (an add after a get, a compare-and-set whose value two claimers can both write).
    (Moved from tests/test_part_claims.py when claims of part of a group were removed.)"""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    groups, g, steps = 40, 3, 20
    taken, errors = [], []

    def claimer(kind: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))
        queue = gap.FragmentQueue(dist.PrefixStore("queue", store), groups, group_size=g)
        rng = random.Random(kind)
        try:
            for step in range(steps):
                while True:
                    claim = queue.claim_samples(step, g * rng.randint(1, 3)) if kind == 0 else queue.claim(step, 2)
                    if claim is None:
                        break
                    if kind and claim.num_groups > 2:
                        errors.append(f"rollout claim {claim} holds more than its fragment")
                    taken.append((step, claim.first_group * g, (claim.first_group + claim.num_groups) * g))
        except Exception as error:  # noqa: BLE001  (reported to the main thread)
            errors.append(repr(error))

    threads = [threading.Thread(target=claimer, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)  # about 0.2 s here; a claim that never succeeds spins (daemon: the test ends)
    assert not any(t.is_alive() for t in threads), "a claimer is stuck (a claim that can never succeed)"
    assert not errors, errors
    for step in range(steps):
        covered = sorted(t for s, lo, hi in taken if s == step for t in range(lo, hi))
        assert covered == list(range(groups * g)), f"step {step}: trajectories claimed twice or never"


def test_any_cut_of_the_batch_gives_the_same_trajectories():
    whole = fragment_spec(7, 3, 0, 6, num_prompts_total=5, groups_per_step=6, group_size=3)
    for cut in ([1] * 6, [2, 2, 2], [4, 2], [3, 1, 2]):
        first, parts = 0, []
        for n in cut:
            parts.append(fragment_spec(7, 3, first, n, 5, 6, 3))
            first += n
        for field in ("prompt_ids", "init_seeds", "noise_seeds"):
            assert sum((getattr(p, field) for p in parts), []) == getattr(whole, field), (cut, field)
    assert len(set(whole.noise_seeds + whole.init_seeds)) == 36  # every trajectory has its own seeds
    other_step = fragment_spec(7, 4, 0, 6, 5, 6, 3)
    assert not set(other_step.noise_seeds) & set(whole.noise_seeds)


def _numbered_fragment(first_group, num_groups, group_size=2):
    m = num_groups * group_size
    rows = torch.arange(first_group * group_size, first_group * group_size + m, dtype=torch.float32)  # [m]
    f = _fragment(0, m=m)
    f.first_group, f.prompt_ids, f.advantages, f.rewards = first_group, rows.long(), rows, rows
    f.cond = {"e": rows[:, None]}
    f.latents = rows[:, None, None].expand(m, 2, 4).clone()
    return f


def test_concat_and_to_keep_group_order_and_every_header_field():
    parts = [_numbered_fragment(3, 1), _numbered_fragment(4, 2), _numbered_fragment(6, 1)]
    for part in parts:
        part.step, part.policy_version, part.producer = 9, 7, tag.TAG_PRODUCER
    whole = concat_fragments(parts)
    # (step, first_group, policy_version, producer, group_size, offset): a swapped field would mislabel the version
    header = (whole.step, whole.first_group, whole.policy_version, whole.producer, whole.group_size, whole.offset)
    assert header == (9, 3, 7, -2, 2, 0)
    assert whole.to("cpu").ints() == whole.ints() == list(header)
    assert whole.num_groups == 4
    assert whole.rewards.tolist() == list(range(6, 14)) and whole.cond["e"][:, 0].tolist() == list(range(6, 14))
    assert whole.latents[:, 0, 0].tolist() == list(range(6, 14))


def test_gap_trains_each_fragment_as_it_arrives_and_the_barrier_after_all():
    """main.TrainerRank.run on a trainer rank (catches GAP waiting for the whole batch, the barrier streaming, a
    publish before the optimizer step or before the step's end)."""
    for gap_on, want in [(True, ["publish 0", "recv 0", "train 0", "recv 1", "train 1", "step", "publish 1", "end"]),
                         (False, ["publish 0", "recv 0", "recv 1", "train 0", "train 1", "step", "publish 1", "end"])]:
        events = []

        def arrivals(step):
            for i in range(2):
                events.append(f"recv {i}")
                yield _numbered_fragment(i, 1)
        books = types.SimpleNamespace(optimizer_step=lambda step: events.append("step") or {},
                                      update=lambda step: events.append("update"),
                                      end_step=lambda step, metrics: events.append("end"))
        trainer = types.SimpleNamespace(current_version=lambda: events.count("step"))
        cfg = config.Config(prompts_per_step=2, group_size=2, updates_per_batch=1, gap=gap_on)
        rank = trainer_rank_of(cfg, trainer, books, groups=comm.Groups(1, 2, [0], [1]))
        rank.fragments, rank.train = arrivals, lambda f: events.append(f"train {f.first_group}")
        rank.publisher = types.SimpleNamespace(publish=lambda version: events.append(f"publish {version}"),
                                               stop=lambda: events.append("stop"))
        rank.run()
        assert events == [*want, "stop"]


def test_dealt_fragments_give_each_announcement_to_exactly_one_trainer():
    queue = gap.FragmentQueue(dist.HashStore(), groups_per_step=5)
    for seq in range(5):
        queue.announce(0, seq, 1, producer=0)
    got = {k: list(gap.dealt_fragments(queue, 0, 5, k, 2, lambda a: ("received", a.first_group)))
           for k in range(2)}
    assert [x for x in got[0] if isinstance(x, tuple)] == [("received", g) for g in (0, 2, 4)]
    assert [x for x in got[1] if isinstance(x, tuple)] == [("received", g) for g in (1, 3)]
    # the other trainer's announcements come through as they are: which groups are in, in sequence order
    assert [x.first_group for x in got[0] if isinstance(x, gap.Announcement)] == [1, 3]
    assert [x.first_group if isinstance(x, gap.Announcement) else x[1] for x in got[1]] == [0, 1, 2, 3, 4]


# --- TSP: the lockstep protocol; TAG: assisted generation ------------------------------------------------
def test_lockstep_trains_each_announced_fragment_once_and_counts_trajectories():
    commands = [(tsp.TRAIN, 0, 0), (tsp.PRODUCE, 8, 10), (tsp.TRAIN, 1, 0), (tsp.TRAIN, 2, 0)]
    asked = []

    def next_command(next_seq, samples_done):
        asked.append((next_seq, samples_done))
        return commands[len(asked) - 1]

    announced = {0: _numbered_fragment(0, 2), 1: _numbered_fragment(2, 2), 2: _numbered_fragment(5, 1)}
    got = list(tsp.lockstep_fragments(12, True, next_command, share_command=lambda c: c,
                                      receive=announced.__getitem__, share_fragment=lambda f: f,
                                      produce=lambda lo, hi: _numbered_fragment(lo // 2, (hi - lo) // 2)))
    assert [f.first_group for f in got] == [0, 4, 2, 5]  # each announced fragment once, TAG's groups in between
    assert asked == [(0, 0), (1, 4), (1, 6), (2, 10)]  # asked with the next sequence and trajectories done
    # a non-leader follows the leader's commands and never receives from the rollout itself
    follower = tsp.lockstep_fragments(12, False, None, share_command=lambda c: commands[0], receive=None,
                                      share_fragment=lambda f: announced[0], produce=None)
    assert next(follower) is announced[0]


def _numbered_rows(first_group, lo, hi, group_size=3):
    """Trajectories [lo, hi) of the groups from first_group as a part: row = global index."""
    whole = _numbered_fragment(first_group, -(-hi // group_size), group_size)
    part = Fragment.from_parts(whole.ints(), {k: v[lo:hi] for k, v in whole.tensors().items()})
    part.group_size, part.advantages = group_size, part.advantages * float("nan")  # not computed
    return part


def test_assisted_generation_generates_each_claimed_trajectory_once_at_its_global_index():
    """TAG by trajectories (G = 3): catches a share generated at its index within the claim instead
    of the batch, a trajectory generated twice or never, parts joined out of order, and advantages
    taken before the parts are joined (a part of a group has no advantages)."""
    for trainers, num_groups in [(1, 3), (2, 3), (3, 5), (4, 1), (4, 2)]:
        generated, parts = [], {}

        def generate(lo, hi):
            generated.append((lo, hi))
            return _numbered_rows(5, lo - 15, hi - 15)

        def keep(part, owner):
            if part is not None:
                parts[owner] = part

        for me in range(trainers):  # every trainer generates its share (the exchange comes next)
            tag.assisted_generation(15, 15 + 3 * num_groups, trainers, me, generate, keep,
                                    join=lambda shares: None, lockstep=False)
        covered = sorted(t for lo, hi in generated for t in range(lo, hi))
        assert covered == list(range(15, 15 + 3 * num_groups)), (trainers, generated)
        sizes = {hi - lo for lo, hi in generated}
        assert max(sizes) - min(sizes) <= 1  # the floor or the ceiling each: none idles a group
        if num_groups * 3 % trainers:
            assert any(lo % 3 for lo, hi in generated)  # some group is split over trainers

        def join(shares):
            whole = concat_fragments(shares)
            assert whole.num_samples == 3 * num_groups  # advantages only for whole groups
            mean = whole.rewards.reshape(-1, 3).mean(1).repeat_interleave(3)
            whole.advantages = whole.rewards - mean
            return whole

        for me in range(trainers):  # the exchange: every trainer ends with the whole, in order
            whole = tag.assisted_generation(15, 15 + 3 * num_groups, trainers, me,
                                            lambda lo, hi: parts[me],
                                            lambda part, owner: parts[owner], join, lockstep=False)
            assert whole.first_group == 5 and whole.num_groups == num_groups
            assert whole.rewards.tolist() == list(range(15, 15 + 3 * num_groups))
            assert whole.advantages.tolist() == [-1.0, 0.0, 1.0] * num_groups


# --- TAG's leader on scripted times -------------------------------------------------------------------
def test_a_joined_tag_claim_gets_its_group_advantages_and_a_rollout_fragment_passes_as_it_is():
    """tag.with_advantages on the trainers: catches a TAG claim trained without advantages (NaN in the loss) and a
    rollout fragment's advantages recomputed (or replaced). (The whole-fragment half of tests/test_part_claims.py's
    test_whole_fragments_pass_as_they_are_and_a_group_of_two_versions_is_refused, kept.)"""
    rollout_fragment = _numbered_fragment(0, 2, 3)
    joined = _numbered_fragment(2, 1, 3)
    joined.advantages = joined.advantages * float("nan")  # generated in shares: no advantages yet

    def complete(fragment):
        r = fragment.rewards.reshape(-1, 3)  # groups of 3
        fragment.advantages = (r - r.mean(1, keepdim=True)).reshape(-1)
        return fragment

    out = list(tag.with_advantages([rollout_fragment, joined], complete))
    assert out[0] is rollout_fragment and out[1].advantages.tolist() == [-1.0, 0.0, 1.0]


def test_the_assistant_hands_the_predictor_the_queues_counts_and_scripted_times(monkeypatch):
    counts = {"claimed": 0, "announced": 0}
    claims = []

    G = 3  # the queue counts trajectories; the predictor decides in groups

    def claim(step, n):
        first = counts["claimed"]
        counts["claimed"] += n
        claims.append((step, first, n))
        return gap.Claim(first // G, n // G)

    rollout_gen = {"s": None}
    assistant = tag.Assistant(groups_per_step=8, fragment_groups=2, rollout_ranks=1, trainers=2, quantum=2,
                              claim=claim, claimed=lambda step: counts["claimed"],
                              announced=lambda step: counts["announced"], rollout_gen_s=lambda: rollout_gen["s"],
                              group_size=G)
    seen = []
    monkeypatch.setattr(tag, "assist_groups", lambda state, margin_s=0.0: seen.append(state) or 2)
    assistant.trained_trajectories(4 * G, 0.08)  # 0.02 s per group
    assert not assistant.consider(3, 0) and not seen  # no rollout rank has reported: no decision, no claim
    rollout_gen["s"] = 1.0  # a rollout rank reported 1 s per fragment of 2 groups
    assistant.train = tag.RunningMean()
    assert not assistant.consider(3, 0) and not seen  # training not measured yet (the trainers' generation may not be)
    assistant.trained_trajectories(4 * G, 0.08)
    assistant.published(0.25)
    counts.update(claimed=4 * G, announced=2 * G)  # the rollout rank: 4 groups claimed, 2 of them announced
    assert assistant.consider(3, 0, before_publish=True)
    assert claims == [(3, 4 * G, 2 * G)] and assistant.pending[3] == [(4 * G, 6 * G)] and assistant.taken[3] == 2 * G
    want = tag.StepState(unclaimed=4, in_flight=2, waiting=2, rollout_ranks=1, gen_rollout_s=1.0, gen_trainer_s=0.5,
                         train_s=0.02, fragment_groups=2, trainers=2, quantum=2, rollout_start_s=0.25,
                         trainer_start_s=0.25, group_size=G)
    assert asdict(seen[-1]) == pytest.approx(asdict(want))  # unmeasured trainer generation: a rollout group's time (1.0 / 2)
    # mid-step: no publish ahead (start 0); TAG's own 2 groups are neither in flight nor waiting; 2 of the 4 groups
    # done so far were TAG's, generated in 0.6 s by the 2 trainers (one group each)
    assistant.generated_trajectories(3, 2 * G, 0.6)
    counts.update(claimed=6 * G, announced=4 * G)
    assistant.consider(3, 4 * G)
    assert asdict(seen[-1]) == pytest.approx(asdict(tag.StepState(
        unclaimed=2, in_flight=0, waiting=2, rollout_ranks=1, gen_rollout_s=1.0, gen_trainer_s=0.6, train_s=0.02,
        fragment_groups=2, trainers=2, quantum=2, group_size=G)))
    # at a step boundary as inside: whole groups
    assistant.consider(4, 0, before_publish=True)
    assert seen[-1].group_size == G and claims[-1][2] == 2 * G


def test_loopback_data_plane_warning():
    """A multi-host job whose hostname resolves to 127.0.1.1 (stock Ubuntu) would bind gloo to loopback and hang at
    the first cross-host send: the warning must fire then, name GLOO_SOCKET_IFNAME, and stay quiet on one host or
    when the interface is pinned. Which ranks share a host is the host names the ranks posted (comm.gather_hosts),
    not the launcher's variables: under srun (no LOCAL_WORLD_SIZE) the check took 16 ranks on two hosts for one
    host and never warned, and torchrun --nnodes 2 on one host (LOCAL_WORLD_SIZE 1) warned of a loopback every
    rank could use."""
    import comm

    two_hosts = ["node1"] * 8 + ["node2"] * 8
    loopback = dict(resolve=lambda name: "127.0.1.1", hostname=lambda: "node1")
    for env in ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, {"WORLD_SIZE": "16"}):  # torchrun, srun
        message = comm.loopback_data_plane(env, two_hosts, **loopback)
        assert message is not None and "GLOO_SOCKET_IFNAME" in message and "127.0.1.1" in message
        assert "2 hosts (16 ranks)" in message
    emulated_nodes = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}  # torchrun --nnodes 2 on localhost
    assert comm.loopback_data_plane(emulated_nodes, ["node1", "node1"], **loopback) is None
    assert comm.loopback_data_plane({"GLOO_SOCKET_IFNAME": "eth0"}, two_hosts, **loopback) is None
    assert comm.loopback_data_plane({}, two_hosts, resolve=lambda name: "10.0.0.7", hostname=lambda: "node1") is None

    def unresolvable(name):
        raise OSError("Name or service not known")
    assert "does not resolve" in comm.loopback_data_plane({}, two_hosts, resolve=unresolvable,
                                                          hostname=lambda: "node1")


# --- several updates per batch: fixed minibatch boundaries whatever the arrival order -----------------------
def test_minibatch_bounds_are_contiguous_whole_groups():
    assert grpo.minibatch_bounds(4, 2) == [(0, 2), (2, 4)]
    assert grpo.minibatch_bounds(3, 2) == [(0, 1), (1, 3)]  # sizes within one group: the demo's B = 3
    assert grpo.minibatch_bounds(5, 1) == [(0, 5)]
    for bad in (0, 6):
        with pytest.raises(ValueError, match="--updates-per-batch"):
            grpo.minibatch_bounds(5, bad)
    part = _numbered_fragment(0, 4)
    assert grpo.minibatch_pairs(grpo.minibatch_bounds(3, 2), 2, 5, grpo.groups_of(part, 1, 3)) == 2 * 2 * 5


def test_minibatches_hold_later_parts_until_the_update_and_split_a_straddling_fragment():
    events = []

    def train(part):
        events.append(f"train {part.first_group}-{part.first_group + part.num_groups}")
        assert part.rewards.tolist() == list(range(2 * part.first_group, 2 * (part.first_group + part.num_groups)))

    arrivals = [_numbered_fragment(3, 1),  # minibatch 1 first: held
                gap.Announcement(producer=0, first_group=0, num_groups=1, destination=1),  # another trainer's
                _numbered_fragment(1, 2)]  # straddles: groups 1 (minibatch 0) and 2 (minibatch 1)
    grpo.train_in_minibatches(arrivals, [(0, 2), (2, 4)], train, lambda j: events.append(f"update {j}"))
    assert events == ["train 1-2", "update 0", "train 3-4", "train 2-3"]
    with pytest.raises(AssertionError, match="missing"):  # a step must not end with a minibatch untrained
        grpo.train_in_minibatches([_numbered_fragment(0, 1)], [(0, 1), (1, 2)], train, nothing)
    with pytest.raises(AssertionError, match="after its update"):
        grpo.train_in_minibatches([_numbered_fragment(0, 1), _numbered_fragment(0, 1)], [(0, 1), (1, 2)], train,
                                 nothing)


@pytest.mark.parametrize("old_log_prob", ["fresh", "rollout"])
def test_updates_inside_a_step_score_later_pairs_against_the_recorded_log_probs(old_log_prob):
    """With --old-log-prob fresh the first minibatch of a fresh step is on-policy (ratio 1); with rollout
    (Flow-GRPO's: train_sd3.py line 886 takes every ratio against sample["log_probs"]) it is scored against the
    rollout's recorded log-probs too (here 0, so its ratio is not 1). After an update the pairs are scored
    against the rollout's log-probs, so the ratio moves and the clip can act; the version moves once per RL
    step."""
    trainer = _trainer(version=0, optimizer="sgd", lr=1.0, old_log_prob=old_log_prob)
    first, later = _fragment(0), _fragment(0)
    trainer.accumulate(first, *_packs(first), total_pairs=4)
    on_policy = trainer.metrics.sums["ratio_mean_fresh"] == trainer.metrics.sums["pairs_fresh"]  # ratio 1
    assert trainer.metrics.sums["pairs_fresh"] > 0 and on_policy == (old_log_prob == "fresh")
    trainer.update()
    assert trainer.version == 0 and trainer.updates_in_step == 1
    trainer.accumulate(later, *_packs(later), total_pairs=4)
    assert trainer.metrics.sums["pairs_later"] == trainer.metrics.sums["pairs_fresh"]
    metrics = trainer.step(["c"])
    assert metrics["updates"] == 2 and trainer.version == 1 and trainer.updates_in_step == 0
    assert metrics["ratio_mean_later"] != 1.0  # scored against the recorded log-probs after the update
    assert metrics["update_kl"] > 0  # the weights moved on the pairs just trained


# --- TSP packs that span fragments ---------------------------------------------------------------------------
def _pairs_fragment(m, t_train, tag_value):
    return types.SimpleNamespace(latents=torch.zeros(m, t_train, 1), tag=tag_value)


def test_spanning_packs_deal_every_pair_once_with_equal_passes_and_pad_once_per_flush():
    """K = 3 trainers, pack 4, fragments of 2 x 3 = 6 pairs: per fragment that is 2 pairs per trainer padded to
    a whole pack (6 of 12 slots real); spanning, the packs fill across fragments and only the flush pads."""
    fragments = [_pairs_fragment(2, 3, i) for i in range(5)]
    streams = [tsp.PackStream(rank, 3, 4) for rank in range(3)]
    passes = [[] for _ in streams]
    for fragment in fragments:
        for rank, stream in enumerate(streams):
            passes[rank].append(stream.add(fragment))
    for rank, stream in enumerate(streams):
        passes[rank].append(stream.flush())
    # every trainer runs the same number of passes at every point (FSDP requires it)
    assert [[len(p) for p in mine] for mine in passes] == [[len(p) for p in passes[0]]] * 3
    real = [(item[0].tag, item[1]) for mine in passes for emitted in mine for items, mask in emitted
            for item, weight in zip(items, mask) if weight]
    every = [(i, (s, j)) for i in range(5) for j in range(3) for s in range(2)]
    assert sorted(real) == sorted(every) and len(real) == len(every)  # each pair once, on one trainer
    slots = sum(len(mask) for mine in passes for emitted in mine for _, mask in emitted)
    per_fragment = 5 * 3 * tsp.num_passes(2, 3, 3, 4) * 4
    assert slots == 36 < per_fragment == 60  # 30 real pairs: 6 padding slots, not 30
    assert all(not stream.waiting and stream.dealt == 0 for stream in streams)  # a flush starts a new stream


def test_spanning_packs_gather_pairs_of_several_fragments_in_order():
    a, b = _fragment(0, m=2), _fragment(0, m=2)
    b.latents = a.latents + 100
    batch = tsp.gather_spanning([(a, (1, 0)), (b, (0, 1)), (b, (1, 1))])
    assert torch.equal(batch["latents"], torch.stack([a.latents[1, 0], b.latents[0, 1], b.latents[1, 1]]))
    assert batch["cond"]["e"].shape[0] == 3
