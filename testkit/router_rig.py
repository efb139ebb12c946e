"""Helpers for the router's integration and fault tests: a tokenizer directory, a router
process, route writes as the scheduler would make them, SSE parsing (the packer it
records turns with: :class:`testkit.fake_packer.FakePacker`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.etcd.values import Route, token_sha256


def build_tokenizer_dir(path: Path) -> Path:
    """The tiny model's tokenizer (with its ChatML template) only: no weights needed."""
    from apps.model.tiny import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    return path


def write_config(path: Path, cluster: str, etcd_endpoint: str, **router: Any) -> Path:
    path.write_text(
        yaml.safe_dump({"cluster": {"name": cluster, "etcd_endpoints": [etcd_endpoint]}, "router": router})
    )
    return path


def start_router(config: Path, log: Path, **overrides: Any) -> tuple[ServiceProcess, str]:
    """Starts ``python -m services.router``; returns the process and its HTTP base URL."""
    proc = ServiceProcess("router", config, overrides=overrides, log_path=log).start(timeout_s=90)
    url = ""
    for line in proc.stdout_lines:
        if line.startswith("{") and "router_http" in line:
            url = json.loads(line)["router_http"]
    assert url, proc.stdout_lines
    return proc, url


def new_execution() -> tuple[str, str]:
    n = random.randrange(1 << 40)
    return f"ex-{n:x}", f"tok-{n:x}-{random.randrange(1 << 40):x}"


async def put_route(
    etcd: Etcd,
    keys: Keys,
    execution_id: str,
    cell_id: str,
    target: str,
    token: str,
    policy_version: int = 1,
    group_id: str = "g1",
) -> int:
    """Writes the route as the scheduler does; returns the route epoch (the key's version)."""
    route = Route(execution_id, cell_id, target, token_sha256(token), group_id, 1, policy_version)
    await etcd.put(keys.route(execution_id), route.to_json())
    kv = await etcd.get(keys.route(execution_id))
    assert kv is not None
    return kv.version


async def read_sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """All SSE data events of a response (``[DONE]`` as {"done": True})."""
    events: list[dict[str, Any]] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


def sse_token_ids(events: list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for ev in events:
        for choice in ev.get("choices", []):
            out.extend(choice.get("token_ids", []))
    return out
