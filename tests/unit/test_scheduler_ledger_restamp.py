"""The partial rule in the scheduler's ledger (gyre.staleness): a restamp lives in the
running members' records, so the group's stamp, the per-version counts and a rebuild all
follow from the records."""

from __future__ import annotations

import dataclasses

from gyre.execution import ExecutionStatus
from services.scheduler.ledger import Ledger, LedgerCounts, Task


def _ledger() -> tuple[Ledger, list]:
    """Burst 1 at v0: groups t0 (both members running), t1 (one running, one queued) and
    t2 (queued); group size 2."""
    led = Ledger()
    burst = led.plan_burst([Task("a"), Task("b"), Task("c")], 2, 0, 1, 0.0)
    led.apply_burst(burst)
    recs = []
    for seq in range(3):
        rec = led.plan_launch(burst, seq, f"tok{seq}", "h", 1.0)
        led.apply(dataclasses.replace(rec, revision=10 + seq))
        recs.append(led.records[rec.execution_id])
    return led, recs


def test_a_restamp_moves_the_group_and_its_counts() -> None:
    led, _ = _ledger()
    burst = led.bursts[1]
    assert led.open_groups()[0][0] == 0
    assert led.plan_restamp("b1-t0-0", 0) is None  # not newer
    assert led.plan_restamp("b1-t2-0", 2) is None  # queued: takes the stamp at launch
    for eid in ("b1-t0-0", "b1-t0-1", "b1-t1-0"):
        rec = led.plan_restamp(eid, 2)
        assert rec is not None and rec.policy_version == 2 and rec.state is ExecutionStatus.RUNNING
        led.apply(dataclasses.replace(rec, revision=20))
    assert (
        led.stamp("b1-t0", burst) == 2 and led.stamp("b1-t1", burst) == 2 and led.stamp("b1-t2", burst) == 0
    )
    assert led.restamps == 2  # groups, each once
    assert [(u, g) for u, g, _ in led.open_groups()] == [(2, "b1-t0"), (2, "b1-t1"), (0, "b1-t2")]
    assert led.counts_by_version() == {0: LedgerCounts(2, 0, 0), 2: LedgerCounts(4, 3, 0)}
    assert led.groups_by_version() == {0: 1, 2: 2}
    # The queued member of the restamped group launches with its group's stamp.
    assert led.plan_launch(burst, 3, "tok3", "h", 2.0).policy_version == 2
    assert led.plan_launch(burst, 4, "tok4", "h", 2.0).policy_version == 0
    # A close keeps the record's stamp: the packer is told v2.
    closed = dataclasses.replace(led.records["b1-t0-0"], state=ExecutionStatus.COMPLETED, finished_s=3.0)
    led.apply(closed)
    assert led.counts_by_version()[2] == LedgerCounts(4, 3, 1)
    assert led.plan_restamp("b1-t0-0", 3) is None  # closed


def test_a_rebuild_recovers_the_stamps_from_the_records() -> None:
    led, _ = _ledger()
    rec = led.plan_restamp("b1-t0-1", 2)
    assert rec is not None
    led.apply(dataclasses.replace(rec, revision=20))
    again = Ledger()
    again.apply_burst(led.bursts[1])
    for r in led.records.values():
        again.load(r, 100.0)
    assert again.restamped == {"b1-t0": 2} and again.restamps == 1
    assert again.counts_by_version() == led.counts_by_version()
