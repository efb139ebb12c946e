"""The router's harness-facing edge, against the real process: a harness that disconnects
gets its engine request aborted within 500 ms and the engine slot returns (HTTP and gRPC);
an unknown token is 401 / UNAUTHENTICATED, another execution's token 403 /
PERMISSION_DENIED, an oversized body 413, malformed JSON or fields 400 / INVALID_ARGUMENT,
and none of them reaches an engine, records a turn or disturbs the next good request (also:
a prompt past the model's context, a lone surrogate, a 100k-deep body, a seed or stop id
beyond int64, a message that does not parse on gRPC);
/v1/models and /v1/completions answer like OpenAI's."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
import pytest_asyncio

from gyre.v1 import common_pb2, router_pb2
from testkit.fake_engine import FakeEngineServer, FakeOptions, reference
from testkit.router_env import RouterEnv
from testkit.router_rig import read_sse, sse_token_ids

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_BODY = 64 * 1024
CONTEXT = 3000  # router.max_model_len
TURN = 2500  # router.max_turn_tokens (the packer's budget)


class Env(RouterEnv):
    """The router, its one engine (cell a) and two executions routed there."""

    ex1: str
    tok1: str
    ex2: str
    tok2: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    async with Env(
        etcd_server.endpoint,
        tmp_path_factory.mktemp("router_http"),
        "rh",
        model="tiny",
        engines=[FakeOptions(cell_id="a", token_delay_s=0.01)],
        max_body_bytes=MAX_BODY,
        max_tokens_limit=4096,
        max_model_len=CONTEXT,
        max_turn_tokens=TURN,
        unknown_token_wait_s=1.0,  # well inside the bad-input cases' 5 s client deadline
    ) as e:
        e.ex1, e.tok1 = await e.routed("a")
        e.ex2, e.tok2 = await e.routed("a")
        await asyncio.sleep(0.3)
        yield e


def chat_body(**kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}


async def _wait_engine_idle(engine: FakeEngineServer, timeout_s: float) -> bool:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if not engine.engine.running:
            return True
        await asyncio.sleep(0.005)
    return not engine.engine.running


async def _snapshot(env: Env) -> tuple[int, int, int]:
    status = await env.stub.GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    return len(env.engine.engine.requests), len(env.packer.turns), status.inflight


async def _settle(env: Env, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """Waits until earlier calls are done and their turn records (sent in the background)
    reached the packer: nothing in flight and the counts still for 0.2 s. Returns them."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    last = await _snapshot(env)
    while True:
        await asyncio.sleep(0.2)
        now = await _snapshot(env)
        if now == last and now[2] == 0:
            return now
        assert asyncio.get_running_loop().time() < deadline, f"router never settled: {now}"
        last = now


async def test_models_and_completions(env):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{env.url}/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        h = {"Authorization": f"Bearer {env.tok1}"}
        body = {"prompt": [20, 21, 22], "max_tokens": 6, "return_token_ids": True, "logprobs": True}
        async with s.post(f"{env.url}/completions", json=body, headers=h) as r:
            data = await r.json()
            assert r.status == 200, data
            assert data["object"] == "text_completion"
            assert data["choices"][0]["token_ids"] == reference(1, [20, 21, 22], 6)
            assert len(data["choices"][0]["logprobs"]["content"]) == 6
            assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
            assert isinstance(data["choices"][0]["text"], str)
        async with s.post(
            f"{env.url}/completions", json={**body, "stream": True, "prompt": "hello world"}, headers=h
        ) as r:
            events = await read_sse(r)
            assert events[-1] == {"done": True}
            assert len(sse_token_ids(events)) == 6
            assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_http_disconnect_aborts_engine_request_within_500ms(env):
    before = len(env.engine.engine.requests)
    session = aiohttp.ClientSession()
    resp = await session.post(
        f"{env.url}/chat/completions",
        json=chat_body(max_tokens=2000, stream=True),
        headers={"Authorization": f"Bearer {env.tok1}"},
    )
    assert resp.status == 200
    got = 0
    async for raw in resp.content:
        if raw.startswith(b"data: ") and b"token" not in raw:
            got += 1
        if got >= 4:
            break
    assert env.engine.engine.running
    rid = env.engine.engine.requests[before].request_id
    t0 = time.monotonic()
    resp.close()  # the harness goes away mid-stream
    await session.close()
    assert await _wait_engine_idle(env.engine, 2.0)
    ended = [
        t for k, r, t in env.engine.engine.events if r == rid and k in ("cancelled", "abort_rpc", "aborted")
    ]
    assert ended and min(ended) - t0 < 0.5, ended
    status = await env.stub.GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    assert status.inflight == 0
    load = env.engine.engine  # the slot is free again
    assert len(load.running) == 0


