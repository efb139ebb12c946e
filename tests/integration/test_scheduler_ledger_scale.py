"""The scheduler's ledger at scale against a real etcd (issue 13, part 5).

Invariants: a paged prefix read returns exactly what one read returns, at one revision
(keys written after its first page are not in it); a takeover reads a ledger of 12,000
closed executions (one range request for all of it passes gRPC's 4 MiB limit); archiving a
burst deletes its burst and execution keys and writes the summary in one fenced
transaction, refused when the summary moved or the epoch is stale, and a takeover after it
reads the summary and the live bursts only.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gyre.errors import Conflict, StaleEpoch
from gyre.etcd import Etcd, Keys, LeaderElection, Op
from gyre.etcd.lease import LeaseKeeper
from gyre.etcd.values import Route
from gyre.execution import ExecutionStatus
from services.scheduler.ledger import ArchiveSummary, Burst, ExecutionRecord, Task
from services.scheduler.store import MAX_TXN_OPS, SchedulerStore

pytestmark = pytest.mark.timeout(180)


async def _connect(server) -> Etcd:
    etcd = Etcd([server.endpoint], timeout_s=20.0)
    await etcd.connect()
    return etcd


async def _leader_store(etcd: Etcd, keys: Keys) -> tuple[SchedulerStore, LeaderElection, LeaseKeeper]:
    keeper = LeaseKeeper(etcd, ttl_s=10)
    await keeper.grant()
    election = LeaderElection(etcd, keys.leader(), '{"target": "test"}', keeper)
    await election.campaign(poll_s=0.1)
    return SchedulerStore(etcd, keys, election), election, keeper


def _closed_burst(burst_id: int, groups: int, group_size: int = 4) -> tuple[Burst, list[ExecutionRecord]]:
    burst = Burst(
        burst_id,
        0,
        1,
        group_size,
        tuple(Task(f"task-{burst_id}-{t}", '{"prompt": "p"}') for t in range(groups)),
    )
    recs = []
    for seq in range(burst.quota):
        eid, gid, task = burst.member(seq)
        recs.append(
            ExecutionRecord(
                eid,
                burst_id,
                seq,
                gid,
                task.task_id,
                0,
                ExecutionStatus.COMPLETED,
                "ab" * 32,
                "harness-0000",
                1.7e9,
                1.7e9 + 60,
                0.5,
                "finish-key-0123456789",
                "cd" * 32,
            )
        )
    return burst, recs


async def _write(etcd: Etcd, keys: Keys, burst: Burst, recs: list[ExecutionRecord]) -> None:
    ops = [Op(keys.burst(burst.burst_id), burst.to_json())]
    ops += [Op(keys.execution(r.burst_id, r.execution_id), r.to_json()) for r in recs]
    for i in range(0, len(ops), MAX_TXN_OPS):
        ok, _ = await etcd.txn([], ops[i : i + MAX_TXN_OPS])
        assert ok


async def test_paged_read_is_one_snapshot(etcd_server, cluster_name):
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    try:
        prefix = keys.executions(1)
        for i in range(0, 2500, MAX_TXN_OPS):
            await etcd.txn(
                [], [Op(prefix + f"x{j:05d}".encode(), b"v") for j in range(i, min(i + MAX_TXN_OPS, 2500))]
            )
        rev, whole = await etcd.get_prefix(prefix)
        prev, paged = await etcd.get_prefix_paged(prefix, page=300)
        assert prev == rev and [(kv.key, kv.mod_revision) for kv in paged] == [
            (kv.key, kv.mod_revision) for kv in whole
        ]
        assert len(paged) == 2500
        # Pinned to the first page's revision: keys added later do not appear.
        await etcd.put(prefix + b"x99999", b"late")
        _, again = await etcd.get_prefix_paged(prefix, page=7)
        assert len(again) == 2501
    finally:
        await etcd.close()


async def test_takeover_reads_a_ledger_too_large_for_one_request(etcd_server, cluster_name):
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    store, _, keeper = await _leader_store(etcd, keys)
    try:
        for b in range(1, 13):  # 12 bursts of 250 groups of 4: 12,000 closed executions
            await _write(etcd, keys, *_closed_burst(b, 250))
        loaded = await store.load()
        assert len(loaded.executions) == 12_000 and len(loaded.bursts) == 12
        assert all(r.state is ExecutionStatus.COMPLETED for r in loaded.executions)
    finally:
        await keeper.revoke()
        await etcd.close()


async def test_archive_folds_a_burst_into_the_summary_in_one_fenced_transaction(etcd_server, cluster_name):
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    store, election, keeper = await _leader_store(etcd, keys)
    try:
        b1, r1 = _closed_burst(1, 10)
        b2, r2 = _closed_burst(2, 10)
        await _write(etcd, keys, b1, r1)
        await _write(etcd, keys, b2, r2)
        summary = ArchiveSummary().add(b1, {"COMPLETED": b1.quota})
        rev = await store.archive(summary, 0)
        assert await etcd.count_prefix(keys.executions(1)) == 0 and await etcd.get(keys.burst(1)) is None
        assert await etcd.count_prefix(keys.executions(2)) == 40
        loaded = await store.load()
        assert loaded.summary.through == 1 and loaded.summary.revision == rev
        assert [b.burst_id for b in loaded.bursts] == [2] and len(loaded.executions) == 40
        with pytest.raises(Conflict):  # a stale view of the summary changes nothing
            await store.archive(loaded.summary.add(b2, {"COMPLETED": 40}), 0)
        assert await etcd.count_prefix(keys.executions(2)) == 40
        # A deposed leader cannot archive.
        await etcd.delete(keys.leader())
        await etcd.put(keys.leader(), b"{}")
        with pytest.raises(StaleEpoch):
            await store.archive(loaded.summary.add(b2, {"COMPLETED": 40}), rev)
        assert await etcd.count_prefix(keys.executions(2)) == 40
        del election
    finally:
        await keeper.revoke()
        await etcd.close()


async def test_grouped_launches_and_closes_keep_their_guards_and_the_fence(etcd_server, cluster_name):
    """Launches and closes in flight together share transactions (group commit) on a real
    etcd: each lands once at its own guard, a close whose record moved alone hears Conflict,
    and after the leader key is gone every write of a group is refused and writes nothing."""
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    store, _, keeper = await _leader_store(etcd, keys)
    try:
        _, recs = _closed_burst(1, 16)  # 64 executions
        running = [dataclasses.replace(r, state=ExecutionStatus.RUNNING) for r in recs]
        routes = [Route(r.execution_id, "cell-a", "a:1", "ab" * 32, r.group_id, 1, 0) for r in recs]
        sent = store.group.transactions
        revs = await asyncio.gather(*(store.launch(r, rt) for r, rt in zip(running, routes, strict=True)))
        assert store.group.transactions - sent < len(recs)  # shared transactions
        revs[0] = revs[0] - 1  # this close expects a revision its record is not at
        results = await asyncio.gather(
            *(store.close(r, rev) for r, rev in zip(recs, revs, strict=True)), return_exceptions=True
        )
        assert isinstance(results[0], Conflict)
        assert all(isinstance(x, int) for x in results[1:])
        kv = await etcd.get(keys.execution(1, recs[1].execution_id))
        assert ExecutionRecord.from_json(kv.value, kv.mod_revision).state is ExecutionStatus.COMPLETED
        assert await etcd.get(keys.route(recs[1].execution_id)) is None
        assert await etcd.get(keys.route(recs[0].execution_id)) is not None  # its close did not apply

        await etcd.delete(keys.leader())
        _, more = _closed_burst(2, 4)
        results = await asyncio.gather(*(store.launch(r, routes[0]) for r in more), return_exceptions=True)
        assert all(isinstance(x, StaleEpoch) for x in results)
        for r in more:
            assert await etcd.get(keys.execution(2, r.execution_id)) is None
    finally:
        await keeper.revoke()
        await etcd.close()
