"""The etcd control plane against a real etcd: a lease that stops being renewed removes
its registrations; a CAS on a stale revision is refused; a write or command carrying an old
fencing epoch is refused after a new leader is elected; a watcher resyncs after etcd is
restarted and after compaction, and misses nothing."""

from __future__ import annotations

import asyncio

import aetcd.exceptions
import pytest

from gyre.errors import StaleEpoch
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper, PrefixMirror
from gyre.etcd.client import Op, mod_revision_is
from gyre.fencing import FenceGuard


async def _connect(server) -> Etcd:
    etcd = Etcd([server.endpoint], timeout_s=2.0)
    await etcd.connect()
    return etcd


async def test_unrenewed_lease_removes_registration(etcd_server, cluster_name):
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    keeper = LeaseKeeper(etcd, ttl_s=2)
    await keeper.grant()
    await etcd.put(keys.cell("cell-0"), b"{}", lease=keeper.lease_id)
    # Kept alive for longer than the TTL: the registration stays.
    task = asyncio.create_task(keeper.run())
    await asyncio.sleep(3.0)
    assert await etcd.get(keys.cell("cell-0")) is not None
    # Stop renewing: etcd removes it after the TTL.
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for _ in range(60):
        if await etcd.get(keys.cell("cell-0")) is None:
            break
        await asyncio.sleep(0.1)
    assert await etcd.get(keys.cell("cell-0")) is None
    await etcd.close()


async def test_lost_lease_becomes_a_new_session(etcd_server, cluster_name):
    """etcd dropped the lease (expiry, or revoked): the keeper grants a new one and the
    session hook puts the lease-bound keys again; the process never stops."""
    etcd = await _connect(etcd_server)
    keys = Keys(cluster_name)
    keeper = LeaseKeeper(etcd, ttl_s=2)
    await keeper.grant()
    key = keys.service("router", "r-0")
    await etcd.put(key, b"{}", lease=keeper.lease_id)
    renewed: list[int] = []

    async def hook(lease_id: int) -> None:
        renewed.append(lease_id)
        await etcd.put(key, b"{}", lease=lease_id)

    keeper.on_new_session(hook)
    first = keeper.lease_id
    task = asyncio.create_task(keeper.run())
    try:
        await etcd.revoke(first)  # somebody (or expiry) removed it
        assert await asyncio.wait_for(keeper.wait_session(1), 5) == 2
        for _ in range(50):
            kv = await etcd.get(key)
            if kv is not None and kv.lease == keeper.lease_id:
                break
            await asyncio.sleep(0.1)
        assert kv is not None and kv.lease == keeper.lease_id
        assert renewed == [keeper.lease_id] and keeper.lease_id != first
        assert keeper.valid() and keeper.losses == 1 and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await keeper.revoke()
        await etcd.close()


async def test_etcd_paused_past_the_ttl_new_session_and_the_leader_steps_down(fresh_etcd, cluster_name):
    """etcd SIGSTOPped for longer than the TTL: the lease is past its renew deadline (the
    leader stops acting), etcd drops it on resume, the keeper grants a new session, the
    registration comes back, the old leadership is over and a new campaign wins."""
    etcd = await _connect(fresh_etcd)
    keys = Keys(cluster_name)
    keeper = LeaseKeeper(etcd, ttl_s=2)
    await keeper.grant()
    reg = keys.service("scheduler", "s-0")
    await etcd.put(reg, b"{}", lease=keeper.lease_id)

    async def hook(lease_id: int) -> None:
        await etcd.put(reg, b"{}", lease=lease_id)

    keeper.on_new_session(hook)
    election = LeaderElection(etcd, keys.leader(), "s-0", keeper)
    epoch = await election.try_acquire()
    assert epoch is not None and election.is_leader
    task = asyncio.create_task(keeper.run())
    try:
        fresh_etcd.pause()
        await asyncio.sleep(4.0)
        assert not keeper.valid() and not election.is_leader  # stopped acting during the outage
        fresh_etcd.resume()
        assert await asyncio.wait_for(keeper.wait_session(1), 15) == 2
        assert not election.is_leader  # the leader key went with the old lease
        with pytest.raises(StaleEpoch):
            await election.fenced_txn([], [Op(keys.route("x"), b"{}")])
        assert await etcd.get(keys.route("x")) is None
        for _ in range(50):
            kv = await etcd.get(reg)
            if kv is not None and kv.lease == keeper.lease_id:
                break
            await asyncio.sleep(0.1)
        assert kv is not None and kv.lease == keeper.lease_id
        again = await asyncio.wait_for(election.campaign(poll_s=0.1), 15)
        assert again > epoch and election.is_leader and not task.done()
    finally:
        fresh_etcd.resume()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await etcd.close()


