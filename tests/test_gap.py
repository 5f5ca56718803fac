"""transport.py: a fragment.Fragment round-trips through send/recv and broadcast bit-exactly; concurrent claims are
unique. transport.py's bucketed publishing into transport.Mailbox, in the same three processes: published weights reach the rollout's model (Mailbox.swap_into),
in the rollout's dtype, newest version first (catches a mailbox that reports a version it never copied in)."""
import pytest
import torch
import torch.distributed as dist


import dist_harness
import rollout
import gap
import grpo
import async_policy
import transport
from fragment import Fragment, fragment_spec

pytestmark = pytest.mark.timeout(120)


def _fragment():
    g = torch.Generator().manual_seed(0)
    m, t = 4, 3
    return Fragment(step=7, first_group=2, policy_version=6, producer=0, group_size=2,
                    prompt_ids=torch.tensor([1, 1, 0, 0]), cond={"b": torch.randn(m, 5, 3, generator=g),
                                                                "a": torch.randn(m, 2, generator=g).bfloat16()},
                    latents=torch.randn(m, t, 8, 4, generator=g), next_latents=torch.randn(m, t, 8, 4, generator=g),
                    timestep_index=torch.arange(t).repeat(m, 1), sigmas=torch.rand(m, t, generator=g),
                    sigmas_next=torch.rand(m, t, generator=g), log_probs=torch.randn(m, t, generator=g),
                    rewards=torch.randn(m, generator=g), reward_parts=torch.randn(m, 2, generator=g),
                    advantages=torch.randn(m, generator=g))


def _same(a, b):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert a.ints() == b.ints()


def _worker(rank, world, store):
    frag = _fragment()
    if rank == 0:
        transport.send_fragment(frag, dst=1)
    elif rank == 1:
        _same(transport.recv_fragment(src=0), frag)
    got = transport.broadcast_fragment(frag if rank == 2 else None, src=2)
    _same(got, frag)
    queue = gap.FragmentQueue(dist.PrefixStore("queue", store), groups_per_step=25)
    claimed = []
    while (claim := queue.claim(0, 1)) is not None:
        claimed.append(claim[0])
    # TCSS weights: rank 2 publishes two versions (fp32 -> the rollout's bf16 for the second tensor), ranks 0
    # and 1 receive them in their mailbox threads and swap them into their (zero) parameters.
    # A 20-byte bucket limit cuts the stream into buckets at the dtype change, at the limit, and sends the
    # 40-byte tensor alone (the publish side and the mailbox side must cut it the same way).
    published = {v: [torch.arange(3.0) * v, torch.full((2, 2), 0.5 * v), torch.full((10,), -v),
                     torch.tensor(v + 0.25)] for v in (1, 2)}
    if rank == 2:
        for version in (1, 2):
            transport.publish_weights(iter(published[version]), 4, version, src=2, group=dist.group.WORLD,
                                      dtypes=[torch.float32, torch.bfloat16, torch.float32, torch.float32],
                                      bucket_bytes=20)
        transport.publish_weights([], 0, async_policy.STOP, src=2, group=dist.group.WORLD)
    else:
        params = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(())]
        shapes = [(p.shape, p.dtype) for p in params]
        mailbox = transport.Mailbox(transport.WeightReceiver(2, dist.group.WORLD, shapes, 20))
        mailbox.wait_for(2)
        assert mailbox.swap_into(params) == 2 == mailbox.held_version
        mailbox.join()
        for p, want in zip(params, published[2]):
            assert torch.equal(p, want.to(p.dtype)), (p, want)
    dist.barrier()
    return claimed


def test_round_trip_broadcast_unique_claims_and_published_weights():
    claims = dist_harness.check(dist_harness.run(_worker, 3, timeout_s=90))
    every = sorted(i for c in claims.values() for i in c)
    assert every == list(range(25))  # each fragment claimed exactly once across the three claimers


def test_publish_packs_small_tensors_into_buckets_and_the_mailbox_cuts_them_the_same_way(monkeypatch):
    """One broadcast per bucket, not per tensor (a 66-tensor model paid 66 round trips per publish), and
    the receiving side's views hold exactly the published values."""
    sent = []
    monkeypatch.setattr(transport.dist, "broadcast", lambda t, src, group: sent.append(t.clone()))
    weights = [torch.full((2,), 1.0), torch.full((3,), 2.0), torch.full((2,), 3.0, dtype=torch.bfloat16),
               torch.full((9,), 4.0), torch.full((1,), 5.0), torch.full((1,), 6.0)]
    transport.publish_weights(iter(weights), 6, 3, src=0, group=None, bucket_bytes=24)
    assert [t.tolist() for t in sent[:1]] == [[3, 6]]  # the header: version, count
    assert [(t.dtype, t.numel()) for t in sent[1:]] == [
        (torch.float32, 5),  # 8 + 12 bytes fit in 24
        (torch.bfloat16, 2),  # a dtype change opens a bucket
        (torch.float32, 9),  # 36 bytes > 24: alone
        (torch.float32, 2)]  # the last two
    received = iter(sent[1:])
    monkeypatch.setattr(transport.dist, "broadcast", lambda t, src, group: t.copy_(next(received)))
    shapes = [(w.shape, w.dtype) for w in weights]
    got = transport.receive_buckets(0, None, shapes, bucket_bytes=24)  # no thread: only the cutting is under test
    assert [(g.shape, g.dtype) for g in got] == shapes
    assert all(torch.equal(g, w) for g, w in zip(got, weights))


