"""One optimizer step per batch, on one weight version: a gradient on another version is
refused (by the accumulator, by batch membership, and a stale satellite contributes
nothing); a duplicated step command is a no-op; a crash between the step and its record
(or between the write-ahead and the step) resumes from the checkpoint with exactly one
step; and the token loss is the clipped PPO objective summed over masked tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from services.cell_agent.training.checkpoint import Checkpointer
from services.cell_agent.training.core import FAILPOINT_ENV, CoreOptimizer, FailpointCrash, OptimConfig
from services.cell_agent.training.microstep import MicroStep, Sequence
from services.cell_agent.training.ports import JoinResult
from services.cell_agent.training.trainer import LossConfig, StaleGradient, Trainer, token_losses
from testkit.fake_packer import synthetic_batch
from testkit.training_fakes import InProcessMembership, tiny_lm

OPT = OptimConfig(lr=1e-2)


@pytest.fixture(scope="module")
def model():
    return tiny_lm(seed=1, hidden=32)


def _grad_of(trainer: Trainer, steps, version: int):
    for s in steps:
        trainer.accumulate(s, version)
    return trainer.flat_grads().clone(), trainer.tokens


def test_gradient_on_another_version_is_refused(model):
    t = Trainer(copy.deepcopy(model), version=3)
    steps = synthetic_batch(1, 2, vocab=512)
    with pytest.raises(StaleGradient):
        t.accumulate(steps[0], version=2)  # weights are 3
    t.accumulate(steps[0], version=3)
    with pytest.raises(StaleGradient):
        t.add_gradient([torch.zeros_like(p) for p in t.params], 5, version=4)
    # Weights are fixed while the window is open.
    with pytest.raises(Exception, match="fixed"):
        t.load_flat_params(t.flat_params(), 4)


def test_membership_refuses_late_and_out_of_order():
    m = InProcessMembership()
    assert m.register(7, 1)[0] is JoinResult.NOT_YET  # core has not opened
    m.open(7, 5)
    assert m.register(7, 2) == (JoinResult.NOT_YET, 5)  # predecessor 1 first
    assert m.register(7, 1) == (JoinResult.JOINED, 5)
    assert m.register(7, 1) == (JoinResult.JOINED, 5)  # idempotent
    assert m.freeze(7) == 2
    assert m.register(7, 2)[0] is JoinResult.CLOSED
    assert m.wait_frozen(7, 1.0) == 2


def test_duplicate_step_is_a_noop(model):
    t = Trainer(copy.deepcopy(model), version=1)
    core = CoreOptimizer(t, OPT)
    grad, tokens = _grad_of(t, synthetic_batch(1, 2), 1)
    r1 = core.step(1, grad, tokens)
    after = t.flat_params().clone()
    r2 = core.step(1, grad, tokens)
    assert r1.applied and not r2.applied
    assert r1.version == r2.version == 2 and core.steps == 1
    assert torch.equal(after, t.flat_params())


@pytest.mark.parametrize("point", ["training.after_step", "training.after_write_ahead"])
def test_crash_between_step_and_record_resumes_with_one_step(model, tmp_path, monkeypatch, point):
    steps = synthetic_batch(1, 3)
    # The run without a crash.
    t0 = Trainer(copy.deepcopy(model), version=1)
    c0 = CoreOptimizer(t0, OPT, Checkpointer(tmp_path / "ok"))
    g, n = _grad_of(t0, steps, 1)
    c0.step(1, g, n)
    expected = t0.flat_params().clone()
    # The run that crashes between the step and its record.
    ck = Checkpointer(tmp_path / "crash")
    t1 = Trainer(copy.deepcopy(model), version=1)
    c1 = CoreOptimizer(t1, OPT, ck)
    ck.save(c1.record())  # version 1 committed at start-up
    g, n = _grad_of(t1, steps, 1)
    monkeypatch.setenv(FAILPOINT_ENV, f"{point}=raise")
    with pytest.raises(FailpointCrash):
        c1.step(1, g, n)
    monkeypatch.delenv(FAILPOINT_ENV)
    # Restart: a fresh process state, same disk.
    t2 = Trainer(copy.deepcopy(model), version=1)
    c2 = CoreOptimizer(t2, OPT, Checkpointer(tmp_path / "crash"))
    assert c2.restore()
    assert (c2.version, c2.last_batch_id, c2.steps) == (2, 1, 1)
    assert torch.equal(t2.flat_params(), expected)
    state_steps = {float(s["step"]) for s in c2.opt.state_dict()["state"].values()}
    assert state_steps == {1.0}  # AdamW stepped exactly once
    # The step command, redelivered after the restart, is a no-op.
    assert not c2.step(1, g, n).applied
    assert not ck.pending()
    # A second restart changes nothing (no replay twice).
    t3 = Trainer(copy.deepcopy(model), version=1)
    c3 = CoreOptimizer(t3, OPT, Checkpointer(tmp_path / "crash"))
    c3.restore()
    assert c3.steps == 1 and torch.equal(t3.flat_params(), expected)


def test_coupled_token_loss_matches_the_clipped_objective():
    v = 5
    logits = torch.randn(1, 4, v, dtype=torch.float64)
    ids = (1, 2, 3, 4)
    logp = torch.log_softmax(logits[0], -1)
    true = [float(logp[j - 1, ids[j]]) for j in range(1, 4)]
    old = (0.0, true[0] - 1.0, true[1] + 0.01, true[2] - 0.05)  # ratio e^1 clips; others do not
    seq = Sequence(ids, (0, 1, 1, 0), tuple(min(o, 0.0) for o in old), advantage=2.0)
    loss, n, _ = token_losses(logits, [seq], LossConfig(0.2, 0.2, objective="coupled"))
    assert n == 2
    r1 = math.exp(true[0] - min(old[1], 0.0))
    r2 = math.exp(true[1] - min(old[2], 0.0))
    want = -min(r1 * 2.0, min(max(r1, 0.8), 1.2) * 2.0) - min(r2 * 2.0, min(max(r2, 0.8), 1.2) * 2.0)
    assert loss.item() == pytest.approx(want, rel=1e-12)


def test_bad_micro_steps_are_refused():
    with pytest.raises(Exception, match="lengths"):
        Sequence((1, 2, 3), (0, 1), (0.0, -1.0, -1.0), 1.0)
    with pytest.raises(Exception, match="0 or 1"):
        Sequence((1, 2), (0, 2), (0.0, -1.0), 1.0)
    with pytest.raises(Exception, match="finite"):
        Sequence((1, 2), (0, 1), (0.0, -1.0), float("nan"))
    with pytest.raises(Exception, match="no sequences"):
        MicroStep.from_proto(MicroStep("m", 1, ()).to_proto())
