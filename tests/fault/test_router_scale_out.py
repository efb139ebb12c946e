"""Several routers serve one cluster: no router holds state another needs (routes come from
each router's etcd watch), so

- a reroute reaches whichever router holds the live call: two calls of two executions, one
  on each router process, both continue at the destination when the scheduler rewrites
  their routes and calls MoveExecutions on every registered router (the scheduler's own
  fan-out, one of the targets dead), token-identical to undisturbed calls, with one turn
  record each;
- a router killed (SIGKILL) mid-stream costs the harness one retry at another router: the
  retried call (same body, same execution token) completes token-identical, the dead
  router's engine request is aborted, and the packer gets the turn exactly once.

Real router processes and a real etcd; the engines are the deterministic fake engine
(gRPC servers on loopback) and the packer a recording stand-in."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import pytest_asyncio

from gyre.ports import free_port
from services.scheduler.config import SchedulerConfig
from services.scheduler.peers import GrpcPeers, MoveOrder
from testkit.fake_engine import FakeOptions, reference
from testkit.leader import leader_epoch, new_leader
from testkit.router_env import RouterEnv, stream_completion, stream_tokens
from testkit.router_rig import sse_token_ids, start_router
from testkit.tls import PKI, tls

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = [40, 41, 42, 43, 44]
MAX_TOKENS = 40


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    async with RouterEnv(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("routers"),
        "rs",
        engines=[FakeOptions(cell_id=cell, token_delay_s=0.01) for cell in ("a", "b")],
        routers=2,
        retry_budget=0,
        failover_wait_s=0.5,
        unknown_token_wait_s=20.0,
        move_route_wait_s=20.0,
    ) as e:
        yield e


def _body() -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True}


async def _sse(url: str, token: str) -> list[dict[str, Any]]:
    return await stream_completion(url, token, _body())


def _progress(env: RouterEnv, cell: str, execution_id: str) -> int:
    """Tokens the newest attempt of ``execution_id`` at ``cell`` has produced."""
    engine = env.engines[cell].engine
    rids = [r.request_id for r in engine.requests if r.execution_id == execution_id]
    return engine.progress.get(rids[-1], 0) if rids else 0


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Waits for ``cond`` (polled; a generous bound for a loaded machine)."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _turn(env: RouterEnv, execution_id: str) -> Any:
    """The packer's record of the execution's turn 0 (once the recorder sent it)."""
    await _until(lambda: (execution_id, 0) in env.packer.turns, "the turn record")
    return env.packer.turns[(execution_id, 0)]


async def test_reroute_reaches_the_call_on_each_router(env):
    want = reference(1, PROMPT, MAX_TOKENS)
    calls = [await env.routed("a") for _ in env.routers]
    running = [
        asyncio.create_task(_sse(url, tok)) for (_, url), (_, tok) in zip(env.routers, calls, strict=True)
    ]
    for ex, _ in calls:
        await _until(lambda ex=ex: _progress(env, "a", ex) >= 6, f"{ex} under way at a")
    # The scheduler's move: fenced route rewrites, then MoveExecutions on every router.
    await new_leader(env.etcd, env.keys)
    epoch = await leader_epoch(env.etcd, env.keys)
    moves = []
    for ex, tok in calls:
        route_epoch = await env.route(ex, "b", tok)
        moves.append(MoveOrder(ex, "a", "b", route_epoch))
    # The scheduler's own fan-out, with a router that is gone but still registered among
    # them: the live routers still get the move.
    tls("scheduler")
    peers = GrpcPeers(SchedulerConfig(tls={"dir": str(PKI / "scheduler")}), "", 5.0, 10.0)
    try:
        targets = [f"127.0.0.1:{free_port()}", *(p.target for p, _ in env.routers)]
        assert await peers.move_executions(targets, epoch, moves) == 0
    finally:
        await peers.close()
    for (ex, _), task in zip(calls, running, strict=True):
        events = await task
        assert events[-1] == {"done": True} and not any("error" in e for e in events), events
        assert sse_token_ids(events) == want
        assert _progress(env, "b", ex) > 0  # it did continue at the destination
        turn = await _turn(env, ex)
        assert list(turn.output_token_ids) == want
        assert (ex, 1) not in env.packer.turns


async def test_router_killed_mid_stream_the_harness_retries_at_another(env):
    want = reference(1, PROMPT, MAX_TOKENS)
    doomed, doomed_url = start_router(env.cfg, env.tmp / "doomed.log")
    try:
        ex, tok = await env.routed("a")

        async def kill_after_8(got: list[int]) -> None:
            if len(got) >= 8 and doomed.alive:
                doomed.kill()  # SIGKILL: no drain, no goodbye

        got, failed = await stream_tokens(doomed_url, tok, _body(), kill_after_8)
        assert failed or len(got) < MAX_TOKENS, "the stream outlived its router"
        assert got == want[: len(got)]
        # The engine saw its caller vanish: the dead router's request is no longer running.
        engine = env.engines["a"].engine
        first = next(r.request_id for r in engine.requests if r.execution_id == ex)
        await _until(lambda: first not in engine.running, "the orphaned request to end")
        # The harness retries the same call at a live router: the same tokens, once.
        events = await _sse(env.routers[1][1], tok)
        assert events[-1] == {"done": True} and not any("error" in e for e in events), events
        assert sse_token_ids(events) == want
        turn = await _turn(env, ex)
        assert list(turn.output_token_ids) == want
        assert (ex, 1) not in env.packer.turns
    finally:
        doomed.stop()
