"""What a leader change must not break, and state that must stay bounded (issue 13, parts
4 and 5), on the real Scheduler over the in-memory store fake.

Invariants: an acquire retried with its idempotency key returns the same execution and
token, on the same leader and on a new one after a failover, and never launches twice; a
key of another harness is refused, as is the key of a closed execution and a key too short
to be a secret; a new leader gives every running execution a full heartbeat deadline (a
heartbeat lost in the gap times nothing out). The finish relay never blocks on one refused
report: after a failover past more batches than the real packer remembers
(``dedupe_batches``), whose requeued reports it refuses (groups it trained and forgot),
later reports are still delivered, and refused ones are settled, not retried. A closed
burst is archived: its records leave the store, the totals stay, a rebuild gives the same
counts, burst ids go on, and a new leader does not resend its reports.
"""

from __future__ import annotations

import asyncio

import pytest
from test_scheduler_service import lead, make  # same test folder

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from gyre.etcd.values import token_sha256
from gyre.execution import ExecutionStatus
from services.packer.model import Finish
from services.scheduler.ledger import derive_token
from services.scheduler.peers import FinishReport
from testkit import packer_kit as tk
from testkit.recording_peers import RecordingPeers

KEY = "k" * 8 + "0123456789abcdef"


async def _failover(s, store, clock, peers=None, **overrides):
    await s.transitions.cancel_all()
    store2 = store.as_leader(epoch=store.epoch + 5)
    s2, _, peers2, _ = make(store=store2, peers=peers or RecordingPeers(), clock=clock, **overrides)
    await s2.take_over(store2.epoch)
    return s2, store2, peers2


async def test_acquire_retried_with_its_key_returns_the_same_execution_across_a_failover():
    s, store, _, clock = make(policy="rollout_only")
    await lead(s, store)
    first, _, _ = await s.acquire("h", 0, KEY)
    assert first.token == derive_token(KEY, first.record.execution_id)
    again, _, _ = await s.acquire("h", 0, KEY)
    assert again.record.execution_id == first.record.execution_id and again.token == first.token
    assert s.ledger.counts().launched == 1 and store.writes == 2  # one dispatch, one launch
    other, _, _ = await s.acquire("h", 0, "x" * 16)
    assert other.record.execution_id != first.record.execution_id
    with pytest.raises(PermissionDenied):
        await s.acquire("intruder", 0, KEY)
    with pytest.raises(InvalidArgument):
        await s.acquire("h", 0, "short")

    s2, _, _ = await _failover(s, store, clock)
    again2, _, _ = await s2.acquire("h", 0, KEY)
    assert (again2.record.execution_id, again2.token) == (first.record.execution_id, first.token)
    assert s2.ledger.counts().launched == 2
    await s2.finish(first.record.execution_id, first.token, ExecutionStatus.COMPLETED, 1.0, "f")
    with pytest.raises(FailedPrecondition):
        await s2.acquire("h", 0, KEY)


async def test_concurrent_acquires_with_one_key_launch_once():
    s, store, _, _ = make(policy="rollout_only")
    await lead(s, store)
    store.launch_delay_s = 0.05  # the first launch is still in flight when the retry comes
    got = await asyncio.gather(*(s.acquire("h", 1.0, KEY) for _ in range(3)))
    assert len({g[0].record.execution_id for g in got}) == 1
    assert s.ledger.counts().launched == 1


async def test_new_leader_gives_running_executions_a_full_heartbeat_deadline():
    s, store, _, clock = make(policy="rollout_only", heartbeat_deadline_s=10.0)
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0, KEY)
    clock.now += 9.0  # the last heartbeat reached the old leader 9 s ago; then it died
    s2, _, _ = await _failover(s, store, clock, heartbeat_deadline_s=10.0)
    clock.now += 9.0  # the failover gap: heartbeats go nowhere
    await s2.reconcile_once()
    assert s2.ledger.records[a.record.execution_id].state is ExecutionStatus.RUNNING
    left, state = await s2.heartbeat(a.record.execution_id, a.token)
    assert state is ExecutionStatus.RUNNING and left == 10.0


