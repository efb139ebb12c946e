"""What a policy returns: actions (frozen dataclasses, each with ``kind`` and ``reason``) and
the :class:`Policy` protocol.

A caller applies the actions in the order given. Burst-synchronous policies use the first
seven; the asynchronous ones add :class:`Migrate` and :class:`PlanMoves` (a caller that does
not implement them yet may ignore them: they are optimizations, never needed for safety).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from services.scheduler.policy.snapshot import Snapshot


@dataclasses.dataclass(frozen=True)
class MoveToTraining:
    """Drain the cell, reroute its executions, then switch it to training."""

    cell_id: str
    reason: str
    kind: str = "cell_to_training"


@dataclasses.dataclass(frozen=True)
class ReturnToRollout:
    """Take the cell out of training (load the newest policy) and back to rollout."""

    cell_id: str
    reason: str
    kind: str = "cell_to_rollout"


@dataclasses.dataclass(frozen=True)
class KeepInTraining:
    """The core stays in training for the next batch (burst end)."""

    cell_id: str
    reason: str
    kind: str = "core_kept"


@dataclasses.dataclass(frozen=True)
class PublishPolicy:
    """Load policy ``version`` (from the core) on every rollout engine."""

    version: int
    source_cell_id: str
    reason: str
    kind: str = "policy_published"


@dataclasses.dataclass(frozen=True)
class DispatchBurst:
    """Publish a burst of ``quota`` new executions stamped with ``policy_version`` (the
    version they serve). Asynchronous policies dispatch whenever the staleness gate has room
    (bursts overlap); ``quota`` is then exact (whole groups)."""

    burst_id: int
    quota: int
    policy_version: int
    reason: str
    kind: str = "burst_started"


@dataclasses.dataclass(frozen=True)
class SealBatch:
    """Tell the packer to seal batch ``batch_id`` with the groups it has: the burst is
    drained and no more groups will come for it."""

    batch_id: int
    reason: str
    kind: str = "batch_sealed"


@dataclasses.dataclass(frozen=True)
class Migrate:
    """Move one live execution to ``cell_id`` as a continuation: the same reroute a draining
    cell uses (stop the source request, route to the destination, retry there; its KV moves
    with the handoff where enabled, else the destination recomputes the prefix)."""

    execution_id: str
    cell_id: str
    reason: str
    kind: str = "migrated"


@dataclasses.dataclass(frozen=True)
class PlanMoves:
    """The cells the policy expects to move to training next (in order). Placement launches
    nothing new on them while other rollout cells have room, so they empty by themselves;
    an empty tuple clears the plan. Level-triggered: repeating the same plan changes nothing."""

    cell_ids: tuple[str, ...]
    reason: str
    kind: str = "moves_planned"


@dataclasses.dataclass(frozen=True)
class Hold:
    """Nothing moves; the reason says which check failed (informational)."""

    reason: str
    cell_id: str = ""
    kind: str = "hold"


Action = (
    MoveToTraining
    | ReturnToRollout
    | KeepInTraining
    | PublishPolicy
    | DispatchBurst
    | SealBatch
    | Migrate
    | PlanMoves
    | Hold
)


class Policy(Protocol):
    """A role policy: a pure function of a snapshot."""

    name: str

    def decide(self, snapshot: Snapshot) -> list[Action]: ...
