"""Links between services misbehave under traffic (testkit/proxy.py; real processes,
real etcd, real gRPC with mTLS). Router -> engine (the deterministic fake engine), while a
model call streams through it: delayed, reset mid-stream, black-holed for seconds and then
reset; each time the harness gets one response holding exactly the tokens of an
undisturbed call (the router continues the request at the engine: nothing duplicated,
nothing lost), and its turn is recorded once. Scheduler -> cell, during a move to training:
slow, then reset mid-move; and black-holed for longer than the cell's lease and many command
deadlines while the cell stays registered (cut as it enters TRAINING, or as it is asked to
join the batch), then healed. Each time the move completes (the scheduler retries the
idempotent commands while the cell lives), the cell joins the batch, each route moves once,
every execution closes once and the history checks clean."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from apps.checker import check_files
from gyre.etcd import Etcd, Keys
from testkit.fake_engine import FakeOptions, reference
from testkit.fake_packer import FakePacker
from testkit.proxy import LinkProxy
from testkit.router_env import RouterEnv
from testkit.scheduler_env import scheduler_env
from testkit.scheduler_peers import (
    FakeCellAgent,
    FakeRouter,
    Harness,
    wait_until,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
PROMPT = [20, 21, 22]
MAX_TOKENS = 60


class Env(RouterEnv):
    """The router, its one engine (cell a) and the link proxy in front of it."""

    proxy: LinkProxy


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    async with Env(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("links"),
        "lk",
        engines=[FakeOptions(cell_id="a", token_delay_s=0.02)],
        retry_budget=20,  # a black-holed link fails every attempt until it is reset
        failover_wait_s=0.2,  # no scheduler here: retry at the same route soon
        engine_idle_timeout_s=1.0,
        report_engine_failures=False,
    ) as e:
        e.proxy = await LinkProxy(e.engine.target).start()
        e.defer(e.proxy.stop)
        yield e


async def _call(env: Env, token: str) -> dict:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "return_token_ids": True}
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as s:
        for _ in range(100):  # the route reaches the router through its watch
            async with s.post(f"{env.url}/completions", json=body, headers=headers) as r:
                data = await r.json()
            if r.status != 401:
                break
            await asyncio.sleep(0.1)
    assert r.status == 200, data
    return data


async def _started(env: Env, execution_id: str, tokens: int) -> None:
    """Waits until the engine has sent ``tokens`` tokens of the call's first attempt."""
    while True:
        rids = [r.request_id for r in env.engine.engine.requests if r.execution_id == execution_id]
        if rids and env.engine.engine.progress.get(rids[0], 0) >= tokens:
            return
        await asyncio.sleep(0.005)


async def _through(env: Env, fault) -> tuple[list[int], int]:
    """One call through the proxy, ``fault(env)`` injected once 10 tokens have streamed;
    the harness's tokens and the engine attempts the call took."""
    ex, token = await env.routed("a", env.proxy.target)
    call = asyncio.create_task(_call(env, token))
    await asyncio.wait_for(_started(env, ex, 10), 30)
    await fault(env)
    data = await asyncio.wait_for(call, 60)
    attempts = sum(1 for r in env.engine.engine.requests if r.execution_id == ex)
    for _ in range(100):
        if any(key[0] == ex for key in env.packer.turns):
            break
        await asyncio.sleep(0.05)
    assert [k for k in env.packer.turns if k[0] == ex] == [(ex, 0)]  # the turn, recorded once
    return data["choices"][0]["token_ids"], attempts


async def _delay(env: Env) -> None:
    env.proxy.delay_s = 0.05


async def _reset(env: Env) -> None:
    env.proxy.reset()


async def _partition(env: Env) -> None:
    env.proxy.blackhole()
    await asyncio.sleep(2.5)  # the partition lasts past the router's idle timeout (1 s)
    env.proxy.heal()
    env.proxy.reset()  # as the partition ends, both ends find their connections broken


@pytest.mark.parametrize("fault", [_delay, _reset, _partition], ids=["delay", "reset", "partition"])
async def test_a_call_survives_its_link_misbehaving(env, fault):
    env.proxy.delay_s = 0.0
    tokens, attempts = await _through(env, fault)
    assert tokens == reference(1, PROMPT, MAX_TOKENS)  # none lost, none twice
    if fault is not _delay:
        assert attempts >= 2  # continued at the engine after the broken link


@dataclasses.dataclass
class Move:
    """A scheduler (a real process) moving the fake core cell to training through a link
    proxy, frozen with the cell holding its command to enter TRAINING."""

    etcd: Etcd
    keys: Keys
    core: FakeCellAgent
    link: LinkProxy
    router: FakeRouter
    packer: FakePacker
    h: Harness
    hist: Path
    on_core: list