class ForgetfulPacker(RecordingPeers):
    """A packer that forgot some groups (refuses their reports) and is down now and then."""

    def __init__(self, forgotten: set[str]) -> None:
        super().__init__()
        self.forgotten = forgotten
        self.refusals: dict[str, int] = {}

    async def report_finish(self, report: FinishReport) -> None:
        if report.group_id in self.forgotten:
            self.refusals[report.execution_id] = self.refusals.get(report.execution_id, 0) + 1
            raise FailedPrecondition(f"group {report.group_id} is already complete")
        await super().report_finish(report)


async def _wait_for(pred, what: str) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_refused_reports_after_a_failover_do_not_block_later_ones():
    s, store, _, clock = make(policy="rollout_only")
    await lead(s, store)
    held = [(await s.acquire("h", 0))[0] for _ in range(4)]
    for g in held[:3]:
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    # The packer has trained and forgotten every group closed before the failover.
    packer = ForgetfulPacker({g.record.group_id for g in held[:3]} - {held[3].record.group_id})
    packer.report_failures = 2  # and is briefly down
    s2, _, _ = await _failover(s, store, clock, peers=packer)
    task = asyncio.create_task(s2.report_loop())
    try:
        last = held[3]
        await s2.finish(last.record.execution_id, last.token, ExecutionStatus.COMPLETED, 0.5, "k")
        await _wait_for(lambda: last.record.execution_id in packer.reports, "the later report")
        await _wait_for(lambda: not s2.relay.unsettled, "every report settled")
        assert all(n == 1 for n in packer.refusals.values()) and packer.refusals  # refused once, not retried
        assert s2.relay.counts.refused == len(packer.refusals)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_refused_report_is_settled_while_an_undelivered_one_is_retried():
    packer = ForgetfulPacker({"b1-t0"})
    s, store, _, _ = make(policy="rollout_only", peers=packer)
    await lead(s, store)
    packer.report_failures = 3
    task = asyncio.create_task(s.report_loop())
    try:
        got = [(await s.acquire("h", 0))[0] for _ in range(4)]  # groups b1-t0 and b1-t1
        for g in got:
            await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
        await _wait_for(lambda: not s.relay.unsettled, "settled")
        assert set(packer.reports) == {g.record.execution_id for g in got if g.record.group_id == "b1-t1"}
        assert s.relay.counts.refused == 2 and s.relay.counts.retries >= 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class InProcessPacker(RecordingPeers):
    """The real packer (in memory) as the scheduler's finish-report peer."""

    def __init__(self, **cfg) -> None:
        super().__init__()
        self.packer, _, _ = tk.make_packer(**cfg)

    async def report_finish(self, report: FinishReport) -> None:
        await self.packer.report_finish(
            Finish.validated(
                report.execution_id,
                report.group_id,
                report.group_size,
                report.status,  # one ExecutionStatus on both sides
                report.reward,
                report.policy_version,
                1 << 16,
            )
        )
        self.reports[report.execution_id] = report


async def test_failover_after_more_batches_than_the_packer_remembers_does_not_stall_reports():
    """The new leader requeues every closed record; the packer refuses those of groups it
    trained and forgot (dedupe_batches); a later finish is still delivered."""
    peer = InProcessPacker(batch_size=1, dedupe_batches=2)
    s, store, _, clock = make(policy="rollout_only", over_provision=2.0, peers=peer)
    await lead(s, store)
    relay = asyncio.create_task(s.report_loop())
    try:
        held = [(await s.acquire("h", 0))[0] for _ in range(12)]  # groups b1-t0 .. b1-t5
        for g in held[:10]:  # five groups close, one batch each, and are trained
            await peer.packer.record_turn(tk.turn(g.record.execution_id, g.record.group_id, 0))
            await s.finish(
                g.record.execution_id, g.token, ExecutionStatus.COMPLETED, float(g.record.seq % 2), "k"
            )
        await _wait_for(lambda: len(peer.reports) == 10, "reports of five groups")
        for b in range(1, 6):
            r = await peer.packer.claim("core", b, 0, 0)
            await peer.packer.ack("core", b, r.micro_step.micro_step_id)
        assert peer.packer.state.filling == 6 and "b1-t0-0" not in peer.packer.state.finished  # forgotten
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
    s2, _, _ = await _failover(s, store, clock, peers=peer, over_provision=2.0)
    relay = asyncio.create_task(s2.report_loop())
    try:
        last = held[10]
        await peer.packer.record_turn(tk.turn(last.record.execution_id, last.record.group_id, 0))
        await s2.finish(last.record.execution_id, last.token, ExecutionStatus.COMPLETED, 1.0, "k")
        await _wait_for(lambda: last.record.execution_id in peer.packer.state.finished, "the later report")
        await _wait_for(lambda: not s2.relay.unsettled, "every report settled")
        assert s2.relay.counts.refused >= 6  # b1-t0 .. b1-t2: trained and forgotten, refused once each
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)


