"""The scheduler leader dies at each failpoint of a move to training (the record written;
the cell draining; its routes moved in etcd but the routers not told; every step done but
the record not yet deleted): the standby takes over and resumes the move from the top.
Each route moves exactly once, the cell ends in training, the record is gone, every
execution closes once and the history of both leaders checks clean."""

from __future__ import annotations

import asyncio
import json

import pytest

from apps.checker import check_files
from apps.procs import ServiceProcess
from gyre.etcd import Keys
from gyre.failpoints import EXIT_STATUS, FAILPOINT_ENV
from testkit.fake_packer import FakePacker
from testkit.scheduler_peers import (
    FakeCellAgent,
    FakeRouter,
    Harness,
    connect,
    wait_until,
    write_config,
)
from testkit.tls import tls

pytestmark = pytest.mark.timeout(120)

POINTS = [
    "scheduler.transition.recorded",
    "scheduler.transition.draining",
    "scheduler.transition.rerouted",
    "scheduler.transition.done",
]


async def _start(cfg, tmp_path, name: str, env: dict[str, str | None]) -> ServiceProcess:
    proc = ServiceProcess("scheduler", cfg, env=env, log_path=tmp_path / f"{name}.log", name=name)
    return await asyncio.to_thread(proc.start)  # off the loop: the fakes' leases stay fresh


@pytest.mark.parametrize("point", POINTS)
async def test_leader_dies_at_a_transition_failpoint(point, etcd_server, cluster_name, tmp_path):
    etcd = await connect(etcd_server.endpoint)
    keys = Keys(cluster_name)
    core = await FakeCellAgent(etcd, keys, "core", "elastic", 0, 2).start()
    sa = await FakeCellAgent(etcd, keys, "sa-0", "standalone", -1, 2).start()
    router = await FakeRouter(etcd, keys).start()
    packer = await FakePacker().start(tls("packer"))
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
    a = await _start(cfg, tmp_path, "sched-a", {FAILPOINT_ENV: point})
    ha = Harness(a.target)
    hb = None
    b = None
    try:
        await ha.wait_leader()
        b = await _start(cfg, tmp_path, "sched-b", {FAILPOINT_ENV: None})
        hb = Harness(b.target)
        execs = [await ha.acquire() for _ in range(4)]  # sa-0 takes 2, the core 2
        assert all(execs)
        on_core = [
            e
            for e in execs
            if json.loads((await etcd.get(keys.route(e.execution_id))).value)["cell_id"] == "core"
        ]
        for e in execs:
            if e not in on_core:
                await ha.finish(e)  # W = 2 = capacity without the core
        packer.set_supply(2, 2)  # the core moves to training: the leader dies on the way
        assert await asyncio.to_thread(a.proc.wait, 60) == EXIT_STATUS
        st = await hb.wait_leader()
        assert (st.total.launched, st.total.finished) == (4, 2)

        async def resumed():
            return core.state == "TRAINING" and await etcd.get(keys.transition("core")) is None

        await wait_until(resumed, timeout_s=30, what="the move resumed by the standby")
        for e in on_core:
            kv = await etcd.get(keys.route(e.execution_id))
            assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2  # moved exactly once
            assert not (await hb.finish(e)).duplicate
        t = (await hb.status()).total
        assert (t.dispatched, t.launched, t.finished) == (4, 4, 4)
        await wait_until(lambda: asyncio.sleep(0, len(packer.reports) == 4), what="all finish reports")
        verdict = check_files([hist], complete=True)
        assert verdict.ok, verdict.violations
        assert verdict.counts["leader_terms"] == 2
    finally:
        await ha.close()
        if hb is not None:
            await hb.close()
        a.stop()
        if b is not None:
            b.stop()
        for x in (core, sa, router, packer):
            await x.stop()
        await etcd.close()
