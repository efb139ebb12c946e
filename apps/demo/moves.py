"""How the cells moved in a run, counted from the services' histories.

The scheduler's own counters live in its leader's memory: a scheduler SIGKILLed mid-run
came back counting from 0 (a chaos run reported 0 transitions although the dashboard had
shown cell-0 moving to training). The histories are append-only files every process writes
across restarts, so these counts survive any failover:

- a move to training is a cell's ``state`` record into ``TRAINING``;
- a move back to rollout is one into ``ROLLOUT`` from the training side (``TRAINING`` or
  ``RETURNING``); a cell's start-up (``STARTING`` -> ``ROLLOUT``) is not a move;
- a satellite join is a cell claiming micro-steps of a batch that another cell claimed
  first (the core claims first: it opens the batch), counted once per batch and cell.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gyre.history import read as read_history

TRAINING_SIDE = ("TRAINING", "RETURNING")


def role_moves(
    cell_ops: Iterable[Mapping[str, Any]], packer_ops: Iterable[Mapping[str, Any]]
) -> dict[str, int]:
    """``transitions_to_training``, ``transitions_to_rollout`` and ``satellite_joins`` from
    the cell agents' and the packer's history records (in file order)."""
    to_training = to_rollout = 0
    for op in cell_ops:
        if op.get("op") != "state":
            continue
        if op.get("to") == "TRAINING" and op.get("frm") != "TRAINING":
            to_training += 1
        elif op.get("to") == "ROLLOUT" and op.get("frm") in TRAINING_SIDE:
            to_rollout += 1
    batch_of: dict[str, int] = {}
    claimers: dict[int, list[str]] = collections.defaultdict(list)
    for op in packer_ops:
        kind = op.get("op")
        if kind == "emit":
            batch_of[str(op["ms"])] = int(op["b"])
        elif kind == "claim":
            batch = batch_of.get(str(op["ms"]))
            cell = str(op.get("cell", ""))
            if batch is not None and cell and cell not in claimers[batch]:
                claimers[batch].append(cell)
    joins = sum(max(0, len(cells) - 1) for cells in claimers.values())
    return {
        "transitions_to_training": to_training,
        "transitions_to_rollout": to_rollout,
        "satellite_joins": joins,
    }


def moves_from_histories(history_dir: Path) -> dict[str, int]:
    """:func:`role_moves` over ``history_dir``'s ``cell_agent.jsonl`` and ``packer.jsonl``
    (a missing file counts as empty)."""

    def ops(name: str) -> list[dict[str, Any]]:
        path = history_dir / name
        return read_history(path) if path.exists() else []

    return role_moves(ops("cell_agent.jsonl"), ops("packer.jsonl"))
