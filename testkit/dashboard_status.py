"""What the dashboard reads: a scheduler status as its JSON (``SchedulerStatus`` in proto3
JSON), built from cell states."""

from __future__ import annotations

from typing import Any


def status(
    states: dict[str, str], epoch: int = 1, version: int = 0, w: int = 10, cap: int = 16
) -> dict[str, Any]:
    cells = []
    for i, (cell_id, state) in enumerate(states.items()):
        standalone = cell_id.startswith("s")
        cells.append(
            {
                "cell_id": cell_id,
                "kind": "CELL_KIND_STANDALONE" if standalone else "CELL_KIND_ELASTIC",
                "index": -1 if standalone else i,
                "state": f"CELL_STATE_{state}",
                "slots": 8,
            }
        )
    return {
        "epoch": str(epoch),
        "capacity": cap,
        "policy_version": version,
        "reroutes": 0,
        "ledger": {"burst_id": 1, "dispatched": 20, "finished": 20 - w, "waterlevel": w},
        "cells": cells,
    }
