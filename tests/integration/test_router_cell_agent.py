"""Against the real cell agent (mock engine, its own processes) rather than the router's
fake: a stream moved mid-generation from one cell to another, with the KV handoff on, is
token-identical to the same request without a move; the source exported its KV blocks,
the destination imported them, and the source released them after the takeover."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio

from gyre.v1 import router_pb2
from testkit.router_cells import RouterCells, router_cells
from testkit.router_rig import build_tokenizer_dir, new_execution

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 40


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_cells")
    kv_dir = tmp / "kv"
    kv_dir.mkdir()
    async with router_cells(
        etcd_server.endpoint,
        tmp,
        ("ca", "cb"),
        model_dir=build_tokenizer_dir(tmp / "model"),
        cell={
            "engine": "mock",
            "mock.kv_dir": str(kv_dir),
            "mock.fixed_decode_step_s": 0.02,
            # The cell agent's start-up can block its loop for seconds on a loaded
            # machine (imports), after its lease was granted: give it room.
            "lease_ttl_s": 20,
        },
        router={"kv_handoff": True, "kv_timeout_s": 2.0, "retry_budget": 0},
        start_timeout_s=90,
    ) as rig:
        yield rig, kv_dir


async def _stream(rig: RouterCells, token: str, on_tokens=None) -> list[int]:
    body = {
        "prompt": [40, 41, 42, 43, 44],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "return_token_ids": True,
        "temperature": 0,
    }
    out: list[int] = []
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{rig.url}/completions", json=body, headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200, await r.text()
        async for raw in r.content:
            if not raw.startswith(b"data: {"):
                continue
            event = json.loads(raw[6:])
            assert "error" not in event, event
            out.extend(event["choices"][0].get("token_ids", []))
            if on_tokens is not None:
                await on_tokens(len(out))
    return out


async def test_move_with_kv_handoff_between_real_cells_is_token_identical(env):
    rig, kv_dir = env
    ex0, tok0 = new_execution()
    await rig.route(ex0, "ca", tok0)
    await asyncio.sleep(0.3)
    plain = await _stream(rig, tok0)
    assert len(plain) == MAX_TOKENS
    moved = 0
    for _ in range(3):  # a call whose last tokens beat the move is not one this test is about
        ex1, tok1 = new_execution()
        await rig.route(ex1, "ca", tok1)
        await asyncio.sleep(0.3)
        asked = False

        async def move(n: int, ex1: str = ex1, tok1: str = tok1) -> None:
            nonlocal moved, asked
            if n >= 10 and not asked:
                asked = True
                moved = await rig.move(ex1, "ca", "cb", tok1, timeout_s=10)

        out = await _stream(rig, tok1, move)
        assert asked and out == plain, (moved, out, plain)
        if moved:
            break
    assert moved == 1
    status = await rig.router.GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    assert status.reroutes == 1 and status.kv_handoffs == 1 and status.kv_recomputes == 0, status
    for _ in range(100):  # released after the destination's first token
        if not list(kv_dir.iterdir()):
            break
        await asyncio.sleep(0.02)
    assert not list(kv_dir.iterdir())
