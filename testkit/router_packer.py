"""Routers in front of a real packer process, with the deterministic fake engine: the
environment, a scripted execution and the calls the router-statelessness tests make (shared
by tests/integration/test_router_stateless.py and test_router_rebuild_cluster.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from apps.procs import ServiceProcess
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.servicer import PackerServicer
from services.router.tokenization import Tokenizer
from testkit.fake_engine import FakeOptions
from testkit.router_env import RouterEnv
from testkit.tls import RoleStubs


def packer_config(tmp: Path, cluster: str, etcd_endpoint: str) -> Path:
    """A packer config in ``tmp`` (WAL in ``tmp/wal``, version from the batches, not etcd)."""
    path = tmp / "packer.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {"name": cluster, "etcd_endpoints": [etcd_endpoint]},
                "packer": {"wal_dir": str(tmp / "wal"), "log_level": "WARNING", "policy_from_etcd": False},
            }
        )
    )
    return path


@contextlib.asynccontextmanager
async def packer_env(
    etcd_endpoint: str, tmp: Path, prefix: str, routers: int = 0
) -> AsyncIterator[dict[str, Any]]:
    """A packer process (:func:`packer_config`) and the fake engine at cell a in a fresh
    cluster (its name: ``prefix`` and random hex digits), with ``routers`` routers on one
    config in front of them (:class:`testkit.router_env.RouterEnv`; more:
    ``env["rig"].add_router``). Yields the environment the helpers here take: ``rig``,
    ``cfg``, ``tmp``, ``routers`` (a test may put a restarted router in its place),
    ``engine``, ``packer`` (a stub of the packer process), ``packer_target``, ``etcd``,
    ``keys`` and ``tok`` (the routers' tokenizer). Everything stops on exit."""
    cluster = prefix + secrets.token_hex(4)
    config = packer_config(tmp, cluster, etcd_endpoint)
    packer = ServiceProcess("packer", config, log_path=tmp / "packer.log").start()
    try:
        async with (
            RouterEnv(
                etcd_endpoint,
                tmp,
                cluster=cluster,
                model="tiny",
                engines=[FakeOptions(cell_id="a")],
                packer=False,
                routers=routers,
                packer_target=packer.target,
            ) as rig,
            RoleStubs(packer.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub,
        ):
            yield {
                "rig": rig,
                "cfg": rig.cfg,
                "tmp": tmp,
                "routers": rig.routers,
                "engine": rig.engine,
                "packer": stub,
                "packer_target": packer.target,
                "etcd": rig.etcd,
                "keys": rig.keys,
                "tok": Tokenizer.load(rig.tok_dir),
            }
    finally:
        packer.stop()


def chars(tok: Tokenizer, text: str) -> list[int]:
    """``text`` one character per token, then the stop token: decoding and re-encoding
    would merge the characters, so a prompt that re-rendered the answer would differ."""
    out = [t for ch in text for t in tok.encode(ch)] + [tok.stop_token_ids[0]]
    assert tok.encode(text) != out[:-1]
    return out


async def scripted_execution(env: dict[str, Any], *answers: str) -> tuple[str, str, list[list[int]]]:
    """A new execution routed to cell a, the fake engine answering its calls with ``answers``."""
    outs = [chars(env["tok"], a) for a in answers]
    fake = env["engine"].engine
    fake.opts.script = tuple(tuple(o) for o in outs)
    fake.requests.clear()
    ex, token = await env["rig"].routed("a")
    await asyncio.sleep(0.3)  # the routers' watches
    return ex, token, outs


async def post_chat(
    env: dict[str, Any], router: int, token: str, messages: list[dict[str, str]], key: str
) -> tuple[int, str]:
    """A chat call at router ``router`` with idempotency key ``key``: (HTTP status, body)."""
    url = env["routers"][router][1]
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    body = {"messages": messages, "max_tokens": 32, "temperature": 0}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.text()


async def chat(env: dict[str, Any], router: int, token: str, messages: list[dict[str, str]], key: str) -> str:
    """The answer's content of a chat call that must succeed."""
    status, text = await post_chat(env, router, token, messages, key)
    assert status == 200, text
    return str(json.loads(text)["choices"][0]["message"]["content"])


def prompts(env: dict[str, Any]) -> list[list[int]]:
    """The prompts the fake engine was sent, in order."""
    return [list(r.prompt_token_ids) for r in env["engine"].engine.requests]


async def where(env: dict[str, Any], ex: str, key: str = "") -> packer_pb2.GetTrajectoryResponse:
    """Where the packer says ``ex`` stands (for the call ``key``, when given)."""
    request = packer_pb2.GetTrajectoryRequest(execution_id=ex, idempotency_key=key)
    return await env["packer"].GetTrajectory(request, timeout=10)
