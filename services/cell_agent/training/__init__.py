"""Streaming elastic training of one cell: trainer, core optimizer, prefix groups, controller.

The cell agent's ``__main__`` imports :func:`build_hook` from here (lazily: torch and the
trainer load only for cells that train).
"""

from __future__ import annotations

from typing import Any


def build_hook(rt: Any, cfg: Any, history: Any = None) -> Any:
    """See :func:`services.cell_agent.training.hook.build_hook`. A cell without a ``training``
    section gets the no-op hook here: the hook module imports torch (seconds on a loaded
    machine, on the event loop), so it is imported only for cells that may train."""
    if cfg.training is None:
        from services.cell_agent.hooks import NoopTrainingHook

        return NoopTrainingHook()
    from services.cell_agent.training.hook import build_hook as _build

    return _build(rt, cfg, history)
