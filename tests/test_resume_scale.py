"""Resume at scale: under FSDP, with K = 2 trainers, with TAG and TCSS on.

- FSDP round trip (2 gloo ranks, tests/dist_harness.py, the real infra.fsdp.shard_for_fsdp): after two AdamW
  steps, infra.checkpoint_state's whole_state -> load into a freshly sharded trainer gives back every local
  shard of the weights and of the AdamW state bit for bit, the same checkpoint again, and the same next step.
  Catches: a checkpoint of each rank's local shard instead of the whole tensor, whole tensors not re-sharded on
  load (or sharded along another dimension), the Adam step count or moments lost under sharding.
- DigenRL with K = 2 trainers, TAG and TCSS scripted (tests/inject/scripted_schedule.py: who generates which
  groups with which weights is a function of the seed): a run resumed from its step-2 checkpoint equals the
  uninterrupted run, metrics and final weights, bit for bit. One scripted difference, by design: the checkpoint
  does not hold fragments generated ahead (TCSS), so a run resumed at step 2 generates step 2 on-policy; the
  uninterrupted reference is told not to generate ahead into step 2 (DIGENRL_SCRIPTED_NO_AHEAD=2), and steps 1
  and 3 of both runs train a stale fragment and a TAG fragment. Catches: a checkpoint loaded on the leader only
  (trainer 2 would train from the initial weights), a resumed version that breaks the staleness bound, AdamW
  moments or the bad-step count not restored, a resumed rollout rank that never gets the resumed weights.
"""
import io
import os
import shutil

import pytest
import torch

import dist_harness
from conftest import ROOT, checkpoint_weights, read_metrics, run_forked, run_main
from infra import checkpoint_state

pytestmark = pytest.mark.timeout(300)


def _fsdp_trainer(cache):
    import torch.distributed as dist

    os.environ["DIGENRL_CACHE"] = cache
    import models
    from infra.fsdp import shard_for_fsdp
    from trainer import TrainConfig, Trainer

    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32)
    models.enable_full_training(policy)
    shard_for_fsdp(policy, dist.group.WORLD, keep_reference=False)
    return Trainer(policy, TrainConfig(lr=1e-2), compute_group=dist.group.WORLD, data_group=dist.group.WORLD,
                   sharded=True)


def _train_step(trainer, seed):
    """One real step: a loss of the sharded transformer's output on seeded inputs, backward, AdamW."""
    policy = trainer.policy
    x = torch.stack([policy.noise(torch.Generator().manual_seed(seed + i)) for i in range(2)])  # [2, tokens, C]
    velocity = policy.velocity(x, torch.tensor([0.9, 0.4]), policy.encode_prompts(["a red image", "a blue image"]))
    velocity.square().mean().backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _local(trainer):
    """This rank's shards: weights, then every AdamW state tensor (and the step counts), in a fixed order."""
    out = [p.to_local().clone() for p in trainer.params]
    for p in trainer.params:
        for key, value in sorted(trainer.optimizer.state[p].items()):
            out.append((value.to_local() if hasattr(value, "to_local") else value).clone())
    return out


def _same_state(a, b) -> bool:
    if a["weights"].keys() != b["weights"].keys() or a["optimizer"]["state"].keys() != b["optimizer"]["state"].keys():
        return False
    weights = all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    moments = all(torch.equal(a["optimizer"]["state"][i][k], b["optimizer"]["state"][i][k])
                  for i in a["optimizer"]["state"] for k in a["optimizer"]["state"][i])
    return weights and moments and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def _round_trip_worker(rank, world, store, cache):
    first = _fsdp_trainer(cache)
    for seed in (0, 10):
        _train_step(first, seed)
    state = checkpoint_state.whole_state(first, keep=True)
    assert all(v.shape == p.shape for v, p in zip(state["weights"].values(), first.params))  # whole tensors
    second = _fsdp_trainer(cache)  # the initial weights, no AdamW state
    changed = not all(torch.equal(a, b) for a, b in zip(_local(first)[:len(first.params)], _local(second)))
    buffer = io.BytesIO()  # through the bytes, as the checkpoint file goes (no tensor shared with the first trainer)
    torch.save(state, buffer)
    buffer.seek(0)
    checkpoint_state.load(second, torch.load(buffer))
    shards = all(torch.equal(a, b) for a, b in zip(_local(first), _local(second)))
    again = _same_state(state, checkpoint_state.whole_state(second, keep=True))
    for trainer in (first, second):
        _train_step(trainer, 20)
    next_step = all(torch.equal(a, b) for a, b in zip(_local(first), _local(second)))
    return {"changed": changed, "shards": shards, "again": again, "next_step": next_step,
            "adam_step": float(first.optimizer.state[first.params[0]]["step"])}


def test_fsdp_checkpoint_round_trip_is_bit_exact(tiny_cache):
    results = dist_harness.check(dist_harness.run(_round_trip_worker, 2, tiny_cache, timeout_s=240))
    for rank, r in results.items():
        assert r["changed"], f"rank {rank}: two steps changed no local shard: the round trip would prove nothing"
        assert r["shards"], f"rank {rank}: a loaded shard (weights or AdamW state) differs from the saved one"
        assert r["again"], f"rank {rank}: checkpointing the loaded trainer gave another checkpoint"
        assert r["next_step"], f"rank {rank}: the step after loading differs from the step after saving"
        assert r["adam_step"] == 3


SCRIPTED = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "inject"), ROOT,
                                           os.environ.get("PYTHONPATH", "")]),
            "DIGENRL_TEST_INJECT": "scripted_schedule", "DIGENRL_SCRIPTED_NO_AHEAD": "2"}
DIGENRL_K2 = ["--mode", "digenrl", "--nproc", "3", "--rollout-ranks", "1", "--prompts-per-step", "4",
              "--group-size", "2", "--fragment-groups", "2", "--num-steps", "3", "--eval-every", "0",
              "--save-every", "2", "--keep-checkpoints", "4", "--seed", "1", "--timeout-s", "60", "--no-trace"]


def test_digenrl_k2_with_tag_and_tcss_resumes_as_the_uninterrupted_run(tiny_cache, tmp_path):
    run_forked([*DIGENRL_K2, "--steps", "4"], tmp_path, "straight", tiny_cache, scripted=True,
               env={"DIGENRL_SCRIPTED_NO_AHEAD": SCRIPTED["DIGENRL_SCRIPTED_NO_AHEAD"]})
    # The run as a crash after its step-2 checkpoint leaves it (cheaper than a second run stopped there: the same
    # checkpoint, as steps 0-1 have the same schedule): later checkpoints gone, the later metrics rows still there.
    shutil.copytree(tmp_path / "straight", tmp_path / "stopped")
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "step_000004")
    run_main(["--resume", str(tmp_path / "stopped"), "--steps", "4"], tmp_path, tiny_cache, env=SCRIPTED)
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    # the schedule both runs had: TCSS and TAG in steps 1 and 3, step 2 generated by the rollout rank alone
    for rows in (straight, resumed):
        assert [r["stale_fragments"] for r in rows] == [0, 1, 0, 1]
        assert [r["tag_fragments"] for r in rows] == [0, 1, 0, 1]
    for row, want in zip(resumed, straight):
        for key in ("reward_mean", "loss", "grad_norm", "logprob_gap", "ratio_mean", "trajectories", "version"):
            assert row[key] == want[key], (row["step"], key, row[key], want[key])
    final, want = checkpoint_weights(tmp_path / "stopped", 4), checkpoint_weights(tmp_path / "straight", 4)
    assert final.keys() == want.keys()
    for key in want:
        assert torch.equal(final[key], want[key]), key
