"""Outgoing gRPC: channels with explicit limits, and calls that always carry a deadline.

gRPC sets no deadline by default; every unary call in Gyre goes through :func:`unary` (or
passes ``timeout=`` itself), and failures come back as domain errors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gyre.config import ServiceConfig
from gyre.errors import from_rpc_error
from gyre.grpcx.server import _read, channel_options

R = TypeVar("R")


def open_channel(target: str, config: ServiceConfig) -> grpc.aio.Channel:
    """A channel to ``target`` with the config's size limits, TLS and tracing."""
    interceptors: list[Any] = []
    if config.tracing != "off":
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = list(aio_client_interceptors())
    options = channel_options(config.max_message_bytes)
    if config.tls.ca_file:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(config.tls.ca_file),
            private_key=_read(config.tls.key_file) if config.tls.key_file else None,
            certificate_chain=_read(config.tls.cert_file) if config.tls.cert_file else None,
        )
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


async def unary(
    method: Callable[..., Awaitable[R]],
    request: Any,
    timeout_s: float,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> R:
    """Calls a unary method with a deadline; a failure raises the matching domain error."""
    try:
        return await method(request, timeout=timeout_s, metadata=metadata)
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from err


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Metadata carrying an execution token."""
    return (("authorization", f"Bearer {token}"),)
