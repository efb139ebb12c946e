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
from gyre.failpoints import EXIT_STATUS, FAILPOINT_ENV
from testkit.scheduler_peers import wait_until

pytestmark = pytest.mark.timeout(120)

POINTS = [
    "scheduler.transition.recorded",
    "scheduler.transition.draining",
    "scheduler.transition.rerouted",
    "scheduler.transition.done",
]


@pytest.mark.parametrize("point", POINTS)
async def test_leader_dies_at_a_transition_failpoint(point, sched_env):
    env = sched_env
    etcd, keys = env.etcd, env.keys
    core, _ = await env.move_cells()
    await env.router()
    packer = await env.packer()
    cfg = env.move_config(packer_target=packer.target, history_file=str(env.history))
    a, ha, b, hb = await env.leader_and_standby(cfg, {FAILPOINT_ENV: point}, {FAILPOINT_ENV: None})
    on_core = await env.start_move(ha, packer)  # the core moves to training: the leader dies on the way
    assert await asyncio.to_thread(a.proc.wait, 60) == EXIT_STATUS
    st = await hb.wait_leader()
    assert (st.total.launched, st.total.finished) == (4, 2)
    await wait_until(lambda: env.core_trains(core), timeout_s=30, what="the move resumed by the standby")
    for e in on_core:
        kv = await etcd.get(keys.route(e.execution_id))
        assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2  # moved exactly once
        assert not (await hb.finish(e)).duplicate
    t = (await hb.status()).total
    assert (t.dispatched, t.launched, t.finished) == (4, 4, 4)
    await wait_until(lambda: asyncio.sleep(0, len(packer.reports) == 4), what="all finish reports")
    verdict = check_files([env.history], complete=True)
    assert verdict.ok, verdict.violations
    assert verdict.counts["leader_terms"] == 2
