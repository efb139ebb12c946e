"""An engine process that dies (SIGKILL-like exit) or hangs (SIGSTOP) in the middle of a
stream: with a retry budget the harness's response still completes, token-identical to an
undisturbed one, once the scheduler moves the route; with no budget, or with no destination,
the harness gets a clean error (SSE error event / gRPC UNAVAILABLE) within a bound, never a
hang. Routers and dying engines run as real processes against a real etcd; the routers keep
one GenerateStream per engine (the default: a death breaks it and fails every request on it
with UNAVAILABLE), and one more router calls Generate per request (the older path)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from gyre.v1 import common_pb2, router_pb2
from testkit.fake_engine import FakeOptions, reference
from testkit.router_env import RouterEnv, stream_completion
from testkit.router_rig import sse_token_ids
from testkit.tls import PKI, tls

pytestmark = pytest.mark.asyncio(loop_scope="module")
ROOT = Path(__file__).resolve().parents[2]
PROMPT = [30, 31, 32, 33]
MAX_TOKENS = 40


class EngineProcess:
    """testkit/fake_engine.py as its own process."""

    def __init__(self, cell: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "testkit" / "fake_engine.py"),
                "--cell-id",
                cell,
                "--token-delay-s",
                "0.01",
                "--tls-dir",
                str(PKI / tls(cell).identity().name),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.target = json.loads(self.proc.stdout.readline())["target"]

    def dead(self) -> bool:
        return self.proc.poll() is not None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    async with RouterEnv(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("router_fault"),
        "rf",
        engines=[FakeOptions(cell_id="b", token_delay_s=0.01)],
        packer=False,
        routers=0,
        failover_wait_s=0.5,
        engine_idle_timeout_s=1.0,
        abort_timeout_s=0.3,
        engine_stream=True,
    ) as rig:
        _, url = await rig.add_router("router_budget", retry_budget=2)
        _, url0 = await rig.add_router("router_nobudget", retry_budget=0)
        _, url_pr = await rig.add_router("router_per_request", retry_budget=2, engine_stream=False)
        yield {
            "rig": rig,
            "url": url,
            "url0": url0,
            "url_per_request": url_pr,
            "b": rig.engines["b"],
            "stub": rig.stubs[0],
            "stub0": rig.stubs[1],
        }


@contextlib.asynccontextmanager
async def _engine_process(env, *args: str) -> AsyncIterator[tuple[EngineProcess, str, str]]:
    """A fake engine process at cell a (``args``: how it misbehaves) and a new execution
    routed to it, which the routers have learnt: the engine, the execution and its token.
    The process is killed on exit."""
    engine = EngineProcess("a", *args)
    try:
        ex, tok = await env["rig"].routed("a", engine.target)
        await asyncio.sleep(0.3)
        yield engine, ex, tok
    finally:
        engine.kill()


async def _scheduler_moves_when(env, cond, execution_id: str, token: str) -> None:
    """The scheduler's reaction to a dead/hung cell: rewrite the route to the healthy engine."""
    while not cond():
        await asyncio.sleep(0.01)
    await env["rig"].route(execution_id, "b", token)


async def _sse(url: str, token: str) -> list[dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True}
    return await stream_completion(url, token, body)


async def _grpc(stub, execution_id: str, token: str) -> list[int]:
    out: list[int] = []
    call = stub.Generate(
        router_pb2.GenerateRequest(
            execution_id=execution_id,
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        ),
        metadata=(("authorization", f"Bearer {token}"),),
        timeout=30,
    )
    async for msg in call:
        out.extend(msg.chunk.token_ids)
    return out


@pytest.mark.parametrize(
    ("api", "router"), [("sse", "engine_stream"), ("grpc", "engine_stream"), ("sse", "per_request")]
)
async def test_killed_engine_with_budget_completes_identically(env, api, router):
    async with _engine_process(env, "--die-after-tokens", "12") as (dying, ex, tok):
        mover = asyncio.create_task(_scheduler_moves_when(env, dying.dead, ex, tok))
        streams = env["b"].engine.streams
        if api == "sse":
            url = env["url"] if router == "engine_stream" else env["url_per_request"]
            events = await asyncio.wait_for(_sse(url, tok), 30)
            assert not any("error" in e for e in events), events
            out = sse_token_ids(events)
        else:
            out = await asyncio.wait_for(_grpc(env["stub"], ex, tok), 30)
        await mover
        assert dying.dead()
        assert out == reference(1, PROMPT, MAX_TOKENS)
        if router == "engine_stream":  # the continuation rode the router's stream to b (opened once)
            assert env["b"].engine.streams >= 1
        else:
            assert env["b"].engine.streams == streams


async def test_hung_engine_is_moved_away_identically(env):
    async with _engine_process(env) as (hanging, ex, tok):
        stream = asyncio.create_task(_sse(env["url"], tok))
        await asyncio.sleep(0.15)  # some tokens flow, then the engine freezes
        hanging.proc.send_signal(signal.SIGSTOP)
        await _scheduler_moves_when(env, lambda: True, ex, tok)
        events = await asyncio.wait_for(stream, 30)
        assert not any("error" in e for e in events), events
        assert sse_token_ids(events) == reference(1, PROMPT, MAX_TOKENS)


async def test_killed_engine_without_budget_is_a_clean_error(env):
    async with _engine_process(env, "--die-after-tokens", "12") as (_, ex, tok):
        t0 = time.monotonic()
        events = await asyncio.wait_for(_sse(env["url0"], tok), 30)
        assert time.monotonic() - t0 < 10
        assert events[-1] == {"done": True}
        assert events[-2]["error"]["code"] == 503 and "retry budget 0" in events[-2]["error"]["message"]
        got = sse_token_ids(events)
        assert got == reference(1, PROMPT, MAX_TOKENS)[: len(got)]  # a prefix: nothing wrong was sent
        # gRPC: UNAVAILABLE. The route still points at the dead engine.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(_grpc(env["stub0"], ex, tok), 30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_killed_engine_with_no_destination_is_a_clean_error(env):
    async with _engine_process(env, "--die-after-tokens", "12") as (_, ex, tok):
        t0 = time.monotonic()
        events = await asyncio.wait_for(_sse(env["url"], tok), 30)  # budget 2, but nowhere to go
        assert time.monotonic() - t0 < 10
        assert events[-2]["error"]["code"] == 503 and "3 engine failure" in events[-2]["error"]["message"]
        status = await env["stub"].GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
        assert status.failed_calls >= 1 and status.inflight == 0
