"""What the demo reports about learning (apps/demo/learning.py) and its time budget."""

from __future__ import annotations

import json

from apps.demo.__main__ import budget_s
from apps.demo.learning import (
    diagnostics_summary,
    plot_learning,
    reward_by_generating_version,
    separated,
    step_diagnostics,
)


def _turn(x: str, versions: list[int], mask: list[int] | None = None) -> dict:
    return {"t": "turn", "turn": {"x": x, "v": versions, "m": mask or [1] * len(versions)}}


def _finish(x: str, reward: float, status: str = "completed") -> dict:
    return {"t": "finish", "finish": {"x": x, "s": status, "r": reward, "v": 0}}


def test_training_reward_is_keyed_by_the_version_that_generated_most_tokens():
    events = [
        # dispatched at v0, but most of its tokens came from v2 (a long episode)
        _turn("a", [0, 0]),
        _turn("a", [2, 2, 2]),
        _finish("a", 1.0),
        _turn("b", [0, 0, 0]),
        _finish("b", 0.0),
        _turn("c", [2, 2]),
        _finish("c", 0.5),
        _turn("d", [1, 1], mask=[0, 0]),  # nothing trained: no generating version
        _finish("d", 1.0),
        _turn("e", [1]),
        _finish("e", 1.0, status="cancelled"),  # not a completed episode
    ]
    assert reward_by_generating_version(events) == {0: {"mean": 0.0, "n": 1}, 2: {"mean": 0.75, "n": 2}}


def test_step_diagnostics_come_from_the_cores_applied_steps(tmp_path):
    path = tmp_path / "cell_agent.jsonl"
    diag = {"clip_fraction": 0.1, "behaviour_weight_mean": 1.0, "behaviour_weight_max": 2.0, "entropy": 0.5}
    lines = [
        {"op": "step", "new_v": 2, "applied": True, "diag": {**diag, "lag_hist": [3, 1]}},
        {"op": "step", "new_v": 1, "applied": True, "diag": {**diag, "lag_hist": [4, 0]}},
        {"op": "step", "new_v": 1, "applied": False, "diag": diag},  # a duplicate command
        {"op": "train", "b": 1},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = step_diagnostics(path)
    assert [s["version"] for s in steps] == [1, 2]
    summary = diagnostics_summary(steps)
    assert summary["steps"] == 2 and summary["lag_hist_tokens"][:2] == [7, 1]
    assert summary["mean"]["clip_fraction"] == 0.1 and summary["behaviour_weight_max"] == 2.0
    assert step_diagnostics(tmp_path / "missing.jsonl") == [] and diagnostics_summary([]) == {}


def test_learning_png_and_the_separation_verdict(tmp_path):
    first = {"version": 0, "mean": 0.4, "ci95": [0.3, 0.5]}
    last = {"version": 9, "mean": 0.9, "ci95": [0.85, 0.95]}
    assert separated(first, last) and not separated(first, {**last, "ci95": [0.45, 0.95]})
    out = plot_learning([first, last], {0: {"mean": 0.4, "n": 16}}, tmp_path / "learning.png", [])
    assert out.stat().st_size > 1000


def test_the_demos_budget_grows_with_the_bursts_asked_for():
    assert budget_s(15) > budget_s(3) and budget_s(120) >= 120 * 60
