"""The demo counts cell moves and satellite joins from the services' histories, so a
scheduler failover does not reset them (its counters live in the leader's memory: a run
with the scheduler SIGKILLed reported 0 moves although cell-0 had moved to training)."""

from __future__ import annotations

import json
from pathlib import Path

from apps.demo.moves import moves_from_histories, role_moves


def _state(cell: str, frm: str, to: str) -> dict:
    return {"op": "state", "cell": cell, "frm": frm, "to": to}


def _emit(ms: str, batch: int) -> dict:
    return {"op": "emit", "ms": ms, "b": batch}


def _claim(ms: str, cell: str) -> dict:
    return {"op": "claim", "ms": ms, "cell": cell, "v": 0}


CELL_OPS = [
    _state("cell-0", "STARTING", "ROLLOUT"),  # start-up: not a move
    _state("cell-0", "ROLLOUT", "DRAINING"),
    _state("cell-0", "DRAINING", "TRAINING"),
    _state("cell-1", "ROLLOUT", "DRAINING"),
    _state("cell-1", "DRAINING", "TRAINING"),
    _state("cell-1", "TRAINING", "RETURNING"),
    _state("cell-1", "RETURNING", "ROLLOUT"),
    {"op": "start", "cell": "cell-1"},  # restarted by the supervisor ...
    _state("cell-1", "STARTING", "ROLLOUT"),  # ... its start-up is not a move either
    _state("cell-2", "ROLLOUT", "DRAINING"),
    _state("cell-2", "DRAINING", "ROLLOUT"),  # a move called off before training: no move back
]

PACKER_OPS = [
    _emit("b1-m0", 1),
    _emit("b1-m1", 1),
    _emit("b1-m2", 1),
    _claim("b1-m0", "cell-0"),
    _claim("b1-m1", "cell-1"),  # cell-1 joins batch 1
    _claim("b1-m2", "cell-1"),  # the same join
    _emit("b2-m0", 2),
    _emit("b2-m1", 2),
    _claim("b2-m0", "cell-0"),
    _claim("b2-m1", "cell-0"),  # the core alone
    _claim("b9-m0", "cell-2"),  # never emitted (a torn history): not counted
]


def test_moves_and_joins_are_counted_from_history_records():
    assert role_moves(CELL_OPS, PACKER_OPS) == {
        "transitions_to_training": 2,
        "transitions_to_rollout": 1,
        "satellite_joins": 1,
    }


def test_a_run_folder_without_histories_counts_nothing(tmp_path: Path):
    assert moves_from_histories(tmp_path) == {
        "transitions_to_training": 0,
        "transitions_to_rollout": 0,
        "satellite_joins": 0,
    }


def test_histories_on_disk_with_a_torn_last_line(tmp_path: Path):
    (tmp_path / "cell_agent.jsonl").write_text(
        "".join(json.dumps(op) + "\n" for op in CELL_OPS) + '{"op": "st'
    )
    (tmp_path / "packer.jsonl").write_text("".join(json.dumps(op) + "\n" for op in PACKER_OPS))
    assert moves_from_histories(tmp_path)["satellite_joins"] == 1
    assert moves_from_histories(tmp_path)["transitions_to_training"] == 2
