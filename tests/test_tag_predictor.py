"""tag.assist_groups / predict_step_end: the group-granular TAG predictor, checked by hand."""
import pytest

import tag

pytestmark = pytest.mark.timeout(60)

# 4 groups left, 1 rollout rank claiming 2-group fragments (1.2 s each), the trainer group
# generates a group in 0.6 s and trains one in 0.06 s.
GEN_BOUND = tag.StepState(unclaimed=4, in_flight=0, waiting=0, rollout_ranks=1, gen_rollout_s=1.2,
                          gen_trainer_s=0.6, train_s=0.06, fragment_groups=2)


def test_predicted_step_end_by_hand():
    # n = 0: fragments arrive at 1.2 and 2.4, the last is trained by 2.52.
    # n = 1: trainer 0.6 + 0.06; rollout: 2 groups at 1.2, then the last 1 at 1.8 -> 1.86.
    # n = 2: trainer 1.2 + 0.12 = 1.32; the rollout's fragment (1.2) is trained next -> 1.44.
    # n = 3: the rollout's 1 group arrives at 0.6 but the trainer is generating until 1.98 -> 2.04.
    expected = [2.52, 1.86, 1.44, 2.04, 2.64]
    assert [tag.predict_step_end(GEN_BOUND, n) for n in range(5)] == pytest.approx(expected)
    assert tag.assist_groups(GEN_BOUND) == 2  # the balancing share, not "as much as possible"


def test_declines_when_training_is_the_bottleneck():
    train_bound = tag.StepState(unclaimed=6, in_flight=2, waiting=2, rollout_ranks=2,
                                gen_rollout_s=1.0, gen_trainer_s=0.5, train_s=2.0,
                                fragment_groups=2, trainers=2)
    assert tag.assist_groups(train_bound) == 0
    # a much slower trainer GPU for generation: decline too
    slow = tag.StepState(**{**GEN_BOUND.__dict__, "gen_trainer_s": 50.0})
    assert tag.assist_groups(slow) == 0


def test_claims_are_multiples_of_the_quantum_and_the_best_of_them():
    state = tag.StepState(unclaimed=10, in_flight=1, waiting=0, rollout_ranks=1, gen_rollout_s=4.0,
                          gen_trainer_s=2.0, train_s=0.1, trainers=2, quantum=2)
    n = tag.assist_groups(state)
    assert n > 0 and n % 2 == 0
    ends = {k: tag.predict_step_end(state, k) for k in range(0, 11, 2)}  # the naive reference
    assert ends[n] == min(ends.values())
    # a margin larger than the gain: no claim
    assert tag.assist_groups(state, margin_s=ends[0] - ends[n] + 1e-6) == 0
    # By hand, K = 2 trainers, quantum 2, three 1-group fragments of 2.0 s left, a group generated in 0.6 s on a
    # trainer and trained in 0.06 s. Claiming 3: ceil(3 / 2) = 2 group times, 1.2 + 0.18 = 1.38 s, the best of
    # all; but 3 is not a multiple of K (FSDP ranks would run different forwards). Claiming 2: 0.6 + 0.12, then
    # the rollout's group arrives at 2.0 and is trained by 2.06 s; claiming 0: 3 x 2.0 + 0.06 = 6.06 s.
    odd_best = tag.StepState(unclaimed=3, in_flight=0, waiting=0, rollout_ranks=1, gen_rollout_s=2.0,
                             gen_trainer_s=0.6, train_s=0.06, trainers=2, quantum=2)
    assert [tag.predict_step_end(odd_best, k) for k in range(4)] == pytest.approx([6.06, 4.06, 2.06, 1.38])
    assert tag.assist_groups(odd_best) == 2


def test_trainer_generation_time_split_by_groups_or_trajectories():
    by_groups = tag.StepState(**{**GEN_BOUND.__dict__, "trainers": 4})
    assert tag.tag_generation_s(by_groups, 1) == pytest.approx(0.6)  # 3 of 4 trainers idle
    assert tag.tag_generation_s(by_groups, 5) == pytest.approx(1.2)  # ceil(5 / 4) groups
    by_traj = tag.StepState(**{**by_groups.__dict__, "group_size": 8})
    assert tag.tag_generation_s(by_traj, 1) == pytest.approx(0.6 * 2 / 8)  # 2 trajectories each


def test_rollout_start_delays_idle_rollout_ranks_only():
    late = tag.StepState(**{**GEN_BOUND.__dict__, "rollout_start_s": 1.0})
    assert tag.predict_step_end(late, 0) == pytest.approx(3.52)
    assert tag.predict_step_end(late, 4) == pytest.approx(2.64)  # nothing left to the rollout


