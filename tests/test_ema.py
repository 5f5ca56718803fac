"""ema.py, Flow-GRPO's EMA of the trained weights (--ema): its arithmetic by hand, and the Trainer's use of it
(evaluation swaps it in and back, checkpoints carry it, a resume restores it)."""
import io
import types

import pytest
import torch

import ema
from trainer import Trainer, TrainConfig

pytestmark = pytest.mark.timeout(60)


def test_ema_follows_flow_grpos_formula_by_hand():
    """Catches a missing warm-up, the wrong interval test or a flipped average. Flow-GRPO (flow_grpo/ema.py):
    after update u, when (u + 1) % every == 0, ema += (1 - min((1 + u) / (10 + u), decay)) (theta - ema).
    theta = 1, 2, 3, 4 after updates 0..3, every 2, decay 0.9: update 1 gives 0 + (9/11)(2 - 0) = 18/11;
    update 3 gives 18/11 + (9/13)(4 - 18/11) = 18/11 + (9/13)(26/11) = 36/11."""
    theta = torch.zeros(1)
    average = ema.Ema([theta], decay=0.9, every=2)
    seen = []
    for u in range(4):
        theta.fill_(u + 1)
        average.update([theta], u)
        seen.append(float(average.shadow[0]))
    assert seen == pytest.approx([0.0, 18 / 11, 18 / 11, 36 / 11], abs=1e-6)
    assert ema.decay_at(1000, 0.9) == 0.9  # the warm-up ends at the configured decay


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
    state = trainer.checkpoint_state()
    assert set(state["ema"]) == set(trainer.names) and state["updates_total"] == 3
    buffer = io.BytesIO()
    torch.save(state, buffer)  # the checkpoint file (on CPU the state holds the live tensors themselves)
    buffer.seek(0)
    resumed = _trainer(every=2)
    resumed.load_checkpoint_state(torch.load(buffer))
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, trainer.ema.shadow))
    _one_update(trainer)
    _one_update(resumed)
    assert all(torch.equal(a, b) for a, b in zip(resumed.ema.shadow, trainer.ema.shadow))
    assert resumed.updates_total == 4
