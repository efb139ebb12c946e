"""A grpc.aio server with what operators expect from every Gyre service.

Health checking (``grpc.health.v1``, what Kubernetes probes use), server reflection,
explicit message-size limits, OpenTelemetry instrumentation when tracing is on, and a
graceful stop: stop intake, let calls drain for a grace period, then cancel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gyre.config import ServiceConfig

log = logging.getLogger(__name__)

Registrar = Callable[[Any, grpc.aio.Server], None]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Client-side options: explicit size limits, keepalive pings on idle connections."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Server-side options: the same limits, and a ping policy that accepts the clients'
    keepalive (a server's default of one ping per 5 minutes answers a 20 s keepalive with
    GOAWAY "too_many_pings", which breaks long-lived streams)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


class GrpcServer:
    """Owns one grpc.aio server: the given servicers plus health and reflection.

    ``services`` pairs each servicer with its generated ``add_*_to_server`` function and
    its full service name (for reflection and health).
    """

    def __init__(
        self,
        config: ServiceConfig,
        services: Sequence[tuple[Any, Registrar, str]],
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self._config = config
        self._services = list(services)
        self._interceptors = list(interceptors)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else None
        self.port = 0

    @property
    def health(self) -> Any:
        return self._health

    async def start(self) -> int:
        """Binds and starts; returns the bound port."""
        cfg = self._config
        server = grpc.aio.server(
            interceptors=self._interceptors + _tracing_interceptors(cfg),
            options=server_options(cfg.max_message_bytes),
        )
        names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
        for servicer, register, name in self._services:
            register(servicer, server)
            names.append(name)
        if self._health is None:  # pragma: no cover - older grpcio-health-checking
            raise RuntimeError("grpcio-health-checking without aio support")
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(names, server)
        address = f"{cfg.host}:{cfg.port}"
        if cfg.tls.cert_file:
            creds = grpc.ssl_server_credentials(
                [(_read(cfg.tls.key_file), _read(cfg.tls.cert_file))],
                root_certificates=_read(cfg.tls.ca_file) if cfg.tls.ca_file else None,
                require_client_auth=bool(cfg.tls.ca_file),
            )
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {address}")
        await server.start()
        self._server = server
        await self.set_serving(True)
        log.info("grpc server listening", extra={"address": f"{cfg.host}:{self.port}"})
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Flips every service's health status (NOT_SERVING while draining)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set("", status)
        for _, _, name in self._services:
            await self._health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops intake, lets in-flight calls finish for ``grace_s``, then cancels them."""
        if self._server is None:
            return
        await self.set_serving(False)
        await self._server.stop(self._config.grace_s if grace_s is None else grace_s)
        self._server = None

    async def wait(self) -> None:
        """Returns when the server has terminated."""
        if self._server is not None:
            await self._server.wait_for_termination()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _tracing_interceptors(cfg: ServiceConfig) -> list[grpc.aio.ServerInterceptor]:
    if cfg.tracing == "off":
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]