def test_fragment_units_still_work():
    # one unit = one fragment (the defaults): with many rollout ranks the last one is left to them
    assert tag.assist_groups(tag.StepState(1, 7, 0, 8, 5.0, 5.0, 1.0)) == 0
    assert tag.assist_groups(tag.StepState(0, 2, 0, 1, 5.0, 5.0, 1.0)) == 0  # nothing to claim
    assert tag.predict_step_end(GEN_BOUND, True) == tag.predict_step_end(GEN_BOUND, 1)


def _assistant(group_size):
    claims = []
    g = max(group_size, 1)  # the queue counts trajectories; the Assistant's estimates are per trajectory
    assistant = tag.Assistant(groups_per_step=2, fragment_groups=1, rollout_ranks=1, trainers=4,
                              quantum=1, claim=lambda step, n: claims.append(n // g) or (0, n // g),
                              claimed=lambda step: 0, announced=lambda step: 0,
                              rollout_gen_s=lambda: 1.0, group_size=group_size)
    assistant.train.update(0.05 / g)
    assistant.gen_trainer.update(1.0 / g)  # a group on one trainer takes as long as on the rollout rank
    return assistant, claims


def test_the_runtime_leader_costs_a_claim_split_by_trajectories():
    """By hand: 2 groups of G = 8 left, 1 rollout rank at 1 s per group, K = 4 trainers at 1 s per
    group on one trainer, 0.05 s to train a group. Split by trajectories, claiming both costs
    ceil(16 / 4) / 8 = 0.5 group times: 0.5 + 0.1 = 0.60 s, the best. By groups (3 trainers idle) a
    group costs 1 s either way: claim 1, end 1.10 s. Catches the leader handing the predictor no
    group size (costing the old split) and a measured trainer time not in the predictor's unit."""
    by_traj, claims = _assistant(8)
    state = by_traj.state(0, 0)
    assert state.group_size == 8 and state.quantum == 1
    ends = [tag.predict_step_end(state, n) for n in range(3)]
    assert ends == pytest.approx([2.05, 1.05, 0.60])
    assert by_traj.consider(0, 0) and claims == [2]
    by_groups, claims = _assistant(0)
    ends = [tag.predict_step_end(by_groups.state(0, 0), n) for n in range(3)]
    assert ends == pytest.approx([2.05, 1.10, 1.10])
    assert by_groups.consider(0, 0) and claims == [1]
    # measured: 2 groups in 0.5 s by 4 trainers is 4 trajectories each: 1 s per group on one trainer
    by_traj.gen_trainer = tag.RunningMean()
    by_traj.generated_trajectories(0, 16, 0.5)
    assert by_traj.gen_trainer.value * 8 == pytest.approx(1.0)
    assert tag.share_groups(1, 4, 8) == 0.25 and tag.share_groups(5, 4) == 2
    assert tag.share_groups(3, 2, 3) == 5 / 3


def test_trainer_start_delays_the_trainer_side_by_hand():
    """Grades assignment 2's `trainer_start_s` (docs/COURSE.md): the trainer group is busy (publishing) until then,
    so nothing is trained or generated by it before. Two groups left, one rollout rank at 1 s a group, trainers
    busy for 3 s: not claiming, the groups arrive at 1 and 2 s and train at 3.0-3.2 s; claiming both, the trainers
    generate them from 3 s (2 x 0.5 s) and train them: 4.2 s. A predictor that ignores trainer_start_s claims."""
    busy = tag.StepState(unclaimed=2, in_flight=0, waiting=0, rollout_ranks=1, gen_rollout_s=1.0,
                         gen_trainer_s=0.5, train_s=0.1, trainer_start_s=3.0)
    assert tag.predict_step_end(busy, 0) == pytest.approx(3.2)
    assert tag.predict_step_end(busy, 2) == pytest.approx(4.2)
    assert tag.assist_groups(busy) == 0
    idle = tag.StepState(**{**busy.__dict__, "trainer_start_s": 0.0})
    # idle trainers: generate one (0.5 s) and train it while the rollout makes the other (1.0 s), then train it
    assert tag.predict_step_end(idle, 1) == pytest.approx(1.1) and tag.assist_groups(idle) == 1
    waiting = tag.StepState(**{**busy.__dict__, "unclaimed": 0, "waiting": 2})
    assert tag.predict_step_end(waiting, 0) == pytest.approx(3.2)  # arrived work waits for the trainers too
