"""The pipelined cell as the cell agent runs it (``cell_agent.training.pipeline_stages``):
:class:`PipelinedTrainer` drives one worker process per stage, and its gradient, tokens
and diagnostics over several batches equal one single-stage :class:`Trainer`'s on the same
micro-steps (float64, 1e-6); a stage killed between rounds or mid-round fails the next
round at once and leaves no gradient, and restarted workers train the batch again to the
same result."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from services.cell_agent.training.stages import PipelinedTrainer, StageDied, StageWorkers, loss_tokens
from services.cell_agent.training.trainer import Trainer
from testkit.pipeline_rig import micro_steps, model_dir_with

pytestmark = pytest.mark.timeout(240)
TOL = 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir_with(tmp_path_factory.mktemp("pipeline-trainer"), 4)


@pytest.fixture(scope="module")
def pipelined(model_dir: Path):
    trainer = PipelinedTrainer.with_workers(StageWorkers(str(model_dir), 2, dtype="float64"), 5)
    yield trainer
    trainer.close()


def _steps(model_dir: Path, count: int, seed: int):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return micro_steps(count, vocab=vocab, seed=seed)


def _same_batch(pt: PipelinedTrainer, ref: Trainer, rounds, version: int) -> None:
    counts = [pt.accumulate_round(r, version) for r in rounds]
    for r in rounds:
        ref.accumulate_round(r, version)
    assert [n for c in counts for n in c] == [loss_tokens(s) for r in rounds for s in r]
    got, want = pt.flat_grads(), ref.flat_grads()
    assert float((got - want).abs().max()) < TOL
    assert pt.tokens == ref.tokens > 0
    got_stats, want_stats = pt.stats.summary(), ref.stats.summary()
    assert got_stats.pop("lag_hist") == want_stats.pop("lag_hist")
    assert got_stats == pytest.approx(want_stats, abs=1e-9)


def test_pipelined_trainer_matches_one_stage_over_batches(model_dir, pipelined):
    steps = _steps(model_dir, 7, seed=11)
    ref = Trainer.from_dir(model_dir, 5, dtype="float64")
    pipelined.load_state(ref.state_dict(), 5)
    # 4, then 1 (fewer than the stages: GPipe), then 2 micro-steps.
    _same_batch(pipelined, ref, [steps[:4], steps[4:5], steps[5:]], 5)
    pipelined.close_window()
    ref.close_window()
    # New weights (a step elsewhere, pulled): the stages get them before the next round.
    with torch.no_grad():
        state = {n: t + 0.01 * torch.randn_like(t) for n, t in ref.state_dict().items()}
    ref.load_state(state, 6)
    pipelined.load_state(state, 6)
    _same_batch(pipelined, ref, [steps[2:6]], 6)
    pipelined.close_window()


def test_pipelined_trainer_after_a_stage_dies_fails_then_trains_again(model_dir, pipelined):
    steps = _steps(model_dir, 6, seed=12)
    ref = Trainer.from_dir(model_dir, 7, dtype="float64")
    pipelined.load_state(ref.state_dict(), 7)
    pipelined.accumulate_round(steps[:3], 7)
    os.kill(pipelined.workers.pids[1], signal.SIGKILL)  # between rounds: the pause
    t0 = time.monotonic()
    with pytest.raises(StageDied, match="stage"):
        pipelined.accumulate_round(steps[3:], 7)
    assert time.monotonic() - t0 < 10  # fails, does not hang
    pipelined.close_window()  # the failed attempt leaves nothing
    assert pipelined.tokens == 0 and all(p.grad is None for p in pipelined.params)
    assert pipelined.workers.check() is not None
    pipelined.restart_workers()
    assert pipelined.workers.check() is None
    _same_batch(pipelined, ref, [steps[:3], steps[3:]], 7)
    pipelined.close_window()
