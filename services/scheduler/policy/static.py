"""The baselines Gyre is measured against, used by the simulator and the live scheduler alike.

* :class:`ColocatedSyncPolicy` ("colocated"): verl's hybrid engine; every cell rolls out to
  the barrier (W = 0), then every cell trains.
* :class:`StaticSplitPolicy` ("static"): a fixed R:T split, one burst per update (bursty).
* :class:`AsyncStaticPolicy` ("async-static"): AReaL / slime / verl fully-async: a fixed R:T
  split that never stops dispatching: groups go out whenever the staleness gate
  ``(v + eta + 1) x B + X`` has room (:mod:`.staleness`), with the same eta, the same
  over-provision X and the same cancel-early rule as Gyre. Swept over T and both placements,
  the best is "oracle async static".
* :class:`AsyncStaticLendPolicy` ("async-static-lend"): the same, but trainer cells other than
  the core lend themselves to rollout while the trainer has nothing to do (verl's hybrid
  role-switch idea) and come back when enough ready supply has built up.
* :class:`RolloutOnlyPolicy` ("rollout_only"): no training (bursts back to back).
"""

from __future__ import annotations

import dataclasses

from services.scheduler.policy.actions import (
    Action,
    Hold,
    MoveToTraining,
    PublishPolicy,
    ReturnToRollout,
)
from services.scheduler.policy.common import dispatch_to_gate, drained_actions, next_burst, publish_newest
from services.scheduler.policy.snapshot import TRAINING_SIDE, CellState, CellView, Snapshot, training_set


class ColocatedSyncPolicy:
    """Colocated synchronous: every elastic cell rolls out until the burst's executions
    have all closed (W = 0, the barrier), then every elastic cell trains; at burst end all
    return, the policy is published and the next burst is dispatched."""

    name = "colocated"

    def __init__(self, drain_grace_s: float = 2.0) -> None:
        self.drain_grace_s = drain_grace_s

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        elastic = s.elastic()
        v = s.policy_version
        if s.burst.trained(v):
            actions: list[Action] = [
                ReturnToRollout(
                    c.cell_id, f"returned {c.cell_id} to rollout: burst {s.burst.burst_id} ended at v{v}"
                )
                for c in elastic
                if c.state in TRAINING_SIDE
            ]
            core = next((c for c in elastic if c.is_core), None)
            actions.append(
                PublishPolicy(v, core.cell_id if core else "", f"published policy v{v} to rollout engines")
            )
            return actions + next_burst(
                s, f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}"
            )
        w = s.ledger.waterlevel
        if w > 0:
            return [Hold(f"barrier: W {w} > 0")]
        drained = drained_actions(s, self.drain_grace_s, training_set(elastic))
        if drained is not None:
            return drained
        return [
            MoveToTraining(c.cell_id, f"moved {c.cell_id} to training: barrier reached (W 0)")
            for c in elastic
            if c.state is CellState.ROLLOUT
        ]


@dataclasses.dataclass(frozen=True)
class StaticSplitConfig:
    """Parameters of :class:`StaticSplitPolicy`."""

    training_cells: int = 1
    """T: the lowest-index elastic cells that always train (the rest always roll out)."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a burst counts as drained."""

    def __post_init__(self) -> None:
        if self.training_cells < 0:
            raise ValueError("training_cells must be >= 0")


class StaticSplitPolicy:
    """Bursty static split R:T: the first ``training_cells`` elastic cells train, the others roll
    out, whatever the waterlevel; bursts follow each other at policy publication."""

    name = "static"

    def __init__(self, config: StaticSplitConfig | None = None) -> None:
        self.config = config or StaticSplitConfig()

    def decide(self, s: Snapshot) -> list[Action]:
        elastic = s.elastic()
        t = self.config.training_cells
        actions: list[Action] = []
        for i, c in enumerate(elastic):
            if i < t and c.state is CellState.ROLLOUT:
                actions.append(
                    MoveToTraining(
                        c.cell_id, f"moved {c.cell_id} to training: static split {len(elastic) - t}:{t}"
                    )
                )
            elif i >= t and c.state in TRAINING_SIDE:
                actions.append(
                    ReturnToRollout(
                        c.cell_id, f"returned {c.cell_id} to rollout: static split {len(elastic) - t}:{t}"
                    )
                )
        if s.burst is None:
            return actions + next_burst(
                s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}"
            )
        v = s.policy_version
        if s.burst.trained(v):
            core = next((c for c in elastic if c.is_core), None)
            actions.append(
                PublishPolicy(v, core.cell_id if core else "", f"published policy v{v} to rollout engines")
            )
            actions += next_burst(
                s, f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}"
            )
        elif not actions:
            actions += drained_actions(s, self.config.drain_grace_s, training_set(elastic)) or []
        return actions


