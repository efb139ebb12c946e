"""Many model calls of one harness process on one ``Router.GenerateStream`` (a real router
process, mutual TLS, the deterministic fake engine, a recording packer):

- concurrent calls of many executions on one stream are each answered once with exactly
  the tokens ``Generate`` gives the same call, and each turn is recorded once;
- a call the router refuses (another execution's token, a bad prompt) gets Generate's
  status in its answer and the calls beside it on the stream complete;
- a cancelled call's engine request ends, and the stream serves the next call;
- a call beyond ``max_stream_calls`` in flight is RESOURCE_EXHAUSTED;
- a streamed call comes in parts with the same tokens, and one given up early is cancelled;
- a tag reused while its call is in flight ends the stream with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from gyre.client import HarnessClient
from gyre.client.router_stream import RouterStream
from gyre.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from gyre.identity import Role
from gyre.v1 import common_pb2, router_pb2, router_pb2_grpc
from testkit.fake_engine import FakeOptions, reference
from testkit.router_env import RouterEnv
from testkit.tls import PKI, channel, tls

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = [40, 41, 42, 43]
TOKENS = 24
MAX_CALLS = 40


class Env(RouterEnv):
    """The router, its one engine (cell a) and a harness's channel to the router."""

    channel: grpc.aio.Channel


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    async with Env(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("call_stream"),
        "cs",
        engines=[FakeOptions(cell_id="a", token_delay_s=0.005, step_clock=True)],
        max_stream_calls=MAX_CALLS,
    ) as e:
        e.channel = channel(e.proc.target, "harness-mux", Role.HARNESS, Role.ROUTER)
        e.defer(e.channel.close)
        yield e


async def _executions(env: Env, n: int) -> list[tuple[str, str]]:
    out = [await env.routed("a") for _ in range(n)]
    await asyncio.sleep(0.3)  # the router's watch
    return out


def _request(ex: str, prompt: list[int] = PROMPT, max_tokens: int = TOKENS) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        execution_id=ex, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
    )


