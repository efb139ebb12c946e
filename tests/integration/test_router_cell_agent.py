"""Against the real cell agent (mock engine, its own processes) rather than the router's
fake: a stream moved mid-generation from one cell to another, with the KV handoff on, is
token-identical to the same request without a move; the source exported its KV blocks,
the destination imported them, and the source released them after the takeover."""

from __future__ import annotations

import asyncio
import json
import secrets

import aiohttp
import pytest
import pytest_asyncio

from apps.procs import ServiceProcess
from bench.support.router_rig import build_tokenizer_dir, new_execution, put_route, start_router, write_config
from gyre.etcd import Etcd, Keys
from gyre.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.router.servicer import RouterServicer
from tests.leader import leader_epoch
from tests.tls import RoleStubs

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 40


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router_cells")
    tok = build_tokenizer_dir(tmp / "model")
    kv_dir = tmp / "kv"
    kv_dir.mkdir()
    cluster = "rc" + secrets.token_hex(4)
    cfg = write_config(
        tmp / "cluster.yaml",
        cluster,
        etcd_server.endpoint,
        model_dir=str(tok),
        http_port=0,
        log_json=False,
        kv_handoff=True,
        kv_timeout_s=2.0,
        retry_budget=0,
    )
    cells = {}
    for cell in ("ca", "cb"):
        cells[cell] = ServiceProcess(
            "cell_agent",
            cfg,
            name=cell,
            log_path=tmp / f"{cell}.log",
            overrides={
                "cell_id": cell,
                "kind": "standalone",
                "index": -1,
                "engine": "mock",
                "mock.kv_dir": str(kv_dir),
                "policy_version": 1,
                "mock.fixed_decode_step_s": 0.01,
                # The cell agent's start-up can block its loop for seconds on a loaded
                # machine (imports), after its lease was granted: give it room.
                "lease_ttl_s": 20,
            },
        ).start(timeout_s=90)
    router, url = start_router(cfg, tmp / "router.log")
    etcd = Etcd([etcd_server.endpoint], 5.0)
    await etcd.connect()
    channel = RoleStubs(router.target, router_pb2_grpc.RouterStub, RouterServicer.ACCESS)
    try:
        yield {
            "url": url,
            "etcd": etcd,
            "keys": Keys(cluster),
            "cells": cells,
            "kv_dir": kv_dir,
            "stub": channel,
        }
    finally:
        router.stop()
        for p in cells.values():
            p.stop()
        await channel.close()
        await etcd.close()


async def _stream(env, token: str, on_tokens=None) -> list[int]:
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
        s.post(f"{env['url']}/completions", json=body, headers={"Authorization": f"Bearer {token}"}) as r,
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
    ca, cb = env["cells"]["ca"], env["cells"]["cb"]
    ex0, tok0 = new_execution()
    ex1, tok1 = new_execution()
    await put_route(env["etcd"], env["keys"], ex0, "ca", ca.target, tok0)
    await put_route(env["etcd"], env["keys"], ex1, "ca", ca.target, tok1)
    await asyncio.sleep(0.3)
    plain = await _stream(env, tok0)
    assert len(plain) == MAX_TOKENS
    moved = False

    async def move(n: int) -> None:
        nonlocal moved
        if n >= 10 and not moved:
            moved = True
            epoch = await put_route(env["etcd"], env["keys"], ex1, "cb", cb.target, tok1)
            reply = await env["stub"].MoveExecutions(
                router_pb2.MoveExecutionsRequest(
                    fence=common_pb2.Fence(epoch=await leader_epoch(env["etcd"], env["keys"])),
                    moves=[
                        router_pb2.Move(execution_id=ex1, from_cell="ca", to_cell="cb", route_epoch=epoch)
                    ],
                ),
                timeout=10,
            )
            assert reply.moved_requests == 1 and reply.remaining_at_source == 0

    out = await _stream(env, tok1, move)
    assert moved
    assert out == plain
    status = await env["stub"].GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    assert status.reroutes == 1 and status.kv_handoffs == 1 and status.kv_recomputes == 0
    for _ in range(100):  # released after the destination's first token
        if not list(env["kv_dir"].iterdir()):
            break
        await asyncio.sleep(0.02)
    assert not list(env["kv_dir"].iterdir())
