"""A server rereads its certificate files when they change: after its certificate is
replaced in place (cert-manager renewing a Secret, ``python -m gyre.certs issue --force``),
new connections get the new one without a restart. Shown with a move to another CA: a client
that trusts only the new CA is refused before the files change and admitted after."""

from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gyre import certs
from gyre.config import ServiceConfig, TlsConfig
from gyre.grpcx.channel import dial
from gyre.grpcx.server import GrpcServer
from gyre.grpcx.tls import TlsFiles
from gyre.identity import Identity, Role
from gyre.v1 import scheduler_pb2_grpc
from services.scheduler.servicer import ControlServicer

pytestmark = pytest.mark.timeout(60)


class _Control(scheduler_pb2_grpc.SchedulerControlServicer):
    ACCESS = ControlServicer.ACCESS


async def _check(target: str, tls: TlsFiles) -> bool:
    async with dial(target, tls, Role.SCHEDULER) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.aio.AioRpcError:
            return False
    return True


async def test_a_rotated_certificate_takes_effect_without_a_restart(tmp_path):
    who = [Identity(Role.SCHEDULER, "scheduler"), Identity(Role.OPERATOR, "operator")]
    certs.ensure(tmp_path / "old", who)
    certs.ensure(tmp_path / "new", who)
    live = tmp_path / "live"
    shutil.copytree(tmp_path / "old" / "scheduler", live)
    server = GrpcServer(
        ServiceConfig(port=0, grace_s=0, tls=TlsConfig(dir=str(live))),
        [(_Control(), scheduler_pb2_grpc.add_SchedulerControlServicer_to_server, "gyre.v1.SchedulerControl")],
    )
    port = await server.start()
    target = f"127.0.0.1:{port}"
    old_client = TlsFiles.from_dir(tmp_path / "old" / "operator")
    new_client = TlsFiles.from_dir(tmp_path / "new" / "operator")
    try:
        assert await _check(target, old_client)
        assert not await _check(target, new_client)
        for name in ("tls.key", "ca.crt", "tls.crt"):  # as a renewal writes them
            shutil.copy(tmp_path / "new" / "scheduler" / name, live / name)
        assert await _check(target, new_client)
        assert not await _check(target, old_client)
    finally:
        await server.stop(0)
