"""What this cell's batches did and what it remembers of them: :class:`BatchOutcome` (one
batch on this cell, what ``wait_batch`` answers) and :class:`BatchBook` (the batches this
cell joined: the task of each one's current attempt and each finished one's outcome, the
newest ``keep_batches`` of them kept, so that a run of days holds a bounded state)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from services.cell_agent.training.params import ControllerParams


@dataclasses.dataclass
class BatchOutcome:
    """What one batch did on this cell."""

    batch_id: int
    base_version: int
    new_version: int = 0
    prefix_size: int = 0
    local_tokens: int = 0
    local_micro_steps: int = 0
    total_tokens: int = 0  # core only
    stale_participants: int = 0  # core only: satellites that contributed nothing
    applied: bool = False
    stale: bool = False  # satellite: could not hold version base_version
    joined_s: float = 0.0  # satellite: join → weights ready (pull) seconds
    first_micro_step_s: float = 0.0  # join → first micro-step accumulated
    seconds: float = 0.0
    diagnostics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Core only: the batch's loss diagnostics over every participant's tokens
    (:meth:`LossStats.summary`) and the gradient norm before clipping."""


class BatchBook:
    """The tasks and outcomes of the batches this cell joined, bounded."""

    def __init__(self, params: ControllerParams) -> None:
        self.params = params
        self.tasks: dict[int, asyncio.Task[BatchOutcome]] = {}
        self.outcomes: dict[int, BatchOutcome] = {}
        self.forgotten = 0  # the newest batch id whose task was dropped (see keep_batches)

    def record(self, out: BatchOutcome) -> None:
        """Keeps a finished batch's outcome (forgetting the oldest beyond the bound)."""
        self.outcomes[out.batch_id] = out
        self.forget_old()

    def forget_old(self) -> None:
        """Drops the tasks and outcomes of finished batches older than the newest
        ``keep_batches``. Before, every batch's task (its coroutine, its outcome and the
        diagnostics; a failed one's traceback with its frames' tensors) stayed for the life
        of the process: a few KB more per batch, without end."""
        keep = max(1, self.params.keep_batches)
        for b in sorted(self.tasks)[: max(0, len(self.tasks) - keep)]:
            if self.tasks[b].done():
                del self.tasks[b]
                self.forgotten = max(self.forgotten, b)
        for b in sorted(self.outcomes)[: max(0, len(self.outcomes) - keep)]:
            del self.outcomes[b]
