"""The dispatch gate subtracts every group the scheduler cancelled over the run. A new
leader rebuilds ``cancelled_groups`` from the unarchived records only, so the archive
summary carries the archived bursts' count; before, a failover turned every archived
cancellation back into a live group in the gate, and a long run with more of them than the
gate's margin could never dispatch again."""

from __future__ import annotations

from services.scheduler.ledger import ArchiveSummary, Ledger, Task


def _burst(ledger: Ledger, n_tasks: int = 2, group_size: int = 2) -> int:
    tasks = [Task(f"task-{ledger.tasks_taken + i}", "{}") for i in range(n_tasks)]
    burst = ledger.plan_burst(tasks, group_size, policy_version=0, batches=1, now_s=0.0)
    ledger.apply_burst(burst)
    return burst.burst_id


def _cancel_group(ledger: Ledger, burst_id: int, t: int, group_size: int = 2) -> None:
    for m in range(group_size):
        rec = ledger.plan_cancel(f"b{burst_id}-t{t}-{m}", now_s=1.0)
        assert rec is not None
        ledger.apply(rec)


def test_archived_cancellations_stay_counted_across_a_failover():
    ledger = Ledger()
    b1 = _burst(ledger)
    _cancel_group(ledger, b1, 0)
    _cancel_group(ledger, b1, 1)  # burst 1: every execution closed (cancelled)
    b2 = _burst(ledger)
    _cancel_group(ledger, b2, 0)
    assert ledger.groups_cancelled == 3

    burst = ledger.archivable()
    assert burst is not None and burst.burst_id == b1
    summary = ledger.plan_archive(burst)
    assert summary.cancelled_groups == 2
    ledger.apply_archive(summary)
    assert ledger.groups_cancelled == 3  # the old leader: unchanged by the archive

    # A new leader: the stored summary, then the unarchived records.
    stored = ArchiveSummary.from_json(summary.to_json())
    successor = Ledger()
    successor.archived = stored
    successor.apply_burst(ledger.bursts[b2])
    for rec in ledger.records.values():
        successor.load(rec, deadline_s=100.0)
    assert len(successor.cancelled_groups) == 1  # what the gate used to subtract
    assert successor.groups_cancelled == 3


def test_a_summary_stored_before_the_count_existed_reads_as_none_cancelled():
    raw = b'{"through": 1, "bursts": 1, "tasks": 2, "executions": 4, "by_status": {}}'
    assert ArchiveSummary.from_json(raw).cancelled_groups == 0


def test_archiving_folds_cancelled_groups_into_the_count_and_bounds_the_dict():
    """The leader's ``cancelled_groups`` used to keep every cancelled group of the run (it
    grew for the life of the process); an archived burst's groups now live on as the
    summary's count only. The gate's count is the same on this leader and on a successor
    rebuilt from etcd, and so is the dict (live bursts only)."""
    ledger = Ledger()
    live_peak = 0
    for _ in range(50):
        b = _burst(ledger)
        _cancel_group(ledger, b, 0)
        _cancel_group(ledger, b, 1)
        live_peak = max(live_peak, len(ledger.cancelled_groups))
        while (burst := ledger.archivable()) is not None:
            ledger.apply_archive(ledger.plan_archive(burst))
    assert ledger.groups_cancelled == 100
    assert ledger.archived.cancelled_groups == 98  # the newest burst is never archived
    assert set(ledger.cancelled_groups) == {f"b{b}-t0", f"b{b}-t1"}
    assert live_peak <= 4

    successor = Ledger()
    successor.archived = ArchiveSummary.from_json(ledger.archived.to_json())
    for burst in ledger.bursts.values():
        successor.apply_burst(burst)
    for rec in ledger.records.values():
        successor.load(rec, deadline_s=100.0)
    assert successor.groups_cancelled == ledger.groups_cancelled == 100
    assert successor.cancelled_groups == ledger.cancelled_groups
