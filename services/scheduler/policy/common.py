"""Helpers shared by the policies: the burst-synchronous ``next_burst`` / ``drained_actions``
and the asynchronous ``publish_newest`` / ``dispatch_to_gate``."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policy import staleness
from services.scheduler.policy.actions import Action, DispatchBurst, PublishPolicy, ReturnToRollout, SealBatch
from services.scheduler.policy.snapshot import TRAINING_SIDE, CellState, CellView, Snapshot


def fmt(x: float) -> str:
    return f"{x:g}"


def next_burst(s: Snapshot, reason: str) -> list[Action]:
    if s.next_quota <= 0:
        return []
    burst_id = (s.burst.burst_id + 1) if s.burst is not None else 1
    return [DispatchBurst(burst_id, s.next_quota, s.policy_version, reason)]


def drained_actions(s: Snapshot, grace_s: float, training: Sequence[CellView]) -> list[Action] | None:
    """A burst whose executions have all closed (for ``grace_s``) while its batch is not
    trained: seal a partial batch that cells are training on, or, when nothing trainable
    came out of it, go on with the next burst. None: nothing special to do."""
    if s.burst is None or not s.drained_for(grace_s):
        return None
    sup = s.supply
    b = s.burst.burst_id
    if training and 0 < sup.batch_needs < sup.batch_size:
        have = sup.batch_size - sup.batch_needs
        return [
            SealBatch(
                sup.batch_id,
                f"sealed batch {sup.batch_id} with {have} of {sup.batch_size} groups: burst {b} drained (W 0)",
            )
        ]
    if not training and sup.ready_groups == 0 and sup.batch_needs >= sup.batch_size:
        # (With cells training, a sealed batch is being trained while the packer already
        # fills the next one: wait for its publication, which ends the burst.)
        return next_burst(
            s,
            f"burst {b} yielded no trainable groups: burst {b + 1} with {s.next_quota} executions "
            f"at policy v{s.policy_version}",
        )
    return None


def publish_newest(s: Snapshot) -> list[Action]:
    """Publish the trainer's newest version to rollout engines when they serve an older one."""
    p = s.pipeline
    if p is None or s.policy_version <= p.published_version:
        return []
    core = next((c for c in s.elastic() if c.is_core), None)
    src = core.cell_id if core is not None else ""
    return [
        PublishPolicy(
            s.policy_version,
            src,
            f"published policy v{s.policy_version} from {src or 'core'} to rollout engines",
        )
    ]


def dispatch_to_gate(s: Snapshot, burst_id: int | None = None) -> list[Action]:
    """Dispatch as many whole groups as the staleness gate and the task source allow, stamped
    with the current version (continuous dispatch: bursts overlap)."""
    p = s.pipeline
    if p is None or s.next_quota <= 0:
        return []
    room = staleness.dispatch_room(p, s.policy_version)
    groups = min(room, s.next_quota // p.group_size)
    if groups <= 0:
        return []
    bid = burst_id if burst_id is not None else ((s.burst.burst_id + 1) if s.burst is not None else 1)
    gate = staleness.gate(s.policy_version, p.max_staleness, p.batch_groups, p.extra_groups)
    return [
        DispatchBurst(
            bid,
            groups * p.group_size,
            s.policy_version,
            f"dispatched {groups} groups at v{s.policy_version}: usable {p.usable_dispatched} + {groups} "
            f"<= gate {gate} = (v{s.policy_version} + eta {p.max_staleness} + 1) x {p.batch_groups} "
            f"+ {p.extra_groups}",
        )
    ]


def repair_prefix(elastic: list[CellView], prefix: list[CellView]) -> list[Action]:
    """After a cell loss or restart: training without the core is pointless, and cells
    above a gap in the prefix break the order; both go back to rollout."""
    if not prefix:
        return []
    if not prefix[0].is_core:
        return [
            ReturnToRollout(c.cell_id, f"returned {c.cell_id} to rollout: the core is not training")
            for c in prefix
        ]
    alive = [c for c in elastic if c.state is not CellState.FAILED]
    k = next((i for i, c in enumerate(alive) if c.state not in TRAINING_SIDE), len(alive))
    return [
        ReturnToRollout(
            c.cell_id, f"returned {c.cell_id} to rollout: {alive[k].cell_id} broke the training prefix"
        )
        for c in alive[k:]
        if c.state in TRAINING_SIDE
    ]
