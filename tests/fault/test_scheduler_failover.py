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

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from apps.procs import ServiceProcess
from gyre.client import HarnessClient
from gyre.etcd import Keys
from gyre.failpoints import EXIT_STATUS, FAILPOINT_FILE_ENV
from services.scheduler import history
from testkit.fake_packer import FakePacker
from testkit.scheduler_peers import (
    FakeCellAgent,
    FakeRouter,
    Harness,
    connect,
    wait_until,
    write_config,
)
from testkit.tls import PKI, tls

pytestmark = pytest.mark.timeout(120)


async def _start(cfg, tmp_path, name: str, env: dict[str, str | None] | None = None) -> ServiceProcess:
    """Starts a scheduler process off the event loop: a start takes seconds on a loaded
    machine, and the fakes' leases (refreshed on this loop) must not lapse meanwhile."""
    proc = ServiceProcess("scheduler", cfg, env=env, log_path=tmp_path / f"{name}.log", name=name)
    return await asyncio.to_thread(proc.start)


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


async def test_leader_killed_mid_burst_standby_finishes(etcd_server, cluster_name, tmp_path):
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    cell = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 8).start()
    packer = await FakePacker().start(tls("packer"))
    hist = tmp_path / "history.jsonl"
    cfg = write_config(
        tmp_path,
        etcd_server.endpoint,
        cluster_name,
        policy="rollout_only",
        batch_size=4,
        max_bursts=1,
        packer_target=packer.target,
        history_file=str(hist),
    )
    a = await _start(cfg, tmp_path, "sched-a")
    ha = Harness(a.target)
    await ha.wait_leader()
    b = await _start(cfg, tmp_path, "sched-b")
    hb = Harness(b.target)
    try:
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
        ops = history.read(hist)
        assert [o["op"] for o in ops].count("leader") == 2 and [o["op"] for o in ops].count("close") == 8
        assert history.check(ops, complete=True) == []
    finally:
        await ha.close()
        await hb.close()
        a.stop()
        b.stop()
        await cell.stop()
        await packer.stop()
        await etcd.close()


async def test_leader_killed_mid_transition_standby_resumes(etcd_server, cluster_name, tmp_path):
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    core = await FakeCellAgent(etcd, keys, "core", "elastic", 0, 2).start()
    sa = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 2).start()
    router = await FakeRouter(etcd, keys).start()
    packer = await FakePacker().start(tls("packer"))
    core.hold["TRAINING"] = asyncio.Event()  # the switch to training hangs: the leader dies there
    cfg = write_config(
        tmp_path,
        etcd_server.endpoint,
        cluster_name,
        batch_size=2,
        packer_target=packer.target,
        policy="waterlevel",  # the move follows the seed's rule: capacity without the core >= W
    )
    a = await _start(cfg, tmp_path, "sched-a")
    ha = Harness(a.target)
    await ha.wait_leader()
    b = await _start(cfg, tmp_path, "sched-b")
    hb = Harness(b.target)
    try:
        execs = [await ha.acquire() for _ in range(4)]  # sa-0 takes 2, the core 2
        on_core = [
            e
            for e in execs
            if json.loads((await etcd.get(keys.route(e.execution_id))).value)["cell_id"] == "core"
        ]
        on_sa = [e for e in execs if e not in on_core]
        assert len(on_core) == 2
        for e in on_sa:
            await ha.finish(e)  # W = 2 = capacity without the core
        packer.set_supply(2, 2)

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

        async def done():
            return core.state == "TRAINING" and await etcd.get(keys.transition("core")) is None

        await wait_until(done, what="resumed transition")
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
    finally:
        core.hold["TRAINING"].set()
        await ha.close()
        await hb.close()
        a.stop()
        b.stop()
        for x in (core, sa, router, packer):
            await x.stop()
        await etcd.close()


async def _standby(h: Harness):
    st = await h.status()
    return None if st.leader else st


async def test_paused_leader_cannot_change_anything(etcd_server, cluster_name, tmp_path):
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    cell = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 4).start()
    hist = tmp_path / "history.jsonl"
    cfg = write_config(
        tmp_path,
        etcd_server.endpoint,
        cluster_name,
        policy="rollout_only",
        batch_size=2,
        max_bursts=1,
        history_file=str(hist),
    )
    a = await _start(cfg, tmp_path, "sched-a")
    ha = Harness(a.target)
    await ha.wait_leader()
    b = await _start(cfg, tmp_path, "sched-b")
    hb = Harness(b.target)
    try:
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
        assert history.check(history.read(hist)) == []  # no write after the new leader's election
    finally:
        await ha.close()
        await hb.close()
        a.stop()
        b.stop()
        await cell.stop()
        await etcd.close()


