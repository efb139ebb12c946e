"""The scheduler as a real process against a real etcd, with gRPC stand-ins for cells,
router and packer.

Invariants: AcquireExecution launches onto a free slot and writes the route (token hash,
cell target); FinishExecution closes once, deletes the route and reaches the packer; bad
finish reports (unknown id, foreign or unknown token, NaN / negative reward, bad status)
and an oversized request get a precise status and change nothing; a burst runs through transitions both ways (core and
satellite to training with their executions rerouted, satellite back with the new policy,
next burst dispatched), every command carrying the leader's epoch.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest

from gyre.v1 import common_pb2, scheduler_pb2
from testkit.scheduler_peers import read_events, wait_until

pytestmark = pytest.mark.timeout(120)


async def test_skeleton_acquire_finish_and_bad_input(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    cell = await env.cell("sa-0", "standalone", -1, 2)
    packer = await env.packer()
    cfg = env.config(policy="rollout_only", batch_size=2, max_bursts=1, packer_target=packer.target)
    _, h = await env.start(cfg)
    await h.wait_leader()
    a, b = await h.acquire(), await h.acquire()
    assert a is not None and b is not None
    assert await h.acquire(wait_s=0.2) is None  # both slots taken
    kv = await etcd.get(keys.route(a.execution_id))
    route = json.loads(kv.value)
    assert route["cell_id"] == "sa-0" and route["target"] == cell.target and kv.version == 1
    import hashlib

    assert route["token_sha256"] == hashlib.sha256(a.token.encode()).hexdigest()
    assert (
        a.openai_base_url
        and a.heartbeat_deadline_s == 60.0
        and json.loads(a.task_json)["task_id"] == a.task_id
    )

    before = (await h.status()).total
    bad = [
        (grpc.StatusCode.NOT_FOUND, dict(execution_id="b1-t9-9")),
        (grpc.StatusCode.UNAUTHENTICATED, dict(token="nope")),
        (grpc.StatusCode.PERMISSION_DENIED, dict(token=b.token)),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(reward=math.nan)),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(reward=-1.0)),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(status=common_pb2.EXECUTION_STATUS_TIMED_OUT)),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(status=common_pb2.EXECUTION_STATUS_UNSPECIFIED)),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(key="")),
    ]
    for code, kw in bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.finish(a, **kw)
        assert err.value.code() == code, (kw, err.value.details())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.h.FinishExecution(
            scheduler_pb2.FinishExecutionRequest(
                execution_id=a.execution_id, status=3, reward=1.0, idempotency_key="k"
            ),
            timeout=5,
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.h.AcquireExecution(scheduler_pb2.AcquireExecutionRequest(harness_id="", wait_s=1), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:  # over the 16 MiB limit
        await h.h.AcquireExecution(
            scheduler_pb2.AcquireExecutionRequest(harness_id="x" * (17 << 20), wait_s=0), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await h.status()).total == before
    assert await etcd.get(keys.route(a.execution_id)) is not None

    r = await h.finish(a, reward=0.5)
    assert r.status == common_pb2.EXECUTION_STATUS_COMPLETED and not r.duplicate
    r = await h.finish(a, reward=0.9)
    assert r.duplicate and r.status == common_pb2.EXECUTION_STATUS_COMPLETED
    assert await etcd.get(keys.route(a.execution_id)) is None
    await h.finish(b, status=common_pb2.EXECUTION_STATUS_FAILED)
    for _ in range(2):
        e = await h.acquire()
        assert e is not None
        await h.finish(e, status=common_pb2.EXECUTION_STATUS_CANCELLED)
    st = await h.status()
    assert (st.total.dispatched, st.total.finished, st.total.waterlevel) == (4, 4, 0)
    await wait_until(lambda: asyncio.sleep(0, len(packer.reports) == 4), what="finish reports")
    assert packer.reports[a.execution_id].reward == 0.5 and packer.reports[a.execution_id].group_size == 2
    r = await h.h.AcquireExecution(
        scheduler_pb2.AcquireExecutionRequest(harness_id="t", wait_s=0.1), timeout=5
    )
    assert not r.HasField("execution") and r.burst_exhausted


async def test_burst_runs_through_transitions_both_ways(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    core = await env.cell("core", "elastic", 0, 4)
    sat = await env.cell("sat1", "elastic", 1, 4)
    router, packer = await env.router(), await env.packer()
    # The seed's burst-synchronous moves: capacity without the cell >= W, then back at burst end.
    _, h = await env.start(env.config(packer_target=packer.target, policy="waterlevel"))
    st = await h.wait_leader()
    epoch = st.epoch
    execs = [await h.acquire() for _ in range(6)]  # quota 3 groups x 2: sat1 takes 4, core 2
    assert all(e is not None for e in execs)
    on = {
        e.execution_id: json.loads((await etcd.get(keys.route(e.execution_id))).value)["cell_id"]
        for e in execs
    }
    assert sorted(on.values()) == ["core"] * 2 + ["sat1"] * 4
    on_sat = [e for e in execs if on[e.execution_id] == "sat1"]
    on_core = [e for e in execs if on[e.execution_id] == "core"]
    for e in on_sat[:2]:
        await h.finish(e)  # W = 4 = capacity without the core
    packer.set_supply(2, 3)  # 2 of 3 groups ready >= 0.5 x 3

    async def core_training():
        return core.state == "TRAINING" and any(c[0] == "join_batch" for c in core.commands)

    await wait_until(core_training, what="core in training")
    for e in on_core:
        kv = await etcd.get(keys.route(e.execution_id))
        assert json.loads(kv.value)["cell_id"] == "sat1" and kv.version == 2
    assert {(m[1], m[3], m[4]) for m in router.moves} == {(e.execution_id, "sat1", 2) for e in on_core}
    assert [c[2] for c in core.commands if c[0] == "set_state"] == ["DRAINING", "TRAINING"]
    # W 4 > capacity 0 after moving sat1: it stays.
    await asyncio.sleep(0.5)
    assert sat.state == "ROLLOUT"
    for e in [*on_sat[2:], *on_core]:
        await h.finish(e)

    async def sat_training():
        return sat.state == "TRAINING"

    await wait_until(sat_training, what="satellite in training")
    # The core's optimizer step publishes v1: burst end.
    await etcd.put(
        keys.policy(), json.dumps({"version": 1, "source_target": core.target, "batch_id": 1}).encode()
    )

    async def returned():
        return sat.state == "ROLLOUT" and (await h.status()).total.dispatched == 12

    await wait_until(returned, what="satellite back and burst 2 dispatched")
    assert ("load_policy", epoch, 1) in sat.commands
    assert [c[2] for c in sat.commands if c[0] == "set_state"] == [
        "DRAINING",
        "TRAINING",
        "RETURNING",
        "ROLLOUT",
    ]
    assert core.epochs() == sat.epochs() == {epoch} and {m[0] for m in router.moves} == {epoch}
    events = await read_events(h)
    reasons = [ev.message for ev in events if ev.kind == "cell_to_training"]
    assert reasons and "capacity 4 >= W 4" in reasons[0] and "supply 0.67 >= 0.5" in reasons[0]
    st = await h.status()
    assert st.ledger.burst_id == 2 and st.policy_version == 1 and st.reroutes == 2
    assert st.transitions_to_training == 2 and st.transitions_to_rollout >= 1
