"""Routers in front of a real packer process, with the deterministic fake engine: the
configs, a scripted execution and the calls the router-statelessness tests make (shared by
tests/integration/test_router_stateless.py and test_router_rebuild_cluster.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gyre.v1 import packer_pb2
from services.router.tokenization import Tokenizer
from testkit.router_rig import new_execution, put_route


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


def router_config(tmp: Path, cluster: str, etcd_endpoint: str, tok_dir: Path, packer_target: str) -> Path:
    """A router config in ``tmp``: the tokenizer in ``tok_dir``, the packer at ``packer_target``."""
    path = tmp / "cluster.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {"name": cluster, "etcd_endpoints": [etcd_endpoint]},
                "router": {
                    "model_dir": str(tok_dir),
                    "packer_target": packer_target,
                    "http_port": 0,
                    "log_json": False,
                },
            }
        )
    )
    return path


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
    ex, token = new_execution()
    await put_route(env["etcd"], env["keys"], ex, "a", env["engine"].target, token)
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
