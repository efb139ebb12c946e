"""The seed's burst-synchronous waterlevel policy ("waterlevel-sync"; "waterlevel" is the same
policy under its old name, kept as an alias; the default policy is "gyre").

One burst per update: ``DispatchBurst`` only at burst end. Mid-burst, the next elastic cell
moves to training only when the rollout capacity left behind covers the seed's waterlevel
W = D - F (every open execution) and the ready supply (capped by the batch's need) has held
at ``fraction * batch_size`` for ``interval_s``; at burst end satellites return and the core
stays only if both checks still pass with the next burst's quota counted.

Properties (tested with hypothesis in tests/unit/test_scheduler_policy.py): capacity after a
move >= W; the training set is a prefix of the elastic cells (core first); no move before the
supply condition held for ``interval_s`` (except the core of a drained burst); at most one
move in flight.
"""

from __future__ import annotations

import dataclasses
import math

from services.scheduler.policy.actions import (
    Action,
    Hold,
    KeepInTraining,
    MoveToTraining,
    PublishPolicy,
    ReturnToRollout,
)
from services.scheduler.policy.common import drained_actions, fmt, next_burst, repair_prefix
from services.scheduler.policy.snapshot import (
    IN_FLIGHT,
    TRAINING_SIDE,
    CellState,
    Snapshot,
    SupplyTracker,
    capacity,
    training_set,
)

