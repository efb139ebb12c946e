"""The cell agents' part of the history check (``svc: "cell"``, one ``cell`` tag a line).

A cell agent writes (services/cell_agent/cell.py, services/cell_agent/training/):

=======  ==================================================================
op       fields
=======  ==================================================================
start    pid (a new incarnation of the cell)
state    frm, to, v, reason (a role change, after its fenced etcd write)
load     prev, v, t0 (weights loaded in place; ``t0`` when the load began)
join     b, v, index (the trainer joined batch b on version v)
train    b, ms, v (a micro-step's gradient computed on version v)
ack      b, ms, claimed (the packer acknowledged it; ``claimed``: when it was handed out)
step     b, v, new_v, applied (the core's optimizer step of batch b, durable)
commit   b (the packer committed batch b)
publish  b, v (policy v announced)
=======  ==================================================================

Promises checked: every role change follows the lifecycle table, and a fenced one never
carries an older epoch than the cell accepted before (within one incarnation); a cell never
serves two versions at once (its weight loads never overlap) nor goes back to an older
version; every micro-step trains on its batch's version (the core's join), none is
acknowledged twice in one attempt at its batch (an attempt starts with the core's join),
and a batch is stepped at most once, each step on a newer version than the last. Across
services: a micro-step a cell saw acknowledged is in the packer's history (nothing
acknowledged and then lost).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.cell_agent.lifecycle import TRANSITIONS, CellState


def _legal(frm: str, to: str) -> bool:
    try:
        source, target = CellState[frm], CellState[to]
    except KeyError:
        return False
    return target in TRANSITIONS[source] or source == target


def check_cells(
    ops: list[dict[str, Any]], packer_acks: Iterable[tuple[str, str]] | None = None
) -> tuple[list[str], dict[str, int]]:
    """Violations in the cells' histories (time order) and counts. ``packer_acks`` are the
    packer's ``(micro-step, cell)`` acknowledgements, when its history is there."""
    bad: list[str] = []
    by_cell: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for n, op in enumerate(ops):
        by_cell.setdefault(str(op.get("cell", "")), []).append((n, op))
    for cell, cell_ops in by_cell.items():
        bad += _check_one_cell(cell, cell_ops)
    bad += _check_training(ops)
    if packer_acks is not None:
        acked = set(packer_acks)
        bad += [
            f"cell #{n}: {op.get('cell')} saw micro-step {op['ms']} acknowledged; "
            "the packer has no such ack (acknowledged, then lost)"
            for n, op in enumerate(ops)
            if op.get("op") == "ack" and (str(op["ms"]), str(op.get("cell"))) not in acked
        ]
    counts = {
        "cell_starts": sum(1 for op in ops if op.get("op") == "start"),
        "cell_role_changes": sum(1 for op in ops if op.get("op") == "state"),
        "cell_loads": sum(1 for op in ops if op.get("op") == "load"),
        "micro_steps_trained": sum(1 for op in ops if op.get("op") == "train"),
        "optimizer_steps": sum(1 for op in ops if op.get("op") == "step" and op.get("applied")),
    }
    return bad, counts


def _check_one_cell(cell: str, ops: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """Role changes and weight loads of one cell, incarnation by incarnation."""
    bad: list[str] = []
    floor = 0
    state = ""
    version: int | None = None
    loading_until = 0.0
    for n, op in ops:
        kind = op.get("op")
        if kind == "start":
            floor, state, version, loading_until = 0, "", None, 0.0
        elif kind == "state":
            frm, to, epoch = str(op.get("frm")), str(op.get("to")), int(op.get("epoch", 0))
            if state and frm != state:
                bad.append(f"cell #{n}: {cell} left {frm} while it was {state}")
            if not _legal(frm, to):
                bad.append(f"cell #{n}: {cell} moved {frm} -> {to} (not in the lifecycle table)")
            if epoch and epoch < floor:
                bad.append(f"cell #{n}: {cell} obeyed epoch {epoch} after epoch {floor} (a deposed leader)")
            floor, state = max(floor, epoch), to
        elif kind == "load":
            t0, t, v = float(op.get("t0", op["t"])), float(op["t"]), int(op["v"])
            if t0 < loading_until:
                bad.append(f"cell #{n}: {cell} loaded v{v} while another load ran (two versions at once)")
            if version is not None and v < version:
                bad.append(f"cell #{n}: {cell} went back from v{version} to v{v}")
            loading_until, version = t, v
    return bad


def _check_training(ops: list[dict[str, Any]]) -> list[str]:
    """Versions, acks and steps across every training cell."""
    bad: list[str] = []
    version: dict[int, int] = {}  # batch -> the version the core opened it on
    opened: dict[int, float] = {}  # batch -> when the core opened its current attempt
    acked: dict[int, dict[str, str]] = {}  # batch -> this attempt's acks: micro-step -> cell
    stepped: dict[int, int] = {}  # batch -> new version of its applied step
    last_new = -1
    for n, op in enumerate(ops):
        kind = op.get("op")
        if kind not in ("join", "train", "ack", "step"):
            continue
        b, cell = int(op["b"]), str(op.get("cell"))
        if kind == "join" and int(op.get("index", -1)) == 0:
            version[b], opened[b] = int(op["v"]), float(op["t"])
            acked[b] = {}  # a new attempt: the packer hands out what an earlier one held
        elif kind == "train":
            if b in version and int(op["v"]) != version[b]:
                bad.append(
                    f"cell #{n}: {cell} trained micro-step {op['ms']} of batch {b} on v{op['v']}, "
                    f"the batch trains on v{version[b]} (mixed weight versions)"
                )
        elif kind == "ack":
            ms = str(op["ms"])
            if float(op.get("claimed", op["t"])) < opened.get(b, 0.0):
                continue  # claimed in an earlier attempt; its ack line came after the reopening
            seen = acked.setdefault(b, {})
            if ms in seen:
                bad.append(
                    f"cell #{n}: micro-step {ms} of batch {b} acknowledged twice in one attempt "
                    f"({seen[ms]}, then {cell})"
                )
            seen[ms] = cell
        elif kind == "step" and op.get("applied"):
            new = int(op["new_v"])
            if b in stepped:
                bad.append(f"cell #{n}: batch {b} stepped twice (v{stepped[b]}, then v{new})")
            if new <= last_new:
                bad.append(f"cell #{n}: batch {b} stepped to v{new} after v{last_new}")
            stepped[b], last_new = new, max(last_new, new)
    return bad
