"""The prompt-embedding cache is an LRU bounded by --prompt-cache-size, and serves what a fresh encoding gives."""
import pytest
import torch

import models

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def policy(tiny_cache):
    return models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)


def _bounded(policy, size):
    policy._prompt_cache.clear()
    policy.prompt_cache_size = size
    return policy


def _fresh(policy, prompts):
    return policy.family.encode(policy.pipe, prompts, policy.device, policy.max_sequence_length)


def test_many_distinct_prompts_stay_within_the_bound_and_equal_fresh_encodings(policy):
    policy = _bounded(policy, 5)
    prompts = [f"a red object number {i}" for i in range(40)]
    g = torch.Generator().manual_seed(0)
    for call in range(16):  # batches with repeats, hits and misses, sometimes more distinct prompts than the bound
        size = int(torch.randint(1, 9, (1,), generator=g))
        batch = [prompts[int(i)] for i in torch.randint(0, 8 if call < 8 else 40, (size,), generator=g)]
        got = policy.encode_prompts(batch)
        assert len(policy._prompt_cache) <= 5
        want = _fresh(policy, batch)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert len(policy._prompt_cache) == 5
    # a cached entry owns its memory (not a view keeping the whole encoded batch alive)
    entry = next(iter(policy._prompt_cache.values()))
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in entry.values())


def test_least_recently_used_prompt_is_evicted_first_and_zero_disables(policy, tiny_cache):
    policy = _bounded(policy, 3)
    policy.encode_prompts(["a red a", "a red b", "a red c"])
    policy.encode_prompts(["a red a"])  # a is now the most recently used
    policy.encode_prompts(["a red d"])
    assert list(policy._prompt_cache) == ["a red c", "a red a", "a red d"]
    off = _bounded(policy, 0)
    out = off.encode_prompts(["a blue x", "a blue x"])
    assert len(off._prompt_cache) == 0 and out["prompt_embeds"].shape[0] == 2
    # the size reaches Policy through models.load (main.py passes --prompt-cache-size)
    assert models.load("flux", models.tiny_pipeline_path("flux"), prompt_cache_size=7).prompt_cache_size == 7


def test_soak_make_prompts_gives_distinct_prompts_the_colour_reward_accepts():
    import rewards
    from tools.soak import make_prompts

    prompts = make_prompts(2000)
    assert len(set(prompts)) == 2000
    assert {rewards.prompt_color(p) for p in prompts} == {0, 1, 2}  # raises for a prompt it does not accept