async def test_cas_on_stale_revision_is_refused(etcd_server, cluster_name):
    etcd = await _connect(etcd_server)
    key = Keys(cluster_name).route("e1")
    ok, rev1 = await etcd.create(key, b"a")
    assert ok
    ok, _ = await etcd.create(key, b"again")
    assert not ok
    ok, rev2 = await etcd.cas(key, b"b", rev1)
    assert ok
    ok, _ = await etcd.cas(key, b"c", rev1)  # stale
    assert not ok
    assert (await etcd.get(key)).value == b"b"
    assert (await etcd.get(key)).mod_revision == rev2
    await etcd.close()


async def test_old_epoch_refused_after_new_leader(etcd_server, cluster_name):
    keys = Keys(cluster_name)
    etcd = await _connect(etcd_server)
    lease_a = LeaseKeeper(etcd, ttl_s=2)
    await lease_a.grant()
    lease_b = LeaseKeeper(etcd, ttl_s=2)
    await lease_b.grant()
    a = LeaderElection(etcd, keys.leader(), "a", lease_a)
    b = LeaderElection(etcd, keys.leader(), "b", lease_b)
    epoch_a = await a.campaign()
    assert await b.try_acquire() is None
    ok, _ = await a.fenced_txn([], [Op(keys.policy(), b"1")])
    assert ok
    # a's lease lapses (a is "paused"); b takes over with a higher epoch.
    await etcd.revoke(lease_a.lease_id)
    epoch_b = await asyncio.wait_for(b.campaign(poll_s=0.05), 5)
    assert epoch_b > epoch_a
    # a's persisted write is refused in the same transaction as the write ...
    with pytest.raises(StaleEpoch):
        await a.fenced_txn([], [Op(keys.policy(), b"2")])
    assert (await etcd.get(keys.policy())).value == b"1"
    # ... and a receiver that has seen b's epoch refuses a's commands.
    guard = FenceGuard()
    guard.check(epoch_b)
    with pytest.raises(StaleEpoch):
        guard.check(epoch_a)
    ok, _ = await b.fenced_txn(
        [mod_revision_is(keys.policy(), (await etcd.get(keys.policy())).mod_revision)],
        [Op(keys.policy(), b"3")],
    )
    assert ok
    await etcd.close()


async def test_watch_resyncs_after_etcd_restart(fresh_etcd, cluster_name):
    keys = Keys(cluster_name)
    etcd = await _connect(fresh_etcd)
    mirror = PrefixMirror(etcd, keys.routes(), resync_s=30)
    task = asyncio.create_task(mirror.run())
    await asyncio.wait_for(mirror.synced.wait(), 5)
    for i in range(5):
        await etcd.put(keys.route(f"e{i}"), b"x")
    await mirror.wait_for(lambda items: len(items) == 5, 5)
    resyncs = mirror.resyncs
    fresh_etcd.restart()
    # Writes made while and right after etcd restarts are seen: the mirror relists.
    writer = await _connect(fresh_etcd)
    for i in range(5, 10):
        await writer.put(keys.route(f"e{i}"), b"y")
    await writer.delete(keys.route("e0"))
    await mirror.wait_for(lambda items: len(items) == 9 and keys.route("e0") not in items, 20)
    assert mirror.resyncs > resyncs
    # ... and the watch works again after the resync.
    await writer.put(keys.route("late"), b"z")
    await mirror.wait_for(lambda items: keys.route("late") in items, 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await writer.close()
    await etcd.close()


async def test_watch_relists_after_compaction(fresh_etcd, cluster_name):
    keys = Keys(cluster_name)
    etcd = await _connect(fresh_etcd)
    mirror = PrefixMirror(etcd, keys.routes(), resync_s=30)
    await mirror.relist()
    # Changes happen while the mirror is not watching, then history is compacted away.
    rev = 0
    for i in range(20):
        rev = await etcd.put(keys.route(f"e{i % 4}"), str(i).encode())
    await etcd.compact(rev)
    # Watching from the mirror's old revision fails: that history is gone ...
    with pytest.raises(aetcd.exceptions.RevisionCompactedError):
        await asyncio.wait_for(mirror._watch_until_resync(), 5)
    # ... and the running mirror recovers by relisting.
    task = asyncio.create_task(mirror.run())
    await mirror.wait_for(lambda items: len(items) == 4 and items[keys.route("e3")].value == b"19", 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await etcd.close()
