"""A live model call moved by the scheduler (route rewritten in etcd with a fenced epoch,
then Router.MoveExecutions) continues at the destination: the harness receives exactly the
tokens of the same request without a move — once and several times, over HTTP streaming,
HTTP non-streaming and gRPC — every source attempt is aborted, and the turn record that
reaches the packer carries those tokens and their policy version. A destination serving
another policy version is refused with a clean error. All of it runs on the default engine
path (one GenerateStream per engine, kept across every attempt there); a gRPC call moved
three times runs on the other one too (one Generate call per request: a second router).
The router runs as a real process against a real etcd; engines are the deterministic fake."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from gyre.v1 import common_pb2, router_pb2
from testkit.fake_engine import FakeOptions, reference
from testkit.leader import leader_epoch, new_leader
from testkit.router_env import RouterEnv
from testkit.router_rig import read_sse, sse_token_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 48
MESSAGES = [{"role": "user", "content": "read notes.txt and answer"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    """A router on one GenerateStream per engine (the default)."""
    async with _router_env(True, etcd_server, tmp_path_factory) as e:
        yield e


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def per_request_env(etcd_server, tmp_path_factory):
    """A router on one Generate call per request (``engine_stream: false``)."""
    async with _router_env(False, etcd_server, tmp_path_factory) as e:
        yield e


@contextlib.asynccontextmanager
async def _router_env(engine_stream: bool, etcd_server, tmp_path_factory) -> AsyncIterator[RouterEnv]:
    # 15 ms a token: a call lasts ~0.7 s, so a move (an etcd write, then MoveExecutions) lands
    # while it still runs even on a loaded machine (at 4 ms the third move of a 48-token call
    # sometimes found it finished: moved_requests 0).
    engines = [
        FakeOptions(cell_id=cell, policy_version=version, token_delay_s=0.015, tokens_per_chunk=2)
        for cell, version in (("a", 1), ("b", 1), ("c", 1), ("v2", 2))
    ]
    async with RouterEnv(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("router"),
        "rr",
        engines=engines,
        retry_budget=0,
        failover_wait_s=0.5,
        engine_stream=engine_stream,
    ) as env:
        yield env


async def _attempts(env: RouterEnv, cell: str, execution_id: str) -> list[str]:
    return [r.request_id for r in env.engines[cell].engine.requests if r.execution_id == execution_id]


async def scheduler_moves(
    env: RouterEnv, execution_id: str, token: str, path: list[str], every: int, check_moved: bool = True
) -> int:
    """Acts as the scheduler: each time the current engine has produced ``every`` tokens of
    the call, rewrites the route to the next cell and calls MoveExecutions."""
    current = path[0]
    for dest in path[1:]:
        while True:
            rids = await _attempts(env, current, execution_id)
            progress = env.engines[current].engine.progress
            if rids and progress.get(rids[-1], 0) >= every:
                break
            await asyncio.sleep(0.002)
        epoch = await env.route(execution_id, dest, token)
        reply = await env.stub.MoveExecutions(
            router_pb2.MoveExecutionsRequest(
                fence=common_pb2.Fence(epoch=await leader_epoch(env.etcd, env.keys)),
                moves=[
                    router_pb2.Move(
                        execution_id=execution_id, from_cell=current, to_cell=dest, route_epoch=epoch
                    )
                ],
            ),
            timeout=5,
        )
        assert reply.remaining_at_source == 0
        if check_moved:
            assert reply.moved_requests == 1
        current = dest
    return len(path) - 1


async def http_call(
    env: RouterEnv, token: str, stream: bool, execution_id: str | None = None
) -> tuple[list[int], list[int], dict[str, Any]]:
    """(prompt ids, output ids, last body/event) of one chat completion."""
    headers = {"Authorization": f"Bearer {token}"}
    if execution_id:
        headers["x-gyre-execution-id"] = execution_id
    body = {
        "model": "model",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "return_token_ids": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{env.url}/chat/completions", json=body, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()
        if stream:
            events = await read_sse(resp)
            assert events[-1] == {"done": True}
            assert not any("error" in e for e in events), events
            return events[0]["prompt_token_ids"], sse_token_ids(events), events[-2]
        data = await resp.json()
        return data["prompt_token_ids"], data["choices"][0]["token_ids"], data


async def grpc_call(
    env: RouterEnv,
    execution_id: str,
    token: str,
    prompt: list[int],
    answer_once: bool = False,
    messages: list[int] | None = None,
) -> tuple[list[int], int, int]:
    call = env.stub.Generate(
        router_pb2.GenerateRequest(
            execution_id=execution_id,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
            answer_once=answer_once,
        ),
        metadata=(("authorization", f"Bearer {token}"),),
        timeout=30,
    )
    out: list[int] = []
    reroutes = 0
    finish = 0
    async for msg in call:
        if messages is not None:
            messages.append(len(msg.chunk.token_ids))
        out.extend(msg.chunk.token_ids)
        reroutes = msg.reroutes
        finish = msg.chunk.finish_reason or finish
    return out, reroutes, finish


async def _turn(env: RouterEnv, execution_id: str, index: int = 0):
    for _ in range(500):
        got = env.packer.turns.get((execution_id, index))
        if got is not None:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"no turn record for {execution_id}/{index}")


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("path", [["a", "b"], ["a", "b", "c", "a"]], ids=["once", "thrice"])
async def test_http_rerouted_call_is_token_identical(env, stream, path):
    # The same request without a move, then with moves along `path`.
    ex0, tok0 = await env.routed("a")
    ex1, tok1 = await env.routed("a")
    await asyncio.sleep(0.3)  # the watch delivers the new routes
    prompt0, plain, _ = await http_call(env, tok0, stream)
    mover = asyncio.create_task(scheduler_moves(env, ex1, tok1, path, every=6))
    prompt1, moved, last = await http_call(env, tok1, stream, execution_id=ex1)
    assert await mover == len(path) - 1
    assert prompt1 == prompt0
    assert moved == plain == reference(1, prompt0, MAX_TOKENS)
    if not stream:
        assert last["gyre"]["reroutes"] == len(path) - 1
        assert last["choices"][0]["finish_reason"] == "length"
    else:
        assert last["choices"][0]["finish_reason"] == "length"
    # Each cell visited served one attempt; every source attempt got an Abort.
    for cell in set(path[:-1]):
        for rid in await _attempts(env, cell, ex1):
            if rid not in env.engines[cell].engine.kinds("finish"):
                assert rid in env.engines[cell].engine.kinds("abort_rpc") or rid in env.engines[
                    cell
                ].engine.kinds("cancelled")
    turn = await _turn(env, ex1)
    assert list(turn.output_token_ids) == moved and list(turn.prompt_token_ids) == prompt1
    assert list(turn.output_policy_versions) == [1] * MAX_TOKENS and len(turn.output_logprobs) == MAX_TOKENS


@pytest.mark.parametrize("answer_once", [False, True], ids=["streamed", "answer_once"])
@pytest.mark.parametrize("path", [["a", "b"], ["b", "c", "a", "b"]], ids=["once", "thrice"])
async def test_grpc_rerouted_call_is_token_identical(env, path, answer_once):
    """Streamed, or answered once (``answer_once``: one message with every token, however
    many engines the call went through; the turn record is the same)."""
    ex, tok = await env.routed(path[0])
    await asyncio.sleep(0.3)
    prompt = [11, 12, 13, 14, 15]
    mover = asyncio.create_task(scheduler_moves(env, ex, tok, path, every=5))
    messages: list[int] = []
    out, reroutes, finish = await grpc_call(env, ex, tok, prompt, answer_once, messages)
    await mover
    assert out == reference(1, prompt, MAX_TOKENS)
    if answer_once:
        assert messages == [MAX_TOKENS]
    else:
        assert len(messages) > 1
    turn = await _turn(env, ex)
    assert list(turn.output_token_ids) == out and list(turn.prompt_token_ids) == prompt
    assert reroutes == len(path) - 1
    assert finish == common_pb2.FINISH_REASON_LENGTH
    # On the stream path every attempt at an engine rode the one stream this router keeps there.
    assert {env.engines[c].engine.streams for c in path} == {1 if env.settings["engine_stream"] else 0}
    status = await env.stub.GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    assert status.reroutes >= reroutes and status.inflight == 0


async def test_grpc_call_moved_thrice_is_token_identical_on_per_request_engine_calls(per_request_env):
    """The engine path of one Generate call per request (each attempt its own call, every
    source attempt aborted): a streamed gRPC call moved three times, as above (no engine
    stream opened)."""
    await test_grpc_rerouted_call_is_token_identical(per_request_env, ["b", "c", "a", "b"], False)


async def test_destination_with_other_policy_version_is_refused(env):
    ex, tok = await env.routed("a")
    await asyncio.sleep(0.3)
    mover = asyncio.create_task(scheduler_moves(env, ex, tok, ["a", "v2"], every=5, check_moved=False))
    headers = {"Authorization": f"Bearer {tok}"}
    body = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{env.url}/chat/completions", json=body, headers=headers) as resp,
    ):
        events = await asyncio.wait_for(read_sse(resp), 20)
    await mover
    assert "error" in events[-2] and events[-2]["error"]["code"] == 503
    assert events[-1] == {"done": True}
    refused = [r for r in env.engines["v2"].engine.requests if r.execution_id == ex]
    assert refused == []  # refused before it started: the engine never ran it
    assert not await _attempts(env, "v2", ex)


async def test_stale_fence_is_refused(env):
    old = await leader_epoch(env.etcd, env.keys)
    new = await new_leader(env.etcd, env.keys)
    await env.stub.MoveExecutions(
        router_pb2.MoveExecutionsRequest(fence=common_pb2.Fence(epoch=new)), timeout=5
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await env.stub.MoveExecutions(
            router_pb2.MoveExecutionsRequest(fence=common_pb2.Fence(epoch=old)), timeout=5
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