async def _run_burst(s) -> list:
    got = []
    while (g := (await s.acquire("h", 0))[0]) is not None:
        got.append(g)
    for g in got:
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    return got


async def test_closed_bursts_are_archived_and_a_new_leader_rebuilds_the_same_totals():
    s, store, _, clock = make(policy="rollout_only", archive_grace_s=5.0)
    await lead(s, store)
    task = asyncio.create_task(s.report_loop())
    try:
        first = await _run_burst(s)
        await s.reconcile_once()  # burst 2 is dispatched; burst 1 closed moments ago: kept
        await _wait_for(lambda: not s.relay.unsettled, "reports settled")
        assert sorted(s.ledger.bursts) == [1, 2]
        clock.now += 6.0
        await s.reconcile_once()
        assert sorted(s.ledger.bursts) == [2] and s.ledger.archived.through == 1
        assert not [e for e in store.execs if e.startswith("b1-")] and 1 not in store.bursts
        totals = s.ledger.counts()
        assert (totals.dispatched, totals.finished) == (16, 8)
        assert s.ledger.finished_by_status()["COMPLETED"] == 8
        assert sum(c.dispatched for c in s.ledger.counts_by_version().values()) == 16
        with pytest.raises(NotFound):
            await s.finish(first[0].record.execution_id, first[0].token, ExecutionStatus.COMPLETED, 1.0, "k")
        s.ledger.check_invariants()
        await _run_burst(s)
        await s.reconcile_once()
        assert max(s.ledger.bursts) == 3 and s.ledger.tasks_taken == 12
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    peers2 = RecordingPeers()
    s2, _, _ = await _failover(s, store, clock, peers=peers2, archive_grace_s=5.0)
    assert s2.ledger.counts() == s.ledger.counts()
    assert s2.ledger.finished_by_status() == s.ledger.finished_by_status()
    assert s2.ledger.counts_by_version() == s.ledger.counts_by_version()
    assert {r.execution_id for r in s2.ledger.records.values()}.isdisjoint(
        g.record.execution_id for g in first
    )
    assert not [e for e in s2.relay.unsettled if e.startswith("b1-")]  # archived: not resent
    assert s2.status().bursts_completed >= 1


async def test_an_unsettled_report_holds_its_burst_back_from_the_archive():
    s, store, _, _ = make(policy="rollout_only", archive_grace_s=0.0)
    await lead(s, store)
    await _run_burst(s)
    await s.reconcile_once()
    assert sorted(s.ledger.bursts) == [1, 2]  # the reports were never delivered (no relay)
    assert s.ledger.archivable(s.relay.unsettled) is None
    task = asyncio.create_task(s.report_loop())
    try:
        await _wait_for(lambda: not s.relay.unsettled, "reports settled")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await s.reconcile_once()
    assert sorted(s.ledger.bursts) == [2]


def test_acquire_key_hash_is_what_the_record_keeps():
    assert token_sha256(KEY) != KEY and len(derive_token(KEY, "b1-t0-0")) == 43
    assert derive_token(KEY, "b1-t0-0") != derive_token(KEY, "b1-t0-1")


async def test_standby_acquire_is_unavailable_and_names_the_leader():
    s, _, _, _ = make(policy="rollout_only")
    s.lead.leader_target = "10.0.0.7:50051"
    with pytest.raises(Unavailable, match="the leader is at 10.0.0.7:50051"):
        await s.acquire("h", 0, KEY)
