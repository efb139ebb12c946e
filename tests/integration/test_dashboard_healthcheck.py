"""The container healthcheck (``python -m gyre.grpcx.healthcheck``, used by every gRPC
service's healthcheck in docker-compose.yml) against a real Gyre gRPC server on loopback.

Invariant: exit 0 only when the server reports SERVING for the asked service; NOT_SERVING
(draining), an unknown service, a dead server, a probe without a certificate (every port
requires mTLS) and bad arguments all exit non-zero, within the deadline (a check never
hangs); the plaintext health-only port answers probes that cannot do TLS, and only health.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

from gyre.config import ServiceConfig, TlsConfig
from gyre.grpcx.server import GrpcServer
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.servicer import ControlServicer
from testkit.tls import PKI, tls

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "gyre.v1.SchedulerControl"

pytestmark = pytest.mark.timeout(120)


async def probe(*args: str) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gyre.grpcx.healthcheck",
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(proc.wait(), 60)


class _Control(scheduler_pb2_grpc.SchedulerControlServicer):
    ACCESS = ControlServicer.ACCESS  # unimplemented methods, the real table


async def test_healthcheck_follows_serving_status() -> None:
    tls("operator")
    cfg = ServiceConfig(port=0, grace_s=0, health_port=0, tls=TlsConfig(dir=str(PKI / "scheduler")))
    server = GrpcServer(
        cfg, [(_Control(), scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, SERVICE)]
    )
    port = await server.start()
    target = f"127.0.0.1:{port}"
    me = ("--tls-dir", str(PKI / "operator"))
    try:
        assert await probe(target, *me) == 0
        assert await probe(target, *me, "--service", SERVICE) == 0
        assert await probe(target, *me, "--service", "gyre.v1.NoSuchService") == 1
        assert await probe(target) == 1  # no certificate: refused at the handshake
        await server.set_serving(False)  # draining
        assert await probe(target, *me) == 1
        assert await probe(target, *me, "--service", SERVICE) == 1
        await server.set_serving(True)
        assert await probe(target, *me) == 0
    finally:
        await server.stop(0)
    started = time.monotonic()
    assert await probe(target, *me, "--timeout-s", "1") == 1  # nothing listens any more
    assert time.monotonic() - started < 30  # bounded by the deadline, not hanging
    assert await probe(target, "--timeout-s", "0") == 2  # bad arguments


async def test_the_plaintext_health_port_serves_health_only() -> None:
    from gyre.ports import free_port

    cfg = ServiceConfig(port=0, grace_s=0, health_port=free_port(), tls=TlsConfig(dir=str(PKI / "scheduler")))
    server = GrpcServer(
        cfg, [(_Control(), scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, SERVICE)]
    )
    await server.start()
    target = f"127.0.0.1:{server.health_port}"
    try:
        assert await probe(target) == 0
        assert await probe(target, "--service", SERVICE) == 0
        await server.set_serving(False)
        assert await probe(target) == 1
        import grpc

        async with grpc.aio.insecure_channel(target) as ch:  # nothing but health there
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await scheduler_pb2_grpc.SchedulerControlStub(ch).GetStatus(
                    scheduler_pb2.GetStatusRequest(), timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)