def _tokens(responses: list[router_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.chunk.token_ids]


async def test_calls_of_many_executions_share_one_stream(env):
    execs = await _executions(env, 32)
    stream = RouterStream(env.channel)
    try:
        answers = await asyncio.gather(*(stream.generate(token, _request(ex)) for ex, token in execs))
        # Generate, answered once, gives the same call's tokens (a second call of each).
        stub = router_pb2_grpc.RouterStub(env.channel)
        ex, token = execs[0]
        request = _request(ex)
        request.answer_once = True
        unary = [
            r
            async for r in stub.Generate(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=30
            )
        ]
    finally:
        await stream.close()
    want = reference(1, PROMPT, TOKENS)
    assert all(_tokens(a) == want for a in answers) and _tokens(unary) == want
    assert all(len(a) == 1 and a[0].chunk.finish_reason for a in answers)  # answered once
    assert stream.streams == 1
    for _ in range(100):
        if all((ex, 0) in env.packer.turns for ex, _ in execs):
            break
        await asyncio.sleep(0.05)
    assert all(list(env.packer.turns[(ex, 0)].output_token_ids) == want for ex, _ in execs)


async def test_a_refused_call_gets_its_status_and_the_others_complete(env):
    (ex1, token1), (ex2, _) = await _executions(env, 2)
    stream = RouterStream(env.channel)
    try:
        ok, stranger, bad, unknown = await asyncio.gather(
            stream.generate(token1, _request(ex1)),
            stream.generate(token1, _request(ex2)),  # another execution's token
            stream.generate(token1, _request(ex1, prompt=[])),
            stream.generate("no-such-token", _request(ex1)),
            return_exceptions=True,
        )
    finally:
        await stream.close()
    assert _tokens(ok) == reference(1, PROMPT, TOKENS)
    assert isinstance(stranger, PermissionDenied), stranger
    assert isinstance(bad, InvalidArgument), bad
    assert isinstance(unknown, Unauthenticated), unknown


async def test_a_cancelled_call_ends_its_engine_request_and_the_stream_goes_on(env):
    (ex, token), (ex2, token2) = await _executions(env, 2)
    stream = RouterStream(env.channel)
    try:
        long = asyncio.create_task(stream.generate(token, _request(ex, max_tokens=2000)))
        fake = env.engine.engine
        for _ in range(400):
            if any(r.execution_id == ex for r in fake.requests) and fake.running:
                break
            await asyncio.sleep(0.01)
        rid = next(r.request_id for r in fake.requests if r.execution_id == ex)
        await asyncio.sleep(0.1)
        long.cancel()
        for _ in range(400):
            if rid not in fake.running:
                break
            await asyncio.sleep(0.01)
        assert rid not in fake.running
        assert fake.progress.get(rid, 0) < 2000
        assert _tokens(await stream.generate(token2, _request(ex2))) == reference(1, PROMPT, TOKENS)
        assert stream.streams == 1
    finally:
        await stream.close()


async def test_calls_beyond_the_limit_are_resource_exhausted(env):
    execs = await _executions(env, MAX_CALLS + 5)
    stream = RouterStream(env.channel)
    try:
        results = await asyncio.gather(
            *(stream.generate(token, _request(ex, max_tokens=200)) for ex, token in execs),
            return_exceptions=True,
        )
    finally:
        await stream.close()
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    done = [r for r in results if isinstance(r, list)]
    assert len(refused) == 5 and len(done) == MAX_CALLS, results


async def test_a_reused_tag_in_flight_ends_the_stream(env):
    ((ex, token),) = await _executions(env, 1)
    stub = router_pb2_grpc.RouterStub(env.channel)
    call = stub.GenerateStream(timeout=30)
    twice = router_pb2.StreamCall(tag=7, token=token, request=_request(ex, max_tokens=500))
    await call.write(router_pb2.GenerateStreamRequest(calls=[twice, twice]))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tag 7" in (err.value.details() or "")


async def test_streamed_calls_come_in_parts_with_generates_tokens(env):
    execs = await _executions(env, 8)
    stream = RouterStream(env.channel)
    want = reference(1, PROMPT, TOKENS)

    async def one(ex: str, token: str) -> list[router_pb2.GenerateResponse]:
        return [r async for r in stream.generate_stream(token, _request(ex))]

    try:
        answers = await asyncio.gather(*(one(ex, token) for ex, token in execs))
        # A streamed call given up early is cancelled at the router: its engine request ends.
        (ex, token), *_ = await _executions(env, 1)
        parts = stream.generate_stream(token, _request(ex, max_tokens=2000))
        first = await anext(parts)
        assert first.chunk.token_ids
        await parts.aclose()
        fake = env.engine.engine
        rid = next(r.request_id for r in fake.requests if r.execution_id == ex)
        for _ in range(400):
            if rid not in fake.running:
                break
            await asyncio.sleep(0.01)
        assert rid not in fake.running and fake.progress.get(rid, 0) < 2000
    finally:
        await stream.close()
    for responses in answers:
        assert _tokens(responses) == want
        assert len(responses) > 1  # as the engine stepped, not once
        assert responses[-1].chunk.finish_reason and not any(r.chunk.finish_reason for r in responses[:-1])
    assert stream.streams == 1


async def test_the_harness_client_keeps_one_stream_per_router(env):
    tls("harness-client", Role.HARNESS)
    ((ex, token),) = await _executions(env, 1)
    async with HarnessClient("127.0.0.1:1", harness_id="h", tls_dir=PKI / "harness-client") as client:
        stream = client.router_stream(env.proc.target)
        assert client.router_stream(env.proc.target) is stream
        assert _tokens(await stream.generate(token, _request(ex))) == reference(1, PROMPT, TOKENS)
    with pytest.raises(RuntimeError, match="closed"):  # closed with the client
        await stream.generate(token, _request(ex))
