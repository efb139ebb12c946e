"""Commands: carrying out the policy's actions (one ``match`` over the typed action union).

Each action is applied at most once where that matters (a move for a cell already moving,
a batch already sealed, a version already published are skipped), because the policy is
level-triggered and repeats itself until the next snapshot reflects what was done.
"""

from __future__ import annotations

import logging

from gyre.errors import GyreError
from services.scheduler.bursts import Bursts
from services.scheduler.parts import Part, Shared
from services.scheduler.policy import (
    Action,
    CellState,
    DispatchBurst,
    Hold,
    KeepInTraining,
    Migrate,
    MoveToTraining,
    PlanMoves,
    PublishPolicy,
    ReturnToRollout,
    SealBatch,
    Snapshot,
    capacity,
)
from services.scheduler.publication import Publication
from services.scheduler.transitions import TransitionRunner

log = logging.getLogger(__name__)


class Commands(Part):
    """Applies actions to the cluster; counts role switches."""

    def __init__(
        self, *, shared: Shared, bursts: Bursts, transitions: TransitionRunner, publication: Publication
    ) -> None:
        super().__init__(shared=shared)
        self.bursts = bursts
        self.transitions = transitions
        self.publication = publication
        self.to_training = 0
        self.to_rollout = 0
        self._sealed: set[int] = set()

    async def apply(self, action: Action, snap: Snapshot) -> None:
        """Carries out one action decided on ``snap``."""
        gauges = {
            "waterlevel": snap.ledger.waterlevel,
            "capacity": capacity(snap.cells),
            "ready_groups": snap.supply.ready_groups,
        }
        emit = self.telemetry.emit
        match action:
            case Hold(reason=reason, cell_id=cell_id):
                emit(action.kind, reason, cell_id=cell_id, **gauges)
            case DispatchBurst():
                await self.bursts.dispatch(action.policy_version, action.quota, action.kind, gauges)
            case MoveToTraining(cell_id=cell_id, reason=reason):
                if self._move(cell_id, CellState.TRAINING, action.kind, reason, gauges):
                    self.to_training += 1
            case ReturnToRollout(cell_id=cell_id, reason=reason):
                if self._move(cell_id, CellState.ROLLOUT, action.kind, reason, gauges):
                    self.to_rollout += 1
            case KeepInTraining(cell_id=cell_id):
                emit(action.kind, action.reason, cell_id=cell_id, **gauges)
                self.transitions.rejoin(cell_id)
            case SealBatch(batch_id=batch_id):
                await self._seal(batch_id, action.kind, action.reason, gauges)
            case Migrate(execution_id=execution_id, cell_id=cell_id, reason=reason):
                self.transitions.migrate(execution_id, cell_id, reason)
            case PlanMoves(cell_ids=cell_ids):
                self._plan(cell_ids, action.kind, action.reason, gauges)
            case PublishPolicy(version=version):
                if self.publication.publish(version, self.transitions.running):
                    emit(action.kind, action.reason, cell_id=action.source_cell_id, **gauges)

    def _plan(self, cell_ids: tuple[str, ...], kind: str, reason: str, gauges: dict[str, int]) -> None:
        """Placement avoids the planned cells from now on (a repeated plan changes nothing)."""
        if tuple(cell_ids) == self.fleet.planned:
            return
        self.fleet.planned = tuple(cell_ids)
        self.telemetry.emit(kind, reason, **gauges)

    def _move(self, cell_id: str, target: CellState, kind: str, reason: str, gauges: dict[str, int]) -> bool:
        """Starts a transition unless one runs for the cell; True when started."""
        if self.transitions.running(cell_id):
            return False
        self.telemetry.emit(kind, reason, cell_id=cell_id, **gauges)
        self.transitions.start(cell_id, target, reason)
        return True

    async def _seal(self, batch_id: int, kind: str, reason: str, gauges: dict[str, int]) -> None:
        if batch_id in self._sealed:
            return
        try:
            await self.peers.seal_batch(self.lead.epoch, batch_id)
        except GyreError as exc:  # e.g. no group assigned yet: the next tick retries
            log.info("seal refused: %s", exc)
            return
        self._sealed.add(batch_id)
        self.telemetry.emit(kind, reason, **gauges)
