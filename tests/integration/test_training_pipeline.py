"""Pipelined cells (issue 34): a cell of S stages, one process per stage over gloo, trains a
batch by torch's 1F1B schedule over rounds of micro-steps, and a core plus a satellite,
each of S stages, reduce stage by stage. Every test compares with one single-stage cell
training the same micro-steps, in float64, to 1e-6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testkit.pipeline_rig import PipelinePlan, micro_steps, model_dir_with, reference, run_plan, split_by_name

TOL = 1e-6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("pipeline-models")
    return {layers: model_dir_with(base, layers) for layers in (2, 4)}


def _plan(tmp_path: Path, model_dir: Path, stages: int, rounds, count: int, **kw) -> PipelinePlan:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    steps = micro_steps(count, vocab=vocab, seed=count + stages)
    return PipelinePlan(str(model_dir), stages, tuple(steps), rounds, work_dir=str(tmp_path), **kw)


def _assert_matches(plan: PipelinePlan, results: list[dict]) -> None:
    ref = reference(plan)
    core = [r for r in results if r["cell"] == 0]
    assert all(r["tokens"] == ref["tokens"] for r in core)
    grads = split_by_name(results)
    assert set(grads) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert torch.allclose(grads[name], g, atol=TOL, rtol=0), f"gradient of {name}"
    params = {n: t for r in core for n, t in r["params"].items()}
    for name, p in ref["params"].items():
        assert torch.allclose(params[name], p, atol=TOL, rtol=0), f"{name} after the step"
    assert all(abs(r["grad_norm"] - ref["grad_norm"]) < TOL for r in core)


@pytest.mark.parametrize("layers", [2, 4])
def test_pipeline_of_two_stages_matches_one_stage(models, tmp_path, layers):
    rounds = ((tuple(range(0, 3)), tuple(range(3, 4)), tuple(range(4, 8))),)  # 3, then 1 (< S: GPipe), then 4
    plan = _plan(tmp_path, models[layers], 2, rounds, 8)
    results = run_plan(plan)
    _assert_matches(plan, results)
    assert sum(r["times"]["micro_steps"] for r in results if r["stage"] == 0) == 8


def test_pipeline_of_four_stages_matches_one_stage(models, tmp_path):
    plan = _plan(tmp_path, models[4], 4, ((tuple(range(6)), (6, 7)),), 8)
    _assert_matches(plan, run_plan(plan))


def test_pipeline_core_and_satellite_of_two_stages_match_one_cell(models, tmp_path):
    """The satellite joins after the core's first round, loading each stage's shard of the
    core's weights (it started from other weights), and trains half the micro-steps."""
    rounds = (((0, 1), (2, 3, 4)), ((5, 6), (7,)))
    plan = _plan(tmp_path, models[4], 2, rounds, 8, join_after=1)
    _assert_matches(plan, run_plan(plan))


def test_pipeline_pauses_between_rounds_and_drains(models, tmp_path):
    """The leader has nothing ready for 0.3 s between rounds: the other stage waits at the
    announcement (nothing half done), resumes, and drains at the close."""
    plan = _plan(tmp_path, models[2], 2, (((0, 1), (2, 3), (4,)),), 5, pause_s=0.3)
    results = run_plan(plan)
    _assert_matches(plan, results)
    follower = next(r for r in results if r["stage"] == 1)
    assert follower["times"]["rounds"] == 3
    assert follower["times"]["pause_s"] >= 0.5  # two pauses of 0.3 s, waited at the announcement


def test_pipeline_stage_killed_mid_schedule_fails_its_cell_without_a_trace(models, tmp_path):
    """Stage 1 is SIGKILLed in the middle of the second round's schedule. Stage 0 does not
    hang on its neighbour: its schedule fails, and it keeps no gradient of the batch (so the
    cell acknowledges nothing and its claims go back, as a dead cell's do)."""
    plan = _plan(tmp_path, models[2], 2, (((0, 1, 2), (3, 4, 5), (6, 7)),), 8, die=(1, 1))
    leader, dead = run_plan(plan, timeout_s=120)
    assert dead["exitcode"] == -9
    assert "failed" in leader, leader
    assert leader["grads_left"] == 0
