"""The scheduler's status (GetStatus), typed: what operators and the dashboard see."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gyre.diagnostics import MAX_LAG_BUCKETS, TRAINING_SCALARS
from services.scheduler.fleet import Fleet
from services.scheduler.policy import CellKind, CellState, LedgerCounts


@dataclasses.dataclass(frozen=True)
class CellStatus:
    """One cell: its registration, role, load and the policy version its engine serves."""

    cell_id: str
    kind: CellKind
    index: int
    state: CellState
    slots: int
    routed: int
    """Executions routed to it (reservations included)."""
    target: str
    policy_version: int


@dataclasses.dataclass(frozen=True)
class TrainingDiagnostics:
    """The loss diagnostics of the training step that produced ``policy_version`` (the
    ``training`` object of the policy record at ``keys.policy()``)."""

    policy_version: int
    tokens: float = 0.0
    clip_fraction: float = 0.0
    behaviour_weight_mean: float = 0.0
    behaviour_weight_max: float = 0.0
    behaviour_weight_capped_share: float = 0.0
    entropy: float = 0.0
    logprob_gap_lag0: float = 0.0
    lag_hist: tuple[float, ...] = ()
    """Loss tokens by version lag: 0 .. 6, then 7 or more."""
    lag_mean: float = 0.0
    grad_norm: float = 0.0

    @classmethod
    def from_record(cls, version: int, raw: Any) -> TrainingDiagnostics | None:
        """The diagnostics of a policy record's ``training`` value; None when it has none (or
        it is not an object). A missing or non-numeric scalar reads as 0, a non-finite one
        is kept (a diverging step is what operators must see)."""
        if not isinstance(raw, Mapping) or not raw:
            return None
        hist = raw.get("lag_hist")
        lag_hist = tuple(_number(x) for x in hist[:MAX_LAG_BUCKETS]) if isinstance(hist, list | tuple) else ()
        return cls(version, lag_hist=lag_hist, **{k: _number(raw.get(k)) for k in TRAINING_SCALARS})


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return 0.0
    try:
        return float(value)
    except ValueError:
        return 0.0


@dataclasses.dataclass(frozen=True)
class SchedulerStatus:
    """The leader's view (a standby reports ``leader=False`` and what it mirrors)."""

    epoch: int
    leader: bool
    policy: str
    """The policy's name."""
    burst_id: int
    """The newest burst (0: none yet)."""
    burst: LedgerCounts
    """D / L / F of the newest burst."""
    burst_by_status: Mapping[str, int]
    total: LedgerCounts
    """D / L / F of all bursts."""
    total_by_status: Mapping[str, int]
    capacity: int
    ready_groups: int
    batch_size: int
    policy_version: int
    cells: tuple[CellStatus, ...]
    reroutes: int
    bursts_completed: int
    """Bursts whose final version has been published."""
    to_training: int
    to_rollout: int
    versions: Mapping[int, LedgerCounts] = dataclasses.field(default_factory=dict)
    """D / L / F per policy version the bursts were dispatched with."""
    migrations: int = 0
    open_bursts: int = 0
    """Bursts with an execution not yet closed (more than one while bursts overlap)."""
    stale_rule: str = "cancel"
    groups_cancelled: int = 0
    groups_restamped: int = 0
    """Groups the rule for unconsumable groups cancelled / restamped (gyre.staleness)."""
    training: TrainingDiagnostics | None = None
    """The newest policy record's training diagnostics (None: it carries none)."""


def cell_statuses(fleet: Fleet) -> tuple[CellStatus, ...]:
    """Every registered cell, in the policy's order (standalone first, then by index)."""
    routed = fleet.routes.counts()
    out = []
    for v in fleet.cells.views():
        rec = fleet.cells.get(v.cell_id)
        out.append(
            CellStatus(
                v.cell_id,
                v.kind,
                v.index,
                v.state,
                v.slots,
                routed.get(v.cell_id, 0),
                rec.target if rec else "",
                fleet.version(v.cell_id),
            )
        )
    return tuple(out)