def test_fragment_specs_are_deterministic_and_whole_groups():
    a = fragment_spec(1, 4, 4, 2, num_prompts_total=5, groups_per_step=6, group_size=3)
    b = fragment_spec(1, 4, 4, 2, num_prompts_total=5, groups_per_step=6, group_size=3)
    assert a == b and len(a.prompt_ids) == 6
    assert a.prompt_ids[0] == a.prompt_ids[2] and len(set(a.noise_seeds)) == 6
    dance = fragment_spec(1, 4, 4, 2, 5, 6, 3, shared_group_noise=True)
    assert dance.init_seeds[0] == dance.init_seeds[2] != dance.init_seeds[3]
    with pytest.raises(ValueError, match="must divide"):
        gap.num_fragments(6, 4)


@pytest.mark.parametrize("groups,fragment_groups,updates,world", [(4, 2, 2, 2), (6, 2, 2, 2), (8, 4, 2, 3),
                                                                  (4, 1, 1, 2), (5, 2, 3, 2)])
def test_every_colocated_rank_trains_in_every_update(groups, fragment_groups, updates, world):
    """The colocated baseline's static shares (grpo.static_claims): the ranks' claims tile the batch
    exactly once, each range within one minibatch, and every rank holds part of every minibatch that
    has at least `world` groups (with fragments r, r + P, ... of the whole batch, B = 4 in fragments
    of 2 at M = 2 put each minibatch on one rank: the other idled through half the training). Its
    generation calls (grpo.generation_batches) hold fragment_groups groups each, the last maybe fewer."""
    bounds = grpo.minibatch_bounds(groups, updates)
    shares = [grpo.static_claims(bounds, rank, world) for rank in range(world)]
    covered = sorted(g for share in shares for first, count in share for g in range(first, first + count))
    assert covered == list(range(groups))
    for rank, share in enumerate(shares):
        assert all(any(lo <= first and first + count <= hi for lo, hi in bounds) for first, count in share)
        for lo, hi in bounds:
            if hi - lo >= world:
                assert any(lo <= first < hi for first, _ in share), (rank, lo, hi, share)
        calls = grpo.generation_batches(share, fragment_groups)
        sizes = [sum(count for _, count in call) for call in calls]
        assert sizes[:-1] == [fragment_groups] * (len(sizes) - 1) and 1 <= sizes[-1] <= fragment_groups
        assert [g for call in calls for f, c in call for g in range(f, f + c)] == \
            [g for f, c in share for g in range(f, f + c)]


def _seeded_fragment(spec, version: int, producer: int, t_train: int, dim: int) -> Fragment:
    """A stand-in for generation: latents from the spec's seeds, reward = the latent's first value."""
    m = len(spec.prompt_ids)
    x = torch.stack([torch.randn(t_train, dim, generator=torch.Generator().manual_seed(s))
                     for s in spec.noise_seeds])  # [m, T_train, dim]
    rewards, zeros = x[:, 0, 0], torch.zeros(m, t_train)
    return Fragment(spec.step, spec.first_group, version, producer, spec.group_size, torch.tensor(spec.prompt_ids),
                    {"e": torch.zeros(m, 1)}, x, x, torch.zeros(m, t_train).long(), zeros, zeros, zeros,
                    rewards, rewards[:, None], grpo.group_advantages(rewards, spec.group_size))


def test_generation_batches_and_split_rows_by_hand():
    """B = 4, M = 2, P = 2: rank 0 holds groups 0 and 2, one call of 2 groups (8 samples at G = 4, as one
    Flow-GRPO sampling batch), cut back into the fragments of groups [0, 1) and [2, 3)."""
    assert grpo.static_claims(grpo.minibatch_bounds(4, 2), 0, 2) == [(0, 1), (2, 1)]
    assert grpo.generation_batches([(0, 1), (2, 1)], 2) == [[(0, 1), (2, 1)]]
    assert grpo.generation_batches([(0, 3), (6, 3)], 2) == [[(0, 2)], [(2, 1), (6, 1)], [(7, 2)]]
    spec = fragment_spec(0, 0, 0, 4, 10, 4, 2)
    whole = _seeded_fragment(spec, 3, 1, 2, 3)  # groups [0, 4), 8 rows
    parts = rollout.split_rows(whole, [(0, 1), (2, 3)])
    assert [(p.first_group, p.num_groups, p.policy_version, p.producer) for p in parts] == [(0, 1, 3, 1), (2, 3, 3, 1)]
    torch.testing.assert_close(parts[1].latents, whole.latents[2:])
    with pytest.raises(ValueError, match="hold 4 samples"):
        rollout.split_rows(whole, [(0, 2)])
