"""Role decisions as pure functions: snapshot in, actions (each with its reason) out.

This package owns *what* the scheduler decides; it has no I/O (no grpc, no etcd, no asyncio)
and no clock of its own: time comes in ``Snapshot.now_s``. The live scheduler and the
cluster simulator drive the same code, so policies are compared on the same trace.

Modules:

* :mod:`.snapshot` — what a policy sees: :class:`Snapshot` (``now_s, ledger, cells, supply,
  burst, policy_version, next_quota, drained_since_s, pipeline, executions``),
  :class:`LedgerCounts` (D / L / F, ``waterlevel`` W = D - F), :class:`CellView` (``load``:
  executions routed there), :class:`Supply` + :class:`SupplyTracker`, :class:`BurstView`, and
  for the asynchronous policies :class:`Pipeline` (eta, per-version ledger
  :class:`VersionCounts`, trainer backlog, per-cell training rate, arrival rate of ready
  groups, tokens per group, planned moves) and :class:`ExecView` (tail executions).
* :mod:`.actions` — :class:`MoveToTraining`, :class:`ReturnToRollout`, :class:`KeepInTraining`,
  :class:`PublishPolicy`, :class:`DispatchBurst` (stamped with the version it serves),
  :class:`SealBatch`, :class:`Migrate` (one execution to a cell: the continuation reroute),
  :class:`PlanMoves` (cells placement should keep free), :class:`Hold`; the :class:`Policy`
  protocol (``name``, ``decide(snapshot) -> list[Action]``).
* :mod:`.staleness` — the bound eta (``max_staleness``: one setting for scheduler, packer and
  simulator), the gate ``(v + eta + 1) x B + X``, the **cancel-early** rule for groups that
  can no longer be consumed within eta (the same for every policy), and W_eta, the waterlevel
  of overlapping bursts, with its invariant.
* :mod:`.gyre` — :class:`GyrePolicy` ("gyre", the default of the live scheduler, its configs
  and the simulator): continuous dispatch, a training prefix sized from rates, W_eta
  covered, hysteresis, PlanMoves and Migrate for the tail.
* :mod:`.waterlevel` — the seed's burst-synchronous :class:`WaterlevelPolicy`
  ("waterlevel-sync"; "waterlevel" is its old name, kept as an alias).
* :mod:`.static` — the baselines: :class:`ColocatedSyncPolicy`, :class:`StaticSplitPolicy`
  (bursty), :class:`AsyncStaticPolicy` (AReaL-style), :class:`AsyncStaticLendPolicy` (verl's
  hybrid role switch), :class:`RolloutOnlyPolicy`.

For the live scheduler (how to run the asynchronous policies): fill ``Snapshot.pipeline``
(per-version ledger from the burst records, the packer's ready / assigned / backlog counts,
rates measured over a window), apply ``DispatchBurst.quota`` exactly (whole groups, stamped
``policy_version``), apply the cancel-early rule from :func:`.staleness.unconsumable` in the
packer (drop the ready copy) and the scheduler (cancel the open members), implement
``Migrate`` with the reroute used for draining, and let placement avoid
``PlanMoves.cell_ids``. ``decide`` is level-triggered: called with the same snapshot it
returns the same actions, so a caller applies them (and lets the next snapshot reflect them)
before asking again; repeated ``PublishPolicy`` / ``PlanMoves`` are no-ops.
"""

from __future__ import annotations

from typing import Literal, get_args

from services.scheduler.policy import staleness
from services.scheduler.policy.actions import (
    Action,
    DispatchBurst,
    Hold,
    KeepInTraining,
    Migrate,
    MoveToTraining,
    PlanMoves,
    Policy,
    PublishPolicy,
    ReturnToRollout,
    SealBatch,
)
from services.scheduler.policy.gyre import GyreConfig, GyrePolicy
from services.scheduler.policy.snapshot import (
    BurstView,
    CellKind,
    CellState,
    CellView,
    ExecView,
    LedgerCounts,
    Pipeline,
    Snapshot,
    Supply,
    SupplyTracker,
    VersionCounts,
    capacity,
    is_prefix,
    training_set,
)
from services.scheduler.policy.static import (
    AsyncStaticConfig,
    AsyncStaticLendPolicy,
    AsyncStaticPolicy,
    ColocatedSyncPolicy,
    RolloutOnlyPolicy,
    StaticSplitConfig,
    StaticSplitPolicy,
)
from services.scheduler.policy.waterlevel import WaterlevelConfig, WaterlevelPolicy

ASYNC_POLICIES = ("gyre", "async-static", "async-static-lend")
"""Policies that dispatch continuously and need ``Snapshot.pipeline``."""

PolicyName = Literal[
    "gyre",
    "waterlevel-sync",
    "waterlevel",
    "colocated",
    "static",
    "async-static",
    "async-static-lend",
    "rollout_only",
]
"""The policies :func:`make_policy` builds (the scheduler's ``policy`` setting)."""

POLICIES: tuple[str, ...] = get_args(PolicyName)


def make_policy(
    name: str,
    *,
    fraction: float = 0.5,
    interval_s: float = 5.0,
    training_cells: int = 1,
    drain_grace_s: float = 2.0,
    gyre: GyreConfig | None = None,
) -> Policy:
    """Builds a policy by name (see ``POLICIES``)."""
    if name in ("waterlevel", "waterlevel-sync"):
        return WaterlevelPolicy(WaterlevelConfig(fraction, interval_s, drain_grace_s), name=name)
    if name == "gyre":
        cfg = gyre or GyreConfig()
        if cfg.drain_grace_s != drain_grace_s:
            cfg = GyreConfig(**{**cfg.__dict__, "drain_grace_s": drain_grace_s})
        return GyrePolicy(cfg)
    if name == "colocated":
        return ColocatedSyncPolicy(drain_grace_s)
    if name == "static":
        return StaticSplitPolicy(StaticSplitConfig(training_cells, drain_grace_s))
    if name == "async-static":
        return AsyncStaticPolicy(AsyncStaticConfig(training_cells, drain_grace_s))
    if name == "async-static-lend":
        return AsyncStaticLendPolicy(AsyncStaticConfig(training_cells, drain_grace_s))
    if name == "rollout_only":
        return RolloutOnlyPolicy()
    raise ValueError(f"unknown policy {name!r} ({', '.join(POLICIES)})")


__all__ = [
    "ASYNC_POLICIES",
    "POLICIES",
    "PolicyName",
    "Action",
    "AsyncStaticConfig",
    "AsyncStaticLendPolicy",
    "AsyncStaticPolicy",
    "BurstView",
    "CellKind",
    "CellState",
    "CellView",
    "ColocatedSyncPolicy",
    "DispatchBurst",
    "ExecView",
    "GyreConfig",
    "GyrePolicy",
    "Hold",
    "KeepInTraining",
    "LedgerCounts",
    "Migrate",
    "MoveToTraining",
    "Pipeline",
    "PlanMoves",
    "Policy",
    "PublishPolicy",
    "ReturnToRollout",
    "RolloutOnlyPolicy",
    "SealBatch",
    "Snapshot",
    "StaticSplitConfig",
    "StaticSplitPolicy",
    "Supply",
    "SupplyTracker",
    "VersionCounts",
    "WaterlevelConfig",
    "WaterlevelPolicy",
    "capacity",
    "is_prefix",
    "make_policy",
    "staleness",
    "training_set",
]