# Gyre: the waterlevel policy ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WaterlevelConfig:
    """Parameters of :class:`WaterlevelPolicy`."""

    fraction: float = 0.5
    """Ready groups needed, as a fraction of the batch size, in (0, 1]."""
    interval_s: float = 5.0
    """How long the supply condition must hold before a move, seconds (>= 0)."""
    drain_grace_s: float = 2.0
    """How long W must stay 0 before a burst counts as drained (see Snapshot.drained_since_s)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError("fraction must be in (0, 1]")
        if not (self.interval_s >= 0.0 and math.isfinite(self.interval_s)):
            raise ValueError("interval_s must be finite and >= 0")
        if not (self.drain_grace_s >= 0.0 and math.isfinite(self.drain_grace_s)):
            raise ValueError("drain_grace_s must be finite and >= 0")


class WaterlevelPolicy:
    """Gyre: move the next elastic cell to training only when rollout capacity left behind
    covers the waterlevel and the training supply has held; return satellites at burst end.

    Mid-burst: at most one move per decision and none while any elastic cell is in flight
    (DRAINING, RETURNING); the candidate is the lowest-index elastic cell after
    the training prefix, and it must be in ROLLOUT. Checks, in order: capacity after the
    move >= W; supply >= fraction * batch_size held for interval_s.

    Burst end (the burst's final version published): every satellite in training returns;
    the new version is published to rollout engines; the core stays in training only if
    capacity without it covers W plus the next burst's quota and the supply check passes;
    then the next burst is dispatched.
    """

    name = "waterlevel-sync"

    def __init__(self, config: WaterlevelConfig | None = None, name: str = "waterlevel-sync") -> None:
        self.config = config or WaterlevelConfig()
        self.name = name

    def tracker(self) -> SupplyTracker:
        """A supply tracker with this policy's fraction."""
        return SupplyTracker(self.config.fraction)

    def supply_ok(self, s: Snapshot) -> tuple[bool, str]:
        cfg = self.config
        need = cfg.fraction * s.supply.batch_size
        held = s.supply.held_for(s.now_s)
        frac = s.supply.fraction
        if s.supply.ready_groups < need or s.supply.held_since_s is None:
            return False, f"supply {frac:.2f} < {fmt(cfg.fraction)}"
        if held < cfg.interval_s:
            return (
                False,
                f"supply {frac:.2f} >= {fmt(cfg.fraction)} for {held:.1f} s < {cfg.interval_s:.1f} s",
            )
        return True, f"supply {frac:.2f} >= {fmt(cfg.fraction)} for {held:.1f} s"

    def decide(self, s: Snapshot) -> list[Action]:
        if s.burst is None:
            return next_burst(s, f"first burst: {s.next_quota} executions at policy v{s.policy_version}")
        if s.burst.trained(s.policy_version):
            return self._burst_end(s)
        return self._mid_burst(s)

    def _mid_burst(self, s: Snapshot) -> list[Action]:
        elastic = s.elastic()
        prefix = training_set(elastic)
        repair = repair_prefix(elastic, prefix)
        if repair:
            return repair
        busy = [c for c in elastic if c.state in IN_FLIGHT]
        if busy:
            return [Hold(f"waiting: {busy[0].cell_id} is {busy[0].state.value}", busy[0].cell_id)]
        drained = drained_actions(s, self.config.drain_grace_s, prefix)
        if drained is not None:
            return drained
        rest = [c for c in elastic if c.state not in TRAINING_SIDE and c.state is not CellState.FAILED]
        if not rest:
            return []
        cand = rest[0]
        if not prefix and not cand.is_core:
            return [Hold("waiting: no core cell (index 0) to start training with")]
        if cand.state is not CellState.ROLLOUT or any(c.index > cand.index for c in prefix):
            return [Hold(f"waiting: next cell {cand.cell_id} is {cand.state.value}", cand.cell_id)]
        w = s.ledger.waterlevel
        after = capacity(s.cells) - cand.slots
        if after < w:
            return [Hold(f"kept {cand.cell_id} in rollout: capacity {after} < W {w}", cand.cell_id)]
        ok, why = self.supply_ok(s)
        if not ok and not prefix and s.supply.ready_groups > 0 and s.drained_for(self.config.drain_grace_s):
            # Nothing more will come for this batch: train on what is ready.
            ok, why = (
                True,
                f"burst {s.burst.burst_id if s.burst else 0} drained with {s.supply.ready_groups} ready groups",
            )
        if not ok:
            return [Hold(f"kept {cand.cell_id} in rollout: {why}", cand.cell_id)]
        return [
            MoveToTraining(
                cand.cell_id, f"moved {cand.cell_id} to training: capacity {after} >= W {w}, {why}"
            )
        ]

    def _burst_end(self, s: Snapshot) -> list[Action]:
        assert s.burst is not None
        actions: list[Action] = []
        elastic = s.elastic()
        core = next((c for c in elastic if c.is_core), None)
        v = s.policy_version
        for c in elastic:
            if not c.is_core and c.state in TRAINING_SIDE:
                actions.append(
                    ReturnToRollout(
                        c.cell_id, f"returned {c.cell_id} to rollout: burst {s.burst.burst_id} ended at v{v}"
                    )
                )
        source = core.cell_id if core is not None else ""
        actions.append(
            PublishPolicy(v, source, f"published policy v{v} from {source or 'core'} to rollout engines")
        )
        if core is not None and core.state in TRAINING_SIDE:
            # Capacity once the satellites are back, without the core.
            back = sum(
                c.slots
                for c in s.cells
                if c.state is CellState.ROLLOUT
                or (c.elastic and not c.is_core and c.state in (*TRAINING_SIDE, CellState.RETURNING))
            )
            pending = s.ledger.waterlevel + max(0, s.next_quota)
            ok, why = self.supply_ok(s)
            if s.next_quota > 0 and back >= pending and ok:
                actions.append(
                    KeepInTraining(
                        core.cell_id,
                        f"kept {core.cell_id} in training: capacity {back} >= W {pending} (with next burst), {why}",
                    )
                )
            else:
                cause = (
                    "no next burst"
                    if s.next_quota <= 0
                    else (f"capacity {back} < W {pending} (with next burst)" if back < pending else why)
                )
                actions.append(ReturnToRollout(core.cell_id, f"returned {core.cell_id} to rollout: {cause}"))
        actions += next_burst(s, f"burst {s.burst.burst_id + 1}: {s.next_quota} executions at policy v{v}")
        return actions