async def test_grpc_cancel_aborts_engine_request_within_500ms(env):
    before = len(env.engine.engine.requests)
    call = env.stub.Generate(
        router_pb2.GenerateRequest(
            execution_id=env.ex1, prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(max_tokens=2000)
        ),
        metadata=(("authorization", f"Bearer {env.tok1}"),),
        timeout=30,
    )
    n = 0
    async for _ in call:
        n += 1
        if n >= 3:
            break
    rid = env.engine.engine.requests[before].request_id
    t0 = time.monotonic()
    call.cancel()
    assert await _wait_engine_idle(env.engine, 2.0)
    ended = [
        t for k, r, t in env.engine.engine.events if r == rid and k in ("cancelled", "abort_rpc", "aborted")
    ]
    assert ended and min(ended) - t0 < 0.5


async def test_grpc_deadline_propagates_to_engine(env):
    before = len(env.engine.engine.requests)
    call = env.stub.Generate(
        router_pb2.GenerateRequest(
            execution_id=env.ex1, prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(max_tokens=2000)
        ),
        metadata=(("authorization", f"Bearer {env.tok1}"),),
        timeout=0.3,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await _wait_engine_idle(env.engine, 2.0)
    rid = env.engine.engine.requests[before].request_id
    assert rid not in env.engine.engine.kinds("finish")


@pytest.mark.parametrize(
    "case",
    [
        "no_token",
        "unknown_token",
        "foreign_token",
        "oversized",
        "malformed_json",
        "not_object",
        "bad_max_tokens",
        "too_many_tokens",
        "empty_messages",
        "bad_role",
        "wrong_model",
        "prompt_over_context",
        "prompt_fills_a_turn",
        "lone_surrogate",
        "lone_surrogate_key",
        "deep_json",
        "huge_seed",
        "huge_stop_id",
        "huge_max_tokens",
        "bad_idempotency_key",
        "long_idempotency_key",
    ],
)
async def test_bad_http_input_gets_precise_status_and_changes_nothing(env, case):
    before = await _settle(env)  # each case starts from a settled router, whatever ran before
    headers = {"Authorization": f"Bearer {env.tok1}", "Content-Type": "application/json"}
    data: bytes | None = None
    body = chat_body()
    expected = 400
    if case == "no_token":
        headers.pop("Authorization")
        expected = 401
    elif case == "unknown_token":
        headers["Authorization"] = "Bearer nobody"
        expected = 401
    elif case == "foreign_token":
        headers["Authorization"] = f"Bearer {env.tok2}"
        headers["x-gyre-execution-id"] = env.ex1
        expected = 403
    elif case == "oversized":
        body = chat_body(messages=[{"role": "user", "content": "x" * (MAX_BODY * 2)}])
        expected = 413
    elif case == "malformed_json":
        data = b'{"messages": [ {"role": "user", "content": "hi"'
    elif case == "not_object":
        data = b"[1, 2, 3]"
    elif case == "bad_max_tokens":
        body = chat_body(max_tokens="many")
    elif case == "too_many_tokens":
        body = chat_body(max_tokens=10**6)
    elif case == "empty_messages":
        body = chat_body(messages=[])
    elif case == "bad_role":
        body = chat_body(messages=[{"role": "wizard", "content": "hi"}])
    elif case == "wrong_model":
        body = chat_body(model="gpt-9")
        expected = 404
    elif case == "prompt_over_context":
        body = {"prompt": [7] * CONTEXT, "max_tokens": 4}
    elif case == "prompt_fills_a_turn":
        body = {"prompt": [7] * TURN, "max_tokens": 4}
    elif case == "lone_surrogate":
        data = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 4}'
    elif case == "lone_surrogate_key":
        data = b'{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}'
    elif case == "deep_json":
        data = b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # 100k deep: test_router_bad_input
    elif case == "huge_seed":
        body = chat_body(seed=2**64)
    elif case == "huge_stop_id":
        body = chat_body(stop_token_ids=[2**63])
    elif case == "huge_max_tokens":
        body = chat_body(max_tokens=10**40)
    elif case == "bad_idempotency_key":
        headers["Idempotency-Key"] = "two words"
    elif case == "long_idempotency_key":
        headers["Idempotency-Key"] = "k" * 129
    import json as _json

    payload = data if data is not None else _json.dumps(body).encode()
    path = "completions" if "prompt" in body and data is None else "chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{env.url}/{path}", data=payload, headers=headers) as r:
            assert r.status == expected, await r.text()
            err = await r.json()
            assert err["error"]["code"] == expected and err["error"]["message"]
        # Nothing changed, and the router still serves everyone else.
        assert await _snapshot(env) == before
        async with s.post(
            f"{env.url}/chat/completions",
            json=chat_body(return_token_ids=True),
            headers={"Authorization": f"Bearer {env.tok2}"},
        ) as r:
            assert r.status == 200
            assert len((await r.json())["choices"][0]["token_ids"]) == 8
        # ... and its turn reaches the packer (so the next case starts from a settled state).
        for _ in range(200):
            if len(env.packer.turns) == before[1] + 1:
                break
            await asyncio.sleep(0.01)
        assert len(env.packer.turns) == before[1] + 1


