"""Streaming elastic training of one cell: trainer, core optimizer, prefix groups, controller.

The cell agent's ``__main__`` imports :func:`build_hook` from here (lazily: torch and the
trainer load only for cells that train).
"""

from __future__ import annotations

from typing import Any


def build_hook(rt: Any, cfg: Any) -> Any:
    """See :func:`services.cell_agent.training.hook.build_hook` (imported on call: torch and
    the trainer load only for cells that train)."""
    from services.cell_agent.training.hook import build_hook as _build

    return _build(rt, cfg)
