"""The container healthcheck (``python -m gyre.grpcx.healthcheck``, used by every gRPC
service's healthcheck in docker-compose.yml) against a real Gyre gRPC server on loopback.

Invariant: exit 0 only when the server reports SERVING for the asked service; NOT_SERVING
(draining), an unknown service, a dead server and bad arguments all exit non-zero, within
the deadline (a check never hangs).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from gyre.config import ServiceConfig
from gyre.grpcx.server import GrpcServer
from gyre.v1 import scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "gyre.v1.SchedulerControl"

pytestmark = pytest.mark.timeout(120)


async def probe(*args: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gyre.grpcx.healthcheck", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(proc.wait(), 60)


async def test_healthcheck_follows_serving_status() -> None:
    cfg = ServiceConfig(port=0, grace_s=0)
    server = GrpcServer(cfg, [(scheduler_pb2_grpc.SchedulerControlServicer(),
                               scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, SERVICE)])
    port = await server.start()
    target = f"127.0.0.1:{port}"
    try:
        assert await probe(target) == 0
        assert await probe(target, "--service", SERVICE) == 0
        assert await probe(target, "--service", "gyre.v1.NoSuchService") == 1
        await server.set_serving(False)  # draining
        assert await probe(target) == 1
        assert await probe(target, "--service", SERVICE) == 1
        await server.set_serving(True)
        assert await probe(target) == 0
    finally:
        await server.stop(0)
    started = time.monotonic()
    assert await probe(target, "--timeout-s", "1") == 1  # nothing listens any more
    assert time.monotonic() - started < 30  # bounded by the deadline, not hanging
    assert await probe(target, "--timeout-s", "0") == 2  # bad arguments
