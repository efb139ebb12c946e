"""What the dashboard reads: a scheduler status as its JSON (``SchedulerStatus`` in proto3
JSON), built from cell states; and the training diagnostics a core publishes with a
version (``DIAG``), as the scheduler's status and the dashboard carry them."""

from __future__ import annotations

from typing import Any

DIAG: dict[str, Any] = {
    "tokens": 1536.0,
    "clip_fraction": 0.125,
    "behaviour_weight_mean": 0.98,
    "behaviour_weight_max": 4.5,
    "behaviour_weight_capped_share": 0.01,
    "entropy": 1.75,
    "logprob_gap_lag0": 0.002,
    "lag_hist": [1000.0, 400.0, 136.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    "lag_mean": 0.435,
    "grad_norm": 0.8,
}
"""One version's training diagnostics (``TrainingDiagnostics`` as JSON): every field set,
distinct values. Never changed in place: tests copy it (``{**DIAG, ...}``)."""


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
