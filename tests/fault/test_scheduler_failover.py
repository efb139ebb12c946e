"""Scheduler failover with real processes and a real etcd: SIGKILL and SIGSTOP of the leader.

Invariants: when the leader is killed mid-burst, the standby takes over with the same ledger
(no execution lost, none counted twice) and finishes the burst; when it is killed in the
middle of a transition, the standby resumes it (routes moved exactly once, the cell ends in
training, the transition record is gone), also as the second failover of one burst; a leader
paused past its lease and resumed cannot change anything (its writes are refused, etcd is
unchanged) and steps down: a standby again, answering UNAVAILABLE with the leader's address
and a retry hint. The JSONL history of all leaders passes the offline checker.
A failover is invisible to harnesses: SIGKILL of the leader while real harness clients
acquire, heartbeat and finish; every execution completes (none times out, none is lost or
counted twice) and every harness call succeeds.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gyre.client import HarnessClient
from gyre.etcd import Keys
from gyre.failpoints import EXIT_STATUS, FAILPOINT_FILE_ENV
from services.scheduler import history
from testkit.scheduler_env import SchedulerEnv
from testkit.scheduler_peers import Harness, wait_until
from testkit.tls import PKI, tls

pytestmark = pytest.mark.timeout(120)


async def _harness_health(h: Harness) -> int:
    stub = health_pb2_grpc.HealthStub(h.channel)
    got = await stub.Check(health_pb2.HealthCheckRequest(service="gyre.v1.HarnessService"), timeout=5)
    return got.status


async def _ledger_keys(etcd, keys: Keys) -> dict[bytes, tuple[bytes, int]]:
    out = {}
    for prefix in (keys.bursts(), keys.executions(), keys.routes(), keys.transitions()):
        _, kvs = await etcd.get_prefix(prefix)
        out.update({kv.key: (kv.value, kv.mod_revision) for kv in kvs})
    return out


async def _one_burst(env: SchedulerEnv, slots: int, batch_size: int, **scheduler: object) -> Path:
    """One standalone cell of ``slots`` slots and the config of one rollout-only burst of
    ``batch_size`` groups, written to ``env.history``, with ``scheduler`` on top."""
    await env.cell("sa-0", "standalone", -1, slots)
    return env.config(
        policy="rollout_only",
        batch_size=batch_size,
        max_bursts=1,
        history_file=str(env.history),
        **scheduler,
    )


async def test_leader_killed_mid_burst_standby_finishes(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    packer = await env.packer()
    a, ha, b, hb = await env.leader_and_standby(await _one_burst(env, 8, 4, packer_target=packer.target))
    assert not (await hb.status()).leader
    assert await _harness_health(hb) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await _harness_health(ha) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await hb.acquire(wait_s=0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and a.target in err.value.details()
    trailing = dict(err.value.trailing_metadata() or ())
    assert trailing.get("x-gyre-leader") == a.target and trailing.get(
        "retry-after-ms"
    )  # the client follows it
    execs = [await ha.acquire() for _ in range(5)]
    for e in execs[:2]:
        await ha.finish(e)
    before = (await ha.status()).total
    assert (before.dispatched, before.launched, before.finished) == (8, 5, 2)
    a.kill()
    st = await hb.wait_leader()
    assert st.epoch > 0
    assert await _harness_health(hb) == health_pb2.HealthCheckResponse.SERVING
    t = st.total
    assert (t.dispatched, t.launched, t.finished, t.waterlevel) == (8, 5, 2, 6)
    assert (await hb.finish(execs[0])).duplicate  # closed by the old leader: not twice
    for e in execs[2:]:
        assert not (await hb.finish(e)).duplicate
    for _ in range(3):
        e = await hb.acquire()
        assert e is not None
        await hb.finish(e)
    t = (await hb.status()).total
    assert (t.dispatched, t.launched, t.finished, t.waterlevel) == (8, 8, 8, 0)
    _, recs = await etcd.get_prefix(keys.executions())
    states = [json.loads(kv.value)["state"] for kv in recs]
    assert len(states) == 8 and all(s == "COMPLETED" for s in states)
    _, routes = await etcd.get_prefix(keys.routes())
    assert routes == []
    await wait_until(lambda: asyncio.sleep(0, len(packer.reports) == 8), what="all finish reports")
    ops = history.read(env.history)
    assert [o["op"] for o in ops].count("leader") == 2 and [o["op"] for o in ops].count("close") == 8
    assert history.check(ops, complete=True) == []


async def test_leader_killed_mid_transition_standby_resumes(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    core, _ = await env.move_cells()
    router, packer = await env.router(), await env.packer()
    core.hold["TRAINING"] = asyncio.Event()  # the switch to training hangs: the leader dies there
    a, ha, b, hb = await env.leader_and_standby(env.move_config(packer_target=packer.target))
    on_core = await env.start_move(ha, packer)
    assert len(on_core) == 2

    async def stuck():
        return (
            len(router.moves) == 2
            and core.state == "DRAINING"
            and await etcd.get(keys.transition("core")) is not None
        )

    await wait_until(stuck, what="transition frozen before TRAINING")
    epoch_a = (await ha.status()).epoch
    before = (await ha.status()).total
    a.kill()
    st = await hb.wait_leader()
    assert st.epoch > epoch_a
    assert (st.total.dispatched, st.total.launched, st.total.finished) == (
        before.dispatched,
        before.launched,
        before.finished,
    )
    core.hold["TRAINING"].set()
    await wait_until(lambda: env.core_trains(core), what="resumed transition")
    for e in on_core:
        kv = await etcd.get(keys.route(e.execution_id))
        assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2  # moved exactly once
    switches = [(ep, s) for n, ep, s in core.commands if n == "set_state"]
    assert ("TRAINING", st.epoch) in [(s, ep) for ep, s in switches]
    assert ("TRAINING", epoch_a) not in [(s, ep) for ep, s in switches]
    assert any(n == "join_batch" and ep == st.epoch for n, ep, _ in core.commands)
    for e in on_core:
        assert not (await hb.finish(e)).duplicate
    t = (await hb.status()).total
    assert (t.launched, t.finished) == (4, 4)


async def _standby(h: Harness):
    st = await h.status()
    return None if st.leader else st


async def test_paused_leader_cannot_change_anything(sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    a, ha, b, hb = await env.leader_and_standby(await _one_burst(env, 4, 2))
    e1, _e2 = await ha.acquire(), await ha.acquire()
    epoch_a = (await ha.status()).epoch
    a.pause()
    st = await hb.wait_leader()
    assert st.epoch > epoch_a
    before = await _ledger_keys(etcd, keys)
    a.resume()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ha.finish(e1)
    assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE), (
        err.value.details()
    )
    # A lost lease is not fatal: the old leader steps down and is a standby again.
    st_a = await wait_until(lambda: _standby(ha), 20)
    assert a.alive() and not st_a.leader
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ha.acquire(wait_s=0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and b.target in err.value.details()
    trailing = dict(err.value.trailing_metadata() or ())
    assert trailing.get("retry-after-ms") and trailing.get("x-gyre-leader") == b.target
    assert await _ledger_keys(etcd, keys) == before
    out = await hb.finish(e1)
    assert not out.duplicate
    t = (await hb.status()).total
    assert (t.launched, t.finished) == (2, 1)
    assert history.check(history.read(env.history)) == []  # no write after the new leader's election


async def test_leader_killed_mid_burst_then_successor_killed_mid_transition(sched_env):
    """Two failovers in one burst: A dies mid-burst, B dies mid-transition, C finishes."""
    env = sched_env
    etcd, keys = env.etcd, env.keys
    core, _ = await env.move_cells()
    router, packer = await env.router(), await env.packer()
    core.hold["TRAINING"] = asyncio.Event()
    cfg = env.move_config(packer_target=packer.target, history_file=str(env.history))
    a, ha, b, hb = await env.leader_and_standby(cfg)
    c, hc = await env.start(cfg, "sched-c")
    procs, hs = [a, b, c], [ha, hb, hc]
    on_core, on_sa = await env.launch_four(hs[0])
    await hs[0].finish(on_sa[0])
    procs[0].kill()  # mid-burst

    async def leader_of(candidates):
        for h in candidates:
            try:
                st = await h.status()
            except grpc.aio.AioRpcError:
                continue
            if st.leader:
                return h, st
        return None

    second, st = await wait_until(lambda: leader_of(hs[1:]), timeout_s=20, what="second leader")
    assert (st.total.launched, st.total.finished) == (4, 1)
    await second.finish(on_sa[1])  # W = 2 = capacity without the core
    packer.set_supply(2, 2)

    async def stuck():
        return len(router.moves) == 2 and core.state == "DRAINING"

    await wait_until(stuck, what="second leader's transition frozen before TRAINING")
    procs[hs.index(second)].kill()  # mid-transition
    rest = [h for h in hs[1:] if h is not second]
    third, st3 = await wait_until(lambda: leader_of(rest), timeout_s=20, what="third leader")
    assert st3.epoch > st.epoch and (st3.total.launched, st3.total.finished) == (4, 2)
    core.hold["TRAINING"].set()
    await wait_until(lambda: env.core_trains(core), what="transition resumed by the third leader")
    for e in on_core:
        kv = await etcd.get(keys.route(e.execution_id))
        assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2
        assert not (await third.finish(e)).duplicate
    t = (await third.status()).total
    assert (t.dispatched, t.launched, t.finished) == (4, 4, 4)
    assert history.check(history.read(env.history), complete=True) == []


async def _harness_worker(
    client: HarnessClient, done: list[str], errors: list[str], rng: random.Random
) -> None:
    """Acquire, hold (heartbeating in the background), finish; until the burst runs out."""
    while True:
        try:
            execution = await client.acquire(wait_s=1.0)
        except Exception as exc:  # noqa: BLE001 -- a harness call that failed is the finding
            errors.append(f"acquire: {exc!r}")
            return
        if execution is None:
            if client.last_burst_exhausted:
                return
            continue
        try:
            async with execution:
                await asyncio.sleep(rng.uniform(0.3, 1.5))  # the episode; heartbeats go on
                await execution.finish(reward=1.0)
            done.append(execution.execution_id)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{execution.execution_id}: {exc!r}")


async def test_leader_killed_while_harnesses_work_loses_nothing(sched_env, tmp_path):
    """The leader dies mid-burst, with executions being acquired, heartbeated and finished;
    its lease (6 s) outlasts what a harness client without failover support would wait. It
    dies at the worst moment of a launch: the execution is in etcd, its history line not yet
    written (the failpoint ``scheduler.launch.landed``); the invoke it wrote first makes that
    launch indeterminate, and its close by the successor checks clean (a SIGKILL at a random
    moment once hit this window in CI: ``b1-t5-1 closed without a launch``)."""
    env = sched_env
    packer = await env.packer()
    cfg = await _one_burst(
        env,
        8,
        12,
        packer_target=packer.target,
        lease_ttl_s=6,
        heartbeat_interval_s=0.5,
        heartbeat_deadline_s=4.0,
    )
    armed = tmp_path / "failpoints"
    a, ha, b, hb = await env.leader_and_standby(cfg, leader_env={FAILPOINT_FILE_ENV: str(armed)})
    tls("harness")  # the harness identity directory
    done: list[str] = []
    errors: list[str] = []
    async with HarnessClient([a.target, b.target], harness_id="h-fault", tls_dir=PKI / "harness") as client:
        workers = [
            asyncio.create_task(_harness_worker(client, done, errors, random.Random(i))) for i in range(6)
        ]
        await wait_until(lambda: asyncio.sleep(0, len(done) >= 6), timeout_s=60, what="work under way")
        armed.write_text("scheduler.launch.landed")  # the next launch kills the leader
        assert await asyncio.to_thread(a.wait, 30) == EXIT_STATUS
        await asyncio.wait_for(asyncio.gather(*workers), 90)
        assert client.retries > 0  # the failover happened under the harnesses' calls
    assert errors == []
    st = await hb.wait_leader()
    t = st.total
    assert (t.dispatched, t.launched, t.finished) == (24, 24, 24), t
    assert dict(st.total.finished_by_status) == {"COMPLETED": 24}
    assert sorted(done) == sorted(set(done)) and len(done) == 24
    await wait_until(lambda: asyncio.sleep(0, len(packer.reports) == 24), what="all finish reports")
    assert history.check(history.read(env.history), complete=True) == []
