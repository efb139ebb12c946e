"""The OpenAI conventions agent harnesses are written against, through the real router
process with the official ``openai`` client: a request with ``tools`` gets ``tool_calls``
back (unary and streamed as deltas), parsed by vLLM's Hermes parser from what the engine
generated (a scripted fake engine: the tiny model cannot be made to emit a tool call); the
conversation continues with the assistant's tool call and a ``tool`` message, and the next
prompt is the previous prompt + exactly the generated tokens + the template's delta (the
engine's prefix cache hits, the packer gets a token-consistent trajectory); a stop string
of several tokens ends the completion at the token that completed it (text cut before it
or, with include_stop_str_in_output, after it), stops the engine request, and the recorded
turn ends at the same token."""

from __future__ import annotations

import asyncio
import json
import secrets

import openai
import pytest
import pytest_asyncio

from gyre.etcd import Etcd, Keys
from services.router.tokenization import Tokenizer
from testkit.fake_engine import FakeEngineServer, FakeOptions
from testkit.fake_packer import FakePacker
from testkit.router_rig import (
    build_tokenizer_dir,
    new_execution,
    put_route,
    start_router,
    write_config,
)
from testkit.tls import tls

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads a file of the workspace",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_tools")
    tok_dir = build_tokenizer_dir(tmp / "tiny")
    cluster = "rt" + secrets.token_hex(4)
    packer = await FakePacker().start(tls("packer"))
    engine = await FakeEngineServer(FakeOptions(cell_id="a", tokens_per_chunk=2)).start()
    cfg = write_config(
        tmp / "cluster.yaml",
        cluster,
        etcd_server.endpoint,
        model_dir=str(tok_dir),
        packer_target=packer.target,
        http_port=0,
        log_json=False,
    )
    proc, url = start_router(cfg, tmp / "router.log")
    etcd = Etcd([etcd_server.endpoint], 5.0)
    await etcd.connect()
    try:
        yield {
            "url": url,
            "etcd": etcd,
            "keys": Keys(cluster),
            "engine": engine,
            "packer": packer,
            "tok": Tokenizer.load(tok_dir),
        }
    finally:
        proc.stop()
        await etcd.close()
        await engine.stop(0)
        await packer.stop()


async def _client(env, *script: list[int], delay_s: float = 0.0) -> tuple[openai.AsyncOpenAI, str]:
    fake = env["engine"].engine
    fake.opts.script = tuple(tuple(s) for s in script)
    fake.opts.token_delay_s = delay_s
    fake.requests.clear()
    ex, token = new_execution()
    await put_route(env["etcd"], env["keys"], ex, "a", env["engine"].target, token)
    await asyncio.sleep(0.3)
    client = openai.AsyncOpenAI(
        base_url=env["url"], api_key=token, default_headers={"x-gyre-execution-id": ex}, max_retries=0
    )
    return client, ex


def _end(env) -> int:
    return env["tok"].stop_token_ids[0]


async def _turns(env, ex: str, n: int) -> list:
    for _ in range(50):
        turns = [t for (x, _), t in sorted(env["packer"].turns.items()) if x == ex]
        if len(turns) >= n:
            return turns
        await asyncio.sleep(0.1)
    raise AssertionError(f"{n} turns of {ex} never reached the packer")


async def test_tool_call_round_trip_with_the_openai_client(env):
    tok = env["tok"]
    out1 = tok.encode(CALL) + [_end(env)]
    out2 = tok.encode("The secret number is 42.") + [_end(env)]
    client, ex = await _client(env, out1, out2)
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Find the secret."},
    ]
    r1 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64)
    choice = r1.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "notes.txt"}
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "The secret number is 42."})
    r2 = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert r2.choices[0].message.content == "The secret number is 42."
    # Token in, token out: the second prompt continues the first call's tokens exactly.
    reqs = env["engine"].engine.requests
    p1, p2 = list(reqs[0].prompt_token_ids), list(reqs[1].prompt_token_ids)
    assert p2[: len(p1) + len(out1)] == p1 + out1
    delta = tok.decode(p2[len(p1) + len(out1) :], skip_special_tokens=False)
    assert delta.startswith("\n<|im_start|>user\n<tool_response>\nThe secret number is 42.\n</tool_response>")
    t0, t1 = await _turns(env, ex, 2)
    assert list(t0.output_token_ids) == out1
    assert (
        list(t1.prompt_token_ids[: len(t0.prompt_token_ids) + len(out1)]) == list(t0.prompt_token_ids) + out1
    )
    await client.close()


async def test_streamed_tool_call_deltas(env):
    client, _ = await _client(env, env["tok"].encode("Let me look. " + CALL) + [_end(env)])
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go"}], tools=TOOLS, max_tokens=64, stream=True
    )
    content, name, args, finish, ids = "", "", "", None, set()
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            assert tc.index == 0
            ids.add(tc.id) if tc.id else None
            name += (tc.function.name or "") if tc.function else ""
            args += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look. " and name == "read_file" and len(ids) == 1
    assert json.loads(args) == {"path": "notes.txt"} and finish == "tool_calls"
    await client.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
async def test_multi_token_stop_string(env, stream, include):
    tok = env["tok"]
    stop = "\nObservation:"
    assert len(tok.encode(stop)) > 1
    script = tok.encode("Thought: read the notes\nObservation: the file says 7 and more text") + [_end(env)]
    client, ex = await _client(env, script, delay_s=0.02)
    kw = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 64,
        "stop": [stop],
        "extra_body": {"include_stop_str_in_output": include},
    }
    if stream:
        text, finish = "", None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        r = await client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == "Thought: read the notes" + (stop if include else "") and finish == "stop"
    (turn,) = await _turns(env, ex, 1)
    out = list(turn.output_token_ids)
    assert (
        out == script[: len(out)]
        and tok.decode(out).endswith(stop)
        and not tok.decode(out[:-1]).endswith(stop)
    )
    fake = env["engine"].engine
    rid = fake.requests[0].request_id
    for _ in range(50):  # the engine request was stopped, not run to its end
        if rid not in fake.running:
            break
        await asyncio.sleep(0.05)
    assert rid not in fake.running and fake.progress[rid] < len(script)
    await client.close()


async def test_required_tool_choice_is_refused(env):
    client, _ = await _client(env, [5])
    with pytest.raises(openai.BadRequestError, match="guided decoding"):
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            tools=TOOLS,
            tool_choice="required",
            max_tokens=4,
        )
    await client.close()