async def test_leader_killed_mid_burst_then_successor_killed_mid_transition(
    etcd_server, cluster_name, tmp_path
):
    """Two failovers in one burst: A dies mid-burst, B dies mid-transition, C finishes."""
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    core = await FakeCellAgent(etcd, keys, "core", "elastic", 0, 2).start()
    sa = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 2).start()
    router = await FakeRouter(etcd, keys).start()
    packer = await FakePacker().start(tls("packer"))
    core.hold["TRAINING"] = asyncio.Event()
    hist = tmp_path / "history.jsonl"
    cfg = write_config(
        tmp_path,
        etcd_server.endpoint,
        cluster_name,
        batch_size=2,
        packer_target=packer.target,
        history_file=str(hist),
        policy="waterlevel",  # the move follows the seed's rule: capacity without the core >= W
    )
    procs = [await _start(cfg, tmp_path, "sched-a")]
    hs = [Harness(procs[0].target)]
    try:
        await hs[0].wait_leader()
        for name in ("sched-b", "sched-c"):
            procs.append(await _start(cfg, tmp_path, name))
            hs.append(Harness(procs[-1].target))
        execs = [await hs[0].acquire() for _ in range(4)]
        assert all(execs), f"only {sum(map(bool, execs))} of 4 executions could be launched"
        on_core = [
            e
            for e in execs
            if json.loads((await etcd.get(keys.route(e.execution_id))).value)["cell_id"] == "core"
        ]
        on_sa = [e for e in execs if e not in on_core]
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

        async def done():
            return core.state == "TRAINING" and await etcd.get(keys.transition("core")) is None

        await wait_until(done, what="transition resumed by the third leader")
        for e in on_core:
            kv = await etcd.get(keys.route(e.execution_id))
            assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2
            assert not (await third.finish(e)).duplicate
        t = (await third.status()).total
        assert (t.dispatched, t.launched, t.finished) == (4, 4, 4)
        assert history.check(history.read(hist), complete=True) == []
    finally:
        core.hold["TRAINING"].set()
        for h in hs:
            await h.close()
        for p in procs:
            p.stop()
        for x in (core, sa, router, packer):
            await x.stop()
        await etcd.close()


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


async def test_leader_killed_while_harnesses_work_loses_nothing(etcd_server, cluster_name, tmp_path):
    """The leader dies mid-burst, with executions being acquired, heartbeated and finished;
    its lease (6 s) outlasts what a harness client without failover support would wait. It
    dies at the worst moment of a launch: the execution is in etcd, its history line not yet
    written (the failpoint ``scheduler.launch.landed``); the invoke it wrote first makes that
    launch indeterminate, and its close by the successor checks clean (a SIGKILL at a random
    moment once hit this window in CI: ``b1-t5-1 closed without a launch``)."""
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    cell = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 8).start()
    packer = await FakePacker().start(tls("packer"))
    hist = tmp_path / "history.jsonl"
    cfg = write_config(
        tmp_path,
        etcd_server.endpoint,
        cluster_name,
        policy="rollout_only",
        batch_size=12,
        max_bursts=1,
        packer_target=packer.target,
        history_file=str(hist),
        lease_ttl_s=6,
        heartbeat_interval_s=0.5,
        heartbeat_deadline_s=4.0,
    )
    armed = tmp_path / "failpoints"
    a = await _start(cfg, tmp_path, "sched-a", env={FAILPOINT_FILE_ENV: str(armed)})
    ha = Harness(a.target)
    await ha.wait_leader()
    b = await _start(cfg, tmp_path, "sched-b")
    hb = Harness(b.target)
    tls("harness")  # the harness identity directory
    done: list[str] = []
    errors: list[str] = []
    try:
        async with HarnessClient(
            [a.target, b.target], harness_id="h-fault", tls_dir=PKI / "harness"
        ) as client:
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
        assert history.check(history.read(hist), complete=True) == []
    finally:
        await ha.close()
        await hb.close()
        a.stop()
        b.stop()
        await cell.stop()
        await packer.stop()
        await etcd.close()
