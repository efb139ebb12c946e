"""The seams between the cell's lifecycle and the parts built elsewhere: the training hook
(the trainer, in ``services/cell_agent/training``) and the weight-snapshot puller (the
client of ``WeightSnapshots``, in ``services/cell_agent/snapshots.py``).

The defaults keep a cell that has no trainer working: entering and leaving training does
nothing, and JoinBatch answers ``joined=False``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JoinBatch:
    """A fenced command to train on a batch (domain form of ``JoinBatchRequest``)."""

    epoch: int
    batch_id: int
    policy_version: int
    prefix_size: int
    core_target: str


class TrainingHook(Protocol):
    """What the cell calls around its training role."""

    async def on_enter_training(self) -> None:
        """Called after the engine released its rollout resources (DRAINING -> TRAINING)."""

    async def on_leave_training(self) -> None:
        """Called before the engine is restored (TRAINING -> RETURNING)."""

    async def join_batch(self, cmd: JoinBatch) -> bool:
        """Trains on a batch; False if the joining window had closed."""

    def services(self) -> Sequence[tuple[Any, Any, str]]:
        """Extra gRPC services to host on the cell's port (e.g. WeightSnapshots)."""


class NoopTrainingHook:
    """The default hook: no trainer in this process."""

    async def on_enter_training(self) -> None:
        return None

    async def on_leave_training(self) -> None:
        return None

    async def join_batch(self, cmd: JoinBatch) -> bool:
        log.info("JoinBatch without a trainer; not joining", extra={"batch_id": cmd.batch_id})
        return False

    def services(self) -> Sequence[tuple[Any, Any, str]]:
        return ()


class SnapshotPuller(Protocol):
    """Pulls policy ``version`` from a WeightSnapshots target: (version, {name: tensor})."""

    async def __call__(self, target: str, version: int) -> tuple[int, dict[str, Any]]: ...


async def default_pull(target: str, version: int) -> tuple[int, dict[str, Any]]:
    """Pulls through :func:`services.cell_agent.snapshots.pull_snapshot`."""
    from services.cell_agent import snapshots  # imports torch: only when a pull happens

    got_version, tensors = await snapshots.pull_snapshot(target, version)
    return int(got_version), dict(tensors)
