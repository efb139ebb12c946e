"""The asynchronous policy (gyre) through the real scheduler process, against a real etcd,
with gRPC stand-ins for cells, router and packer.

Invariants: bursts are dispatched whenever the staleness gate ``(v + eta + 1) x B + X`` has
room, not only at a burst end, each stamped with the version it serves, so two bursts are
open at once and the per-version ledger (GetStatus.versions) shows both; ``Migrate`` moves
a tail execution off a crowded engine with the continuation reroute (fenced route CAS,
route epoch + 1, Router.MoveExecutions); the cancel-early rule cancels the open members of
groups no batch within eta can take: their routes disappear from etcd, their harness's
heartbeat and finish answer CANCELLED, and the packer is told.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from gyre.client import HarnessClient
from gyre.v1 import common_pb2, scheduler_pb2
from testkit.fake_packer import FakePacker
from testkit.scheduler_env import SchedulerEnv
from testkit.scheduler_peers import FakeRouter, read_events, wait_until
from testkit.tls import PKI

pytestmark = pytest.mark.timeout(120)


async def _one_cell(env: SchedulerEnv, **scheduler: Any) -> tuple[FakeRouter, FakePacker, Path]:
    """One standalone cell of 4 slots (sa-0), router and packer stand-ins, and the config of a
    gyre scheduler (batches of 2 groups of 2, eta 1) with ``scheduler`` on top: (router,
    packer, config path)."""
    await env.cell("sa-0", "standalone", -1, 4)
    router, packer = await env.router(), await env.packer()
    cfg = env.config(
        policy="gyre",
        batch_size=2,
        group_size=2,
        max_staleness=1,
        packer_target=packer.target,
        **scheduler,
    )
    return router, packer, cfg


async def test_gyre_overlapping_bursts_migrate_and_cancel_early(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    router, packer, cfg = await _one_cell(env, heartbeat_interval_s=0.2, archive_grace_s=2.0)
    proc, h = await env.start(cfg)
    st = await h.wait_leader()
    # The gate at v0: (0 + 1 + 1) x 2 groups = 8 executions, all stamped v0.
    assert st.policy == "gyre" and st.total.dispatched == 8 and st.open_bursts == 1
    assert [(v.policy_version, v.dispatched) for v in st.versions] == [(0, 8)]
    client = HarnessClient([proc.target], harness_id="h-async", tls_dir=PKI / "harness")
    await client.__aenter__()
    held = await client.acquire(wait_s=5.0)  # a harness with the shipped client, heartbeating
    assert held is not None
    await held.__aenter__()
    running = [held.proto, *[await h.acquire() for _ in range(3)]]  # sa-0's 4 slots
    assert all(e is not None and e.policy_version == 0 for e in running)

    # The core's step publishes v1 (no weights to load here): the gate grows to 6 groups
    # and a burst stamped v1 goes out while burst 1 is still open.
    await etcd.put(keys.policy(), json.dumps({"version": 1, "batch_id": 1}).encode())

    async def overlapping():
        s = await h.status()
        return s.open_bursts == 2 and [(v.policy_version, v.dispatched) for v in s.versions] == [
            (0, 8),
            (1, 4),
        ]

    await wait_until(overlapping, what="a second burst at v1 while burst 1 is open")

    # An engine joins: the tail of v0 (the oldest version batch v1 can use) runs crowded
    # on sa-0 (4 of 4 slots): one execution migrates to the empty engine.
    await env.cell("sa-1", "standalone", -1, 4)

    async def migrated():
        return (await h.status()).migrations == 1

    await wait_until(migrated, what="a migration")
    moved = [e for e in running if (await env.route(e.execution_id))[0]["cell_id"] == "sa-1"]
    assert len(moved) == 1
    assert (await env.route(moved[0].execution_id))[1] == 2  # route epoch + 1
    assert [(m[1], m[2], m[3], m[4]) for m in router.moves] == [(moved[0].execution_id, "sa-0", "sa-1", 2)]
    assert {m[0] for m in router.moves} == {st.epoch}

    # The trainer reaches v2 (its batch still filling): no batch within eta 1 can take a
    # group stamped v0 any more; v1's groups stay.
    await etcd.put(keys.policy(), json.dumps({"version": 2, "batch_id": 2}).encode())

    async def cancelled():
        s = await h.status()
        v0 = next(v for v in s.versions if v.policy_version == 0) if s.versions else None
        return v0 is None or v0.finished == v0.dispatched

    await wait_until(cancelled, what="the v0 groups cancelled")
    for e in running:
        assert (await env.route(e.execution_id))[0] is None  # the token is revoked with the route
    beat = await h.h.Heartbeat(
        scheduler_pb2.HeartbeatRequest(execution_id=running[0].execution_id),
        metadata=(("authorization", f"Bearer {running[0].token}"),),
        timeout=5,
    )
    assert beat.status == common_pb2.EXECUTION_STATUS_CANCELLED
    out = await h.finish(running[0])
    assert out.duplicate and out.status == common_pb2.EXECUTION_STATUS_CANCELLED

    async def told():  # the harness's own heartbeats learn it, no call of its own fails
        return held.closed_as == "CANCELLED"

    await wait_until(told, what="the harness client sees CANCELLED")
    assert held.cancelled_by_scheduler

    async def reported():
        return all(packer.reports.get(e.execution_id) is not None for e in running)

    await wait_until(reported, what="the packer told of the cancellations")
    assert {packer.reports[e.execution_id].status for e in running} == {common_pb2.EXECUTION_STATUS_CANCELLED}

    # Burst 1 is archived (closed, reported, archive_grace_s later): its records are
    # gone. A harness that reports only now (a long tool call) gets a clear NOT_FOUND
    # from the scheduler, and the shipped client answers its own finish as the
    # duplicate it was.
    async def archived():
        try:
            await h.finish(running[1])
        except grpc.aio.AioRpcError as err:
            return err.code() == grpc.StatusCode.NOT_FOUND and "archived" in (err.details() or "")
        return False

    await wait_until(archived, what="burst 1 archived", timeout_s=15)
    out = await held.finish(status="cancelled")
    assert out.duplicate and out.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert held.cancelled_by_scheduler and held.finished
    await held.__aexit__(None, None, None)
    await client.__aexit__(None, None, None)
    events = await read_events(h)
    assert any(ev.kind == "cancelled" and "max_staleness 1" in ev.message for ev in events)
    assert any(ev.kind == "migrated" for ev in events)
    st = await h.status()
    assert st.total.finished_by_status["CANCELLED"] == 8  # burst 1: 4 running + 4 queued
    v1 = next(v for v in st.versions if v.policy_version == 1)
    assert v1.finished == 0 and v1.dispatched == 4


async def test_partial_rule_restamps_started_groups_and_survives_a_takeover(sched_env):
    """stale_rule: partial. When the trainer reaches v2, the v0 groups with members running go
    on restamped v2 (records in etcd, routes and tokens kept, the packer told the new stamp at
    close) and the v0 groups none of whose members started are withdrawn; a new leader
    rebuilds the stamps from the records."""
    env = sched_env
    etcd, keys = env.etcd, env.keys
    _, packer, cfg = await _one_cell(env, stale_rule="partial")
    proc, h = await env.start(cfg)
    st = await h.wait_leader()
    assert [(v.policy_version, v.dispatched) for v in st.versions] == [(0, 8)]
    running = [await h.acquire() for _ in range(4)]  # groups b1-t0 and b1-t1, both started
    assert all(e is not None and e.policy_version == 0 for e in running)

    def by_version(s):
        return {v.policy_version: (v.dispatched, v.launched, v.finished) for v in s.versions}

    await etcd.put(keys.policy(), json.dumps({"version": 1, "batch_id": 1}).encode())

    async def v1_out():
        return 1 in by_version(await h.status())

    await wait_until(v1_out, what="a burst at v1")
    await etcd.put(keys.policy(), json.dumps({"version": 2, "batch_id": 2}).encode())

    async def restamped():
        return by_version(await h.status()).get(2, (0, 0, 0))[1] == 4

    await wait_until(restamped, what="the started v0 groups restamped v2")
    st = await h.status()
    # v0 keeps the two unstarted groups, withdrawn (closed at once); the started ones run
    # on at v2, beside the 4 groups the gate (2 + 1 + 1) x 2 let out in their place and in
    # the withdrawn ones'.
    assert by_version(st)[0] == (4, 4, 4)
    assert by_version(st)[1] == (4, 0, 0) and by_version(st)[2] == (12, 4, 0)
    assert (st.stale_rule, st.groups_restamped, st.groups_cancelled) == ("partial", 2, 2)
    assert st.total.finished_by_status["CANCELLED"] == 4
    for e in running:
        route, _ = await env.route(e.execution_id)
        assert route is not None  # still routed, its token still good
        kv = await etcd.get(keys.execution(1, e.execution_id))
        assert json.loads(kv.value)["policy_version"] == 2
    beat = await h.h.Heartbeat(
        scheduler_pb2.HeartbeatRequest(execution_id=running[0].execution_id),
        metadata=(("authorization", f"Bearer {running[0].token}"),),
        timeout=5,
    )
    assert beat.status == common_pb2.EXECUTION_STATUS_RUNNING
    events = await read_events(h)
    assert any(ev.kind == "restamped" and "restamped v2" in ev.message for ev in events)

    # A new leader reads the stamps back from the records.
    proc.stop()
    await h.close()
    proc, h = await env.start(cfg, "scheduler2")
    await h.wait_leader()
    st = await h.status()
    assert by_version(st)[2] == (12, 4, 0) and (st.groups_restamped, st.groups_cancelled) == (2, 2)

    out = await h.finish(running[0], reward=0.5)
    assert out.status == common_pb2.EXECUTION_STATUS_COMPLETED

    async def reported():
        return packer.reports.get(running[0].execution_id) is not None

    await wait_until(reported, what="the packer told of the close")
    assert packer.reports[running[0].execution_id].policy_version == 2


async def test_partial_rule_past_its_limit_cancels(sched_env):
    """partial_max_versions 1: the v0 groups would be restamped v2, two versions past their
    dispatch, so they are cancelled as under the cancel rule, started or not."""
    env = sched_env
    _, _, cfg = await _one_cell(env, stale_rule="partial", partial_max_versions=1)
    _, h = await env.start(cfg)
    await h.wait_leader()
    running = [await h.acquire() for _ in range(4)]
    assert all(e is not None for e in running)
    await env.etcd.put(env.keys.policy(), json.dumps({"version": 2, "batch_id": 2}).encode())

    async def cancelled():
        st = await h.status()
        return st.groups_cancelled == 4

    await wait_until(cancelled, what="the v0 groups cancelled")
    st = await h.status()
    assert st.groups_restamped == 0 and st.total.finished_by_status["CANCELLED"] == 8
    for e in running:
        assert (await env.route(e.execution_id))[0] is None
