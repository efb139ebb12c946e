"""A grpc.aio server with what operators expect from every Gyre service.

Mutual TLS (on by default: a client needs a certificate from the cluster's CA to get past
the handshake), authorization by role (each servicer's ``ACCESS`` table, see
:mod:`gyre.grpcx.auth`), health checking (``grpc.health.v1``; optionally also on a
plaintext health-only port for Kubernetes probes, which cannot do TLS), server reflection,
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
from gyre.grpcx.auth import register_guarded
from gyre.grpcx.tls import INSECURE_WARNING, TlsFiles

log = logging.getLogger(__name__)

Registrar = Callable[[Any, grpc.aio.Server], None]


RECONNECT_MAX_MS = 2000
"""The longest a client channel waits between attempts to reconnect. gRPC's default grows to
120 s: measured here, a channel whose server was down 40 s first answered 6.9 s after the
server came back (1.4 s with this cap), and after longer outages it can be minutes, while
the caller's retries all fail fast with UNAVAILABLE: every service must be back within
seconds of an outage it survived (docs/reliability.md, promise 7)."""


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Client-side options: explicit size limits, keepalive pings on idle connections, and
    reconnection every ``RECONNECT_MAX_MS`` at most while the server is away."""
    return [
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
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
    its full service name (for reflection and health). Every servicer carries an
    ``ACCESS`` table; its handlers are registered wrapped by the table's guard.
    ``identity`` names this process for ``{identity}`` in ``tls.dir`` (default: the
    config's own, see :meth:`ServiceConfig.identity_name`).
    """

    def __init__(
        self,
        config: ServiceConfig,
        services: Sequence[tuple[Any, Registrar, str]],
        interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
        identity: str | None = None,
    ) -> None:
        self._config = config
        self._tls = TlsFiles.resolve(config.tls, config.identity_name() if identity is None else identity)
        self._services = list(services)
        self._interceptors = list(interceptors)
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self.port = 0
        self.health_port = 0

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
        secure = not self._tls.insecure
        for servicer, register, name in self._services:
            registered = register_guarded(server, servicer, register, enforce=secure)
            if registered != name:
                raise ValueError(f"{type(servicer).__name__} serves {registered}, registered as {name}")
            names.append(name)
        if self._health is None:  # pragma: no cover - older grpcio-health-checking
            raise RuntimeError("grpcio-health-checking without aio support")
        # Health and reflection: any caller that passed the mTLS handshake (see gyre.grpcx.auth).
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(names, server)
        address = f"{cfg.host}:{cfg.port}"
        if secure:
            self.port = server.add_secure_port(address, self._tls.server_credentials())
        else:
            log.warning(INSECURE_WARNING)
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind {address}")
        await server.start()
        self._server = server
        if cfg.health_port:
            await self._start_health_port(cfg)
        await self.set_serving(True)
        log.info("grpc server listening", extra={"address": f"{cfg.host}:{self.port}", "mtls": secure})
        return self.port

    async def _start_health_port(self, cfg: ServiceConfig) -> None:
        """grpc.health.v1 alone, in plaintext: what Kubernetes' gRPC probes can reach."""
        server = grpc.aio.server(options=server_options(64 * 1024))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{cfg.host}:{cfg.health_port}"
        self.health_port = server.add_insecure_port(address)
        if self.health_port == 0:
            raise RuntimeError(f"cannot bind {address}")
        await server.start()
        self._health_server = server

    async def set_serving(self, serving: bool) -> None:
        """Flips every service's health status (NOT_SERVING while draining)."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
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
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None

    async def wait(self) -> None:
        """Returns when the server has terminated."""
        if self._server is not None:
            await self._server.wait_for_termination()


def _tracing_interceptors(cfg: ServiceConfig) -> list[grpc.aio.ServerInterceptor]:
    if cfg.tracing == "off":
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]  # type: ignore[no-untyped-call]  # untyped in opentelemetry
