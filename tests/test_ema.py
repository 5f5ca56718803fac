"""flowgrpo/ema.py, Flow-GRPO's EMA of the trained weights (--ema): its arithmetic by hand, and the Trainer's use of it
(evaluation swaps it in and back, checkpoints carry it, a resume restores it)."""
import functools
import io
import types

import pytest
import torch

from flowgrpo import ema
from infra import checkpoint_state
from trainer import Trainer, TrainConfig

pytestmark = pytest.mark.timeout(60)


def test_ema_follows_flow_grpos_formula_by_hand():
    """Catches a missing warm-up, the wrong interval test, a flipped average or a missing repeat. Flow-GRPO
    (flow_grpo/ema.py step, called with global_step g = the updates taken, once per sampled sub-batch: `repeats`
    times per update): when (g + 1) % every == 0, ema += (1 - min((1 + g) / (10 + g), decay)) (theta - ema),
    twice here. theta = g after g updates, every 2, decay 0.9: at g = 1 the step keeps 9/11 of the gap twice,
    leaving (2/11)^2 of it: ema = 1 - 4/121; at g = 3 it leaves (4/13)^2: ema = 3 + (16/169) (117/121 - 3)."""
    theta = torch.zeros(1)
    average = ema.Ema([theta], decay=0.9, every=2, repeats=2)
    seen = []
    for g in range(1, 5):
        theta.fill_(g)
        average.update([theta], g)
        seen.append(float(average.shadow[0]))
    at_1 = 1 - 4 / 121
    at_3 = 3 + 16 / 169 * (at_1 - 3)
    assert seen == pytest.approx([at_1, at_1, at_3, at_3], abs=1e-6)
    assert ema.decay_at(1000, 0.9) == 0.9  # the warm-up ends at the configured decay


def test_the_trainer_triggers_the_ema_after_update_7_of_8_as_flow_grpo():
    """Catches the trigger one update late (the old reading: after update u with (u + 1) % 8 == 0, i.e. the 8th):
    Flow-GRPO's first trigger is ema.step(..., global_step=7), after the 7th optimizer update."""
    trainer = _trainer(every=8)
    initial = [s.clone() for s in trainer.ema.shadow]
    for _ in range(6):
        _one_update(trainer)
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.shadow, initial))
    _one_update(trainer)
    assert not all(torch.equal(a, b) for a, b in zip(trainer.ema.shadow, initial))


def _trainer(every=1):
    torch.manual_seed(0)
    policy = types.SimpleNamespace(transformer=torch.nn.Linear(3, 2))
    return Trainer(policy, TrainConfig(lr=0.1, ema=True, ema_decay=0.5, ema_every=every))


def _one_update(trainer):
    loss = trainer.policy.transformer(torch.ones(4, 3)).pow(2).sum()
    loss.backward()
    trainer.update()


def test_evaluation_uses_the_ema_and_training_resumes_on_the_trained_weights():
    """Catches evaluation on the trained weights with --ema on, or the EMA left in the model after it."""
    trainer = _trainer()
    for _ in range(3):
        _one_update(trainer)
    trained = [p.detach().clone() for p in trainer.params]
    shadow = [s.clone() for s in trainer.ema.shadow]
    assert not all(torch.equal(a, b) for a, b in zip(trained, shadow))
    with trainer.evaluation_weights():
        assert all(torch.equal(p, s) for p, s in zip(trainer.params, shadow))
    assert all(torch.equal(p, t) for p, t in zip(trainer.params, trained))
    assert trainer.updates_total == 3


def test_checkpoints_carry_the_ema_and_a_resume_restores_it():
    """Catches an EMA lost at a resume (restarted from the weights) or its update counter reset (the warm-up
    would start again)."""
    trainer = _trainer(every=2)
    for _ in range(3):
        _one_update(trainer)
    state = checkpoint_state.whole_state(trainer)
    assert set(state["ema"]) == set(trainer.names) and state["updates_total"] == 3
    buffer = io.BytesIO()
    torch.save(state, buffer)  # the checkpoint file (on CPU the state holds the live tensors themselves)
    buffer.seek(0)
    resumed = _trainer(every=2)
    checkpoint_state.load(resumed, torch.load(buffer))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, trainer.ema.shadow))
    _one_update(trainer)
    _one_update(resumed)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, trainer.ema.shadow))
    assert resumed.updates_total == 4


def test_the_saved_lora_holds_the_ema_weights_and_state_pt_both(tiny_cache, tmp_path):
    """Catches the LoRA file saved from the trained weights with --ema on: Flow-GRPO's save_ckpt (train_sd3.py
    line 323) swaps the EMA in to save the LoRA; the checkpoint's state.pt keeps both (a resume needs both)."""
    import config
    import models
    from infra import rundir
    from infra.tracing import Tracer
    from safetensors.torch import load_file

    policy = models.load("flux", models.tiny_pipeline_path("flux"), "cpu", torch.float32, max_sequence_length=16)
    torch.manual_seed(0)
    models.add_lora(policy, 4, 8, "attention")
    trainer = Trainer(policy, TrainConfig(lr=0.1, ema=True, ema_every=1))
    with torch.no_grad():
        for shadow in trainer.ema.shadow:  # the average differs from the trained weights everywhere
            shadow.add_(0.5)
    cfg = config.resolve(config.Config(lora=True, lora_rank=4, lora_alpha=8, lora_targets="attention", ema=True))
    run = rundir.RunDir(str(tmp_path), "{}")
    checkpoint = (checkpoint_state.skeleton(trainer), functools.partial(checkpoint_state.produce, trainer))
    rundir.record_step(run, cfg, policy, 0, {"loss": 0.0}, checkpoint,
                       Tracer(0, "trainer"))  # streamed, as bookkeeping writes it
    saved = load_file(str(tmp_path / "checkpoints" / "step_000001" / "pytorch_lora_weights.safetensors"))
    want = {f"transformer.{k}": v for k, v in  # diffusers' file prefixes the component
            models.lora_state_for_diffusers(policy.transformer, dict(zip(trainer.names, trainer.ema.shadow))).items()}
    assert set(saved) == set(want) and all(torch.equal(saved[k], want[k]) for k in want)
    state = rundir.load_state(str(tmp_path / "checkpoints" / "step_000001"))
    assert all(torch.equal(state["weights"][n], p) for n, p in zip(trainer.names, trainer.params))