class RolloutOnlyPolicy:
    """No training (the walking skeleton, or a cluster without trainers): the next burst is
    dispatched once every execution of the current one has closed."""

    name = "rollout_only"

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        if s.ledger.waterlevel > 0:
            return []
        return next_burst(
            s, f"burst {s.burst.burst_id + 1}: {s.next_quota} executions (burst {s.burst.burst_id} closed)"
        )


def _split_roles(elastic: list[CellView], t: int, why: str) -> list[Action]:
    """Moves toward a split where the first ``t`` elastic cells train."""
    out: list[Action] = []
    for i, c in enumerate(elastic):
        if i < t and c.state is CellState.ROLLOUT:
            out.append(MoveToTraining(c.cell_id, f"moved {c.cell_id} to training: {why}"))
        elif i >= t and c.state in TRAINING_SIDE:
            out.append(ReturnToRollout(c.cell_id, f"returned {c.cell_id} to rollout: {why}"))
    return out


@dataclasses.dataclass(frozen=True)
class AsyncStaticConfig:
    """Parameters of :class:`AsyncStaticPolicy` and :class:`AsyncStaticLendPolicy`."""

    training_cells: int = 1
    """T: the lowest-index elastic cells that train."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a partial batch is sealed (task source exhausted)."""
    reclaim_groups: int = 0
    """Lending only: ready groups that bring lent cells back (0: T // 4 + 1)."""

    def __post_init__(self) -> None:
        if self.training_cells < 0:
            raise ValueError("training_cells must be >= 0")
        if self.reclaim_groups < 0:
            raise ValueError("reclaim_groups must be >= 0")


class AsyncStaticPolicy:
    """Fixed R:T split with continuous dispatch under the staleness gate (AReaL-style)."""

    name = "async-static"

    def __init__(self, config: AsyncStaticConfig | None = None) -> None:
        self.config = config or AsyncStaticConfig()

    def training_target(self, s: Snapshot) -> int:
        """How many of the first elastic cells train now."""
        return self.config.training_cells

    def decide(self, s: Snapshot) -> list[Action]:
        if s.pipeline is None:
            return [Hold("async static needs the pipeline view (per-version ledger)")]
        elastic = [c for c in s.elastic() if c.state is not CellState.FAILED]
        t = min(self.training_target(s), len(elastic))
        actions = _split_roles(elastic, t, f"{self.name} split {len(elastic) - t}:{t}")
        actions += publish_newest(s)
        actions += dispatch_to_gate(s)
        if not actions:
            actions += drained_actions(s, self.config.drain_grace_s, training_set(elastic)) or []
        return actions


class AsyncStaticLendPolicy(AsyncStaticPolicy):
    """Async static split whose idle trainer cells (all but the core) lend themselves to
    rollout: when the trainer has no backlog, no ready group and no optimizer step, only the
    core stays; the others come back once ``reclaim_groups`` ready groups wait."""

    name = "async-static-lend"

    def training_target(self, s: Snapshot) -> int:
        p = s.pipeline
        assert p is not None
        t = self.config.training_cells
        reclaim = self.config.reclaim_groups or (t // 4 + 1)
        lent = any(
            c.index < t and c.state is not CellState.FAILED and c.state not in TRAINING_SIDE
            for c in s.elastic()
            if c.index > 0
        )
        idle = p.backlog_tokens <= 0 and p.ready_groups == 0 and not p.optimizing
        if idle:
            return min(t, 1)
        if lent and p.ready_groups < reclaim and p.backlog_tokens > 0:
            return len(training_set(s.cells)) or min(t, 1)  # keep lending until supply builds up
        return t