@contextlib.asynccontextmanager
async def _move_held(etcd_server, cluster_name, tmp_path, lease_ttl_s: int = 5, **scheduler):
    """Four executions, two on the core; the two elsewhere finish, supply arrives and the
    scheduler moves the core to training (its link delays every chunk 50 ms): yields once
    the core is DRAINING with both of its routes moved and its command to enter TRAINING held."""
    async with scheduler_env(etcd_server.endpoint, cluster_name, tmp_path) as env:
        core, _ = await env.move_cells(lease_ttl_s)
        link = env.track(await LinkProxy(core.target).start())
        core.target = link.target  # the scheduler reaches the core through the link
        await core._register()
        router, packer = await env.router(), await env.packer()
        core.hold["TRAINING"] = asyncio.Event()
        cfg = env.move_config(packer_target=packer.target, history_file=str(env.history), **scheduler)
        _, h = await env.start(cfg, "sched")
        await h.wait_leader()
        link.delay_s = 0.05
        on_core = await env.start_move(h, packer)

        async def held():
            return core.state == "DRAINING" and len(router.moves) == 2

        await wait_until(held, timeout_s=30, what="the command to enter TRAINING in flight")
        yield Move(env.etcd, env.keys, core, link, router, packer, h, env.history, on_core)


async def _moved(m: Move) -> bool:
    """The move is over: the core trains, has joined the batch, and the scheduler has dropped
    its record."""
    joined = any(c[0] == "join_batch" for c in m.core.commands)
    return joined and m.core.state == "TRAINING" and await m.etcd.get(m.keys.transition("core")) is None


async def _check_moved_once(m: Move) -> None:
    """Each of the core's routes moved exactly once (to sa-0), every execution closes once,
    all four reach the packer, and the history checks clean."""
    assert len(m.router.moves) == 2
    for e in m.on_core:
        kv = await m.etcd.get(m.keys.route(e.execution_id))
        assert json.loads(kv.value)["cell_id"] == "sa-0" and kv.version == 2  # moved once
        assert not (await m.h.finish(e)).duplicate
    await wait_until(lambda: asyncio.sleep(0, len(m.packer.reports) == 4), what="all finish reports")
    verdict = check_files([m.hist], complete=True)
    assert verdict.ok, verdict.violations


async def test_a_move_to_training_survives_its_scheduler_cell_link_misbehaving(
    etcd_server, cluster_name, tmp_path
):
    """The scheduler's link to the cell it moves to training is slow (every chunk 50 ms
    late), then reset while the move is under way (the cell holds its command to enter
    TRAINING): the commands are retried (they are idempotent), the move completes, each route moves once, every
    execution closes once and the history checks clean."""
    async with _move_held(etcd_server, cluster_name, tmp_path) as m:
        m.link.reset()  # the command's connection breaks under it
        m.core.hold["TRAINING"].set()
        await wait_until(lambda: _moved(m), timeout_s=30, what="the move completed")
        assert m.link.resets >= 1
        await _check_moved_once(m)


CELL_LEASE_S = 3
COMMAND_TIMEOUT_S = 1.0
PARTITION_S = 8.0  # past the cell's lease (3 s) and many command deadlines (1 s each)


@pytest.mark.parametrize("step", ["entering", "joining"])
async def test_a_move_to_training_survives_a_partition_longer_than_a_lease(
    etcd_server, cluster_name, tmp_path, step
):
    """The scheduler's link to the cell it moves to training is black-holed (bytes swallowed,
    connections left open) for longer than the cell's lease TTL and many command deadlines,
    while the cell keeps its registration (it still reaches etcd: only the link is cut).
    ``entering``: the cut falls while the cell holds the command to enter TRAINING; the cell
    then enters it, but its answer is lost. ``joining``: the cut falls while the cell, in
    TRAINING, holds the JoinBatch that follows; no try reaches it until the heal. A cell that
    is still registered is alive: the scheduler neither gives up nor fails it, it retries the
    idempotent commands (each try bounded by command_timeout_s), keeping the transition
    recorded. Once the partition heals (and the broken connections are reset) the move
    completes promptly, the cell joins the batch, each route moved once, every execution
    closes once and the history checks clean."""
    async with _move_held(
        etcd_server, cluster_name, tmp_path, lease_ttl_s=CELL_LEASE_S, command_timeout_s=COMMAND_TIMEOUT_S
    ) as m:
        core, lease = m.core, m.core.lease
        held = "TRAINING"
        if step == "joining":
            held = "JOIN_BATCH"
            core.hold[held] = asyncio.Event()
            core.hold["TRAINING"].set()
        # Each try of a command is held at the cell until its deadline: cut the link while
        # one is held.
        await wait_until(lambda: asyncio.sleep(0, core.waiting.get(held, 0) > 0), what=f"{held} held")
        m.link.blackhole()
        if step == "entering":
            core.hold["TRAINING"].set()  # the cell enters TRAINING; its answer is swallowed
        await asyncio.sleep(PARTITION_S)
        # Still registered under the same lease, and nothing moved again.
        assert core.lease == lease and await m.etcd.get(m.keys.cell("core")) is not None
        assert core.state == "TRAINING" and len(m.router.moves) == 2
        assert not [c for c in core.commands if c[0] == "join_batch"]
        if step == "entering":  # the scheduler still holds the move
            assert await m.etcd.get(m.keys.transition("core")) is not None
        core.hold[held].set()
        m.link.heal()
        m.link.reset()  # as the partition ends, both ends find their connections broken
        await wait_until(lambda: _moved(m), timeout_s=15, what="the move completed after the heal")
        await _check_moved_once(m)