@pytest.mark.parametrize(
    "case,code",
    [
        ("no_token", grpc.StatusCode.UNAUTHENTICATED),
        ("unknown_token", grpc.StatusCode.UNAUTHENTICATED),
        ("unknown_execution", grpc.StatusCode.UNAUTHENTICATED),
        ("foreign_token", grpc.StatusCode.PERMISSION_DENIED),
        ("empty_prompt", grpc.StatusCode.INVALID_ARGUMENT),
        ("token_out_of_vocab", grpc.StatusCode.INVALID_ARGUMENT),
        ("zero_max_tokens", grpc.StatusCode.INVALID_ARGUMENT),
        ("prompt_over_context", grpc.StatusCode.INVALID_ARGUMENT),
        ("huge_stop_id", grpc.StatusCode.INVALID_ARGUMENT),
        ("bad_idempotency_key", grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_grpc_input_gets_precise_status_and_changes_nothing(env, case, code):
    before = await _snapshot(env)
    req = router_pb2.GenerateRequest(
        execution_id=env.ex1, prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(max_tokens=4)
    )
    md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {env.tok1}"),)
    if case == "no_token":
        md = ()
    elif case == "unknown_token":
        md = (("authorization", "Bearer nobody"),)
    elif case == "unknown_execution":
        req.execution_id = "ex-nope"
    elif case == "foreign_token":
        md = (("authorization", f"Bearer {env.tok2}"),)
    elif case == "empty_prompt":
        del req.prompt_token_ids[:]
    elif case == "token_out_of_vocab":
        req.prompt_token_ids.append(10**6)
    elif case == "zero_max_tokens":
        req.sampling.max_tokens = 0
    elif case == "prompt_over_context":
        req.prompt_token_ids.extend([7] * CONTEXT)
    elif case == "huge_stop_id":
        req.sampling.stop_token_ids.append(-5)  # int32 on the wire: a negative id is the overflow
    elif case == "bad_idempotency_key":
        req.idempotency_key = "k\n"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in env.stub.Generate(req, metadata=md, timeout=5):
            pass
    assert err.value.code() == code
    assert await _snapshot(env) == before


async def test_the_idempotency_key_reaches_the_turn_record(env):
    """The call's key (HTTP ``Idempotency-Key``, gRPC ``idempotency_key``) travels with its
    turn to the packer, which keeps one turn per key (tests/unit/test_packer_call_keys.py)."""
    await _settle(env)
    known = set(env.packer.turns)
    h = {"Authorization": f"Bearer {env.tok1}", "Idempotency-Key": "harness-call-7"}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{env.url}/chat/completions", json=chat_body(), headers=h) as r:
            assert r.status == 200, await r.text()
    req = router_pb2.GenerateRequest(
        execution_id=env.ex1,
        prompt_token_ids=[5, 6],
        sampling=common_pb2.SamplingParams(max_tokens=4),
        idempotency_key="grpc-call-8",
    )
    async for _ in env.stub.Generate(req, metadata=(("authorization", f"Bearer {env.tok1}"),), timeout=5):
        pass
    await _settle(env)
    keys = sorted(t.idempotency_key for k, t in env.packer.turns.items() if k not in known)
    assert keys == ["grpc-call-8", "harness-call-7"]


async def test_route_written_just_before_the_call_is_honoured(env):
    """Read-your-writes: the scheduler writes a route and returns the execution; the harness
    may call before the router's watch delivers it. The router reads etcd before a 401."""
    for _ in range(5):
        ex, tok = await env.routed("a")
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{env.url}/chat/completions",
                json=chat_body(max_tokens=2),
                headers={"Authorization": f"Bearer {tok}"},
            ) as r,
        ):
            assert r.status == 200, await r.text()
        ex, tok = await env.routed("a")
        req = router_pb2.GenerateRequest(
            execution_id=ex, prompt_token_ids=[5], sampling=common_pb2.SamplingParams(max_tokens=2)
        )
        got = [
            m
            async for m in env.stub.Generate(req, metadata=(("authorization", f"Bearer {tok}"),), timeout=10)
        ]
        assert sum(len(m.chunk.token_ids) for m in got) == 2


@pytest.mark.parametrize("field", [b"\x0a\x02\xff\xfe", b"\x0a\x04ex-1\x1a\x03\x08\xff"])
async def test_a_message_that_does_not_parse_is_invalid_argument(env, field):
    """Invalid UTF-8 in a string field, or a truncated sub-message: protobuf cannot parse the
    request; gRPC's own answer would be INTERNAL, ours is INVALID_ARGUMENT and changes nothing."""
    before = await _snapshot(env)
    assert await _raw_generate(env, field) == grpc.StatusCode.INVALID_ARGUMENT
    assert await _snapshot(env) == before


async def _raw_generate(env: Env, payload: bytes) -> grpc.StatusCode:
    from testkit.tls import channel as tls_channel

    async with tls_channel(env.proc.target, "harness-1") as ch:
        call = ch.unary_stream(
            "/gyre.v1.Router/Generate", request_serializer=None, response_deserializer=None
        )(payload, metadata=(("authorization", f"Bearer {env.tok1}"),), timeout=5)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK
