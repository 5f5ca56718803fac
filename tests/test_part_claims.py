"""TAG claims part of a group (--tag-part-groups, issue 25): the queue's compare-and-set claims in trajectories,
and the trainers joining parts back into whole groups (tag.whole_groups). The whole run (a real part claim, a
rollout rank generating the rest, the update unchanged) is tests/test_placements.py's
test_tag_claims_part_of_a_group_a_rollout_rank_the_rest_and_the_update_is_unchanged."""
import datetime
import random
import threading

import pytest
import torch
import torch.distributed as dist

import gap
import tag

pytestmark = pytest.mark.timeout(120)


def test_a_rollout_claim_after_a_part_claim_is_the_rest_of_the_group():
    queue = gap.FragmentQueue(dist.HashStore(), groups_per_step=4, group_size=3)
    first = queue.claim(0, 1)
    assert first == (0, 1) and first.part is None  # whole groups: as before
    assert queue.claim_samples(0, 4) == (1, 2, (0, 4))  # TAG: group 1 and the first member of group 2
    assert queue.num_claimed_samples(0) == 7
    rest = queue.claim(0, 1)  # a rollout rank of 1-group fragments: the rest of group 2
    assert (rest.first_group, rest.num_groups, rest.part) == (2, 1, (1, 3))
    assert queue.claim(0, 2) == (3, 1) and queue.claim(0, 1) is None and queue.claim_samples(0, 1) is None
    queue.forget(0)
    queue.claim_samples(0, 4)
    assert queue.claim(0, 2) == (1, 2, (1, 6))  # 2-group fragments: the rest of group 1 and group 2, 5 <= 6
    assert gap.claim_of(7, 9, 3) == (2, 1, (1, 3)) and gap.claim_of(3, 9, 3) == (1, 2)


def test_claims_racing_on_a_real_tcpstore_never_overlap_and_cover_the_batch():
    """Six claimers (five rollout ranks, one TAG leader) on their own TCPStore clients race for 20 steps: every
    trajectory is claimed exactly once, every rollout claim ends on a group boundary and holds at most its
    fragment's trajectories. Catches claims that read the counter and write it back non-atomically (an add
    after a get, a compare-and-set whose value two claimers can both write)."""
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
                    claim = queue.claim_samples(step, rng.randint(1, 5)) if kind == 0 else queue.claim(step, 2)
                    if claim is None:
                        break
                    lo, hi = _trajectories(claim, g)
                    if kind and (hi % g or hi - lo > 2 * g):
                        errors.append(f"rollout claim {claim} -> [{lo}, {hi})")
                    taken.append((step, lo, hi))
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


def _trajectories(claim: gap.Claim, g: int) -> tuple[int, int]:
    lo = claim.first_group * g
    return (lo, lo + claim.num_groups * g) if claim.part is None else (lo + claim.part[0], lo + claim.part[1])


def _rows(first_sample: int, count: int, g: int = 3, version: int = 0) -> gap.Fragment:
    """Trajectories [first_sample, first_sample + count) of a step, numbered: every tensor row = its index."""
    rows = torch.arange(first_sample, first_sample + count, dtype=torch.float32)  # [m]
    z = torch.zeros(count, 2)
    return gap.Fragment(0, first_sample // g, version, 0, g, rows.long(), {"e": rows[:, None]},
                        rows[:, None, None].expand(count, 2, 4).clone(), z[:, :, None].clone(), z.long(), z, z, z,
                        rows, rows[:, None], torch.full((count,), float("nan")), offset=first_sample % g)


def _complete(fragment: gap.Fragment) -> gap.Fragment:
    """The group advantages, in short (rollout.with_advantages in the runtime): reward minus the group mean."""
    assert fragment.is_whole, "advantages asked for before the group was whole"
    r = fragment.rewards.reshape(-1, fragment.group_size)
    fragment.advantages = (r - r.mean(1, keepdim=True)).reshape(-1)
    return fragment


@pytest.mark.parametrize("seed", range(6))
def test_parts_in_any_order_join_into_each_whole_group_once(seed):
    """Parts cut anywhere (a group split over a TAG claim, several trainers and a rollout rank's rest), arriving in
    any order, come out as whole groups, each once, with advantages computed on the whole group, rows in order.
    Catches a group yielded before all its members are in, yielded twice, rows out of order, or parts merged
    across a gap."""
    rng, g, groups = random.Random(seed), 3, 6
    cuts = sorted(rng.sample(range(1, groups * g), 7))
    pieces = [(a, b) for a, b in zip([0, *cuts], [*cuts, groups * g])]
    rng.shuffle(pieces)
    out = list(tag.whole_groups((_rows(a, b - a, g) for a, b in pieces), _complete, gap.concat_fragments, gap.rows_of))
    assert all(f.is_whole for f in out)
    got = sorted((f.first_group + i, f.rewards[i * g:(i + 1) * g].tolist()) for f in out for i in range(f.num_groups))
    assert got == [(k, [float(k * g + j) for j in range(g)]) for k in range(groups)]  # each group once, in order
    for f in out:
        assert f.advantages.tolist() == [-1.0, 0.0, 1.0] * f.num_groups
        assert f.latents[:, 0, 0].tolist() == f.rewards.tolist() and f.cond["e"][:, 0].tolist() == f.rewards.tolist()


def test_whole_fragments_pass_as_they_are_and_a_group_of_two_versions_is_refused():
    whole = _complete(_rows(0, 6))
    assert list(tag.whole_groups([whole], *JOIN))[0] is whole  # the rollout's fragments: untouched
    with pytest.raises(AssertionError, match="versions"):
        list(tag.whole_groups([_rows(6, 1, version=3), _rows(7, 2, version=4)], *JOIN))
    left = list(tag.whole_groups([_rows(6, 1), _rows(10, 2)], *JOIN))  # no group complete: nothing yet
    assert left == []


JOIN = (_complete, gap.concat_fragments, gap.rows_of)
