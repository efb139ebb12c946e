"""Groups the packer drops without the scheduler having cancelled them (zero variance,
failed members, stale) are counted as ``groups_filtered`` in the supply signal, from the
WAL, so the scheduler's dispatch gate lets them go and replaces them. Before, they stayed in
the gate: in a demo whose policy learned the task, burst 12's four groups all earned reward
1, were dropped for zero variance, and the scheduler never dispatched again (272 of 300
executions, waterlevel 0, until the time budget ran out)."""

from __future__ import annotations

from gyre.execution import ExecutionStatus
from services.packer.packer import Packer
from services.packer.servicer import supply_to_proto
from services.packer.snapshot import compacted
from services.packer.state import PackerState
from testkit import packer_kit as tk


async def _group(
    p: Packer, g: str, rewards: list[float], statuses: list[ExecutionStatus] | None = None
) -> None:
    statuses = statuses or [ExecutionStatus.COMPLETED] * len(rewards)
    for k, (r, status) in enumerate(zip(rewards, statuses, strict=True)):
        await p.record_turn(tk.turn(f"{g}-{k}", g, 0))
        await p.report_finish(tk.finish(f"{g}-{k}", g, len(rewards), reward=r, status=status))


async def test_zero_variance_and_failed_groups_are_filtered_cancelled_ones_are_not():
    p, log, clock = tk.make_packer(drop_zero_variance=True)
    await _group(p, "solved", [1.0, 1.0])  # the policy learned it: zero variance
    await _group(p, "crashed", [1.0, 0.0], [ExecutionStatus.COMPLETED, ExecutionStatus.FAILED])
    await _group(p, "cancelled", [1.0, 0.0], [ExecutionStatus.COMPLETED, ExecutionStatus.CANCELLED])
    await _group(p, "kept", [1.0, 0.0])
    assert p.state.groups_dropped == {"zero_variance": 1, "failed_group": 2}
    assert p.supply()["groups_filtered"] == 2  # the scheduler counts "cancelled" itself
    assert supply_to_proto(p.supply()).groups_filtered == 2  # what WatchSupply sends

    # A restart replays the WAL; a compacted WAL restores it from the snapshot.
    q = Packer(p.cfg, log, clock=clock)
    q.recover(list(log.events))
    assert q.supply()["groups_filtered"] == 2
    st = PackerState()
    for ev in compacted(p.state):
        st.apply(ev)
    assert st.groups_filtered == 2
