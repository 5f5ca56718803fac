"""async_policy.generate_ahead and StaleBudget: TCSS's rule on a rollout rank, with stand-ins for the
store, the mailbox and the fragment queue (no processes; tests/test_placements.py runs it for real).

Also the grader of docs/COURSE.md assignment 3 (re-implement generate_ahead)."""
import pytest

import async_policy

pytestmark = pytest.mark.timeout(60)


class Store:
    """store.add / delete_key of a torch.distributed store, in memory."""

    def __init__(self):
        self.values = {}

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def delete_key(self, key):
        self.values.pop(key, None)


class Queue:
    """Claims of `fragment_groups` groups per call, as gap.FragmentQueue.claim does."""

    def __init__(self, groups_per_step, fragment_groups=1):
        self.groups, self.size, self.claimed = groups_per_step, fragment_groups, {}

    def claim(self, step):
        first = self.claimed.get(step, 0)
        if first >= self.groups:
            return None
        self.claimed[step] = first + self.size
        return first, min(self.size, self.groups - first)


def _rank(step=3, last_step=10, version=3, budget=2, groups=4, arrives_after=None, taken=None):
    """One rollout rank's call; returns (count returned, fragments produced, budget calls)."""
    produced, budget_calls = [], []
    state = {"version": version}
    stale = async_policy.StaleBudget(Store(), budget)

    def take(step):
        budget_calls.append(step)
        return (taken or stale.take)(step)

    def produce(step, claimed):
        produced.append((step, claimed))
        if arrives_after is not None and len(produced) >= arrives_after:
            state["version"] = step  # the new weights arrive while this fragment is generated
    queue = Queue(groups)
    made = async_policy.generate_ahead(step, last_step, lambda: state["version"], take, queue.claim, produce)
    return made, produced, budget_calls


def test_generates_up_to_the_budget_of_the_next_batch_with_the_held_weights():
    made, produced, budget_calls = _rank(budget=2)
    assert made == 2 and produced == [(4, (0, 1)), (4, (1, 1))]  # batch k + 1, its first claims
    assert set(budget_calls) == {4}  # the budget of batch k + 1 (the store key is per step)


def test_stops_as_soon_as_the_new_version_arrives():
    made, produced, _ = _rank(budget=3, arrives_after=1)
    assert made == 1 and produced == [(4, (0, 1))]


def test_nothing_when_the_weights_are_there_and_the_budget_is_left_alone():
    made, produced, budget_calls = _rank(version=4)
    assert made == 0 and produced == [] and budget_calls == []  # j is global: never waste it


def test_nothing_after_the_last_step():
    made, produced, budget_calls = _rank(step=10, last_step=10)
    assert made == 0 and produced == [] and budget_calls == []


def test_no_claim_without_budget():
    """A claim whose fragment is then not generated would leave its groups to nobody: the step
    would never end. So the budget is taken before the claim."""
    claims = []
    produced = []

    def claim(step):
        claims.append(step)
        return 0, 1
    made = async_policy.generate_ahead(3, 10, lambda: 3, lambda step: False, claim,
                                       lambda step, c: produced.append(c))
    assert made == 0 and claims == [] and produced == []


def test_stops_when_the_next_batch_is_claimed_by_others():
    made, produced, _ = _rank(budget=5, groups=2)
    assert made == 2 and [c for _, c in produced] == [(0, 1), (1, 1)]


def test_the_budget_is_global_over_ranks_and_per_step():
    store = Store()
    budget = async_policy.StaleBudget(store, 3)
    queue = Queue(groups_per_step=8)
    counts = [async_policy.generate_ahead(3, 10, lambda: 3, budget.take, queue.claim, lambda s, c: None)
              for _ in range(2)]  # two rollout ranks, one after the other
    assert sum(counts) == 3 and counts == [3, 0]
    assert budget.take(5) and not async_policy.StaleBudget(store, 0).take(6)  # j = 0: never stale
    budget.forget(4)
    assert "stale/4" not in store.values
