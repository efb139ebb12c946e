"""The pipelined cell's NCCL path (skipped without CUDA; issue 34): the same 1F1B rounds,
drain and stage-by-stage reduce as over gloo, the stages on one GPU each, in float64
against one single-stage cell on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testkit.pipeline_rig import PipelinePlan, micro_steps, model_dir_with, reference, run_plan, split_by_name

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per stage"),
]


def test_pipeline_nccl_two_stages_match_one_stage(tmp_path: Path) -> None:
    model_dir = model_dir_with(tmp_path, 4)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    steps = micro_steps(6, vocab=vocab, seed=6)
    plan = PipelinePlan(
        str(model_dir), 2, tuple(steps), (((0, 1, 2), (3,), (4, 5)),), work_dir=str(tmp_path), backend="nccl"
    )
    results = run_plan(plan)
    ref = reference(plan)
    grads = split_by_name(results)
    for name, g in ref["grads"].items():
        assert torch.allclose(grads[name], g, atol=1e-6, rtol=0), name


def test_pipelined_trainer_on_two_gpus_matches_one_stage(tmp_path: Path) -> None:
    """The cell agent's path (``pipeline_stages: 2`` on CUDA): the stage workers on
    ``cuda:0`` and ``cuda:1`` over NCCL, the master copy on the host."""
    from services.cell_agent.training.service import stage_devices
    from services.cell_agent.training.stages import PipelinedTrainer, StageWorkers
    from services.cell_agent.training.trainer import Trainer

    model_dir = model_dir_with(tmp_path, 4)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    steps = micro_steps(6, vocab=vocab, seed=7)
    devices = stage_devices("auto", 0, 2)
    assert devices == ["cuda:0", "cuda:1"]
    pt = PipelinedTrainer.with_workers(StageWorkers(str(model_dir), 2, dtype="float64", devices=devices), 3)
    try:
        ref = Trainer.from_dir(model_dir, 3, dtype="float64")
        pt.accumulate_round(steps[:4], 3)
        pt.accumulate_round(steps[4:], 3)
        for s in steps:
            ref.accumulate(s, 3)
        assert float((pt.flat_grads() - ref.flat_grads()).abs().max()) < 1e-6
        assert pt.tokens == ref.tokens
    finally:
        pt.close()
