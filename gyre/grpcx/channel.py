"""Outgoing gRPC: mTLS channels with explicit limits, and calls that always carry a deadline.

Every channel presents this process's certificate and checks the server's against the
cluster CA and the name the caller means to reach (``expect``, see :mod:`gyre.grpcx.tls`).
gRPC sets no deadline by default; every unary call in Gyre goes through :func:`unary` (or
passes ``timeout=`` itself), and failures come back as domain errors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from gyre.config import ServiceConfig
from gyre.errors import from_rpc_error
from gyre.grpcx.server import channel_options
from gyre.grpcx.tls import TlsFiles, name_override
from gyre.identity import Role

R = TypeVar("R")


def open_channel(target: str, config: ServiceConfig, expect: Role | str | None = None) -> grpc.aio.Channel:
    """A channel to ``target`` with the config's size limits, mTLS (as this process's
    identity, checking that the server is ``expect``) and tracing."""
    interceptors: list[Any] = []
    if config.tracing != "off":
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        interceptors = list(aio_client_interceptors())  # type: ignore[no-untyped-call]  # untyped in opentelemetry
    tls = TlsFiles.resolve(config.tls, config.identity_name())
    return dial(target, tls, expect, channel_options(config.max_message_bytes), interceptors)


def dial(
    target: str,
    tls: TlsFiles,
    expect: Role | str | None = None,
    options: list[tuple[str, Any]] | None = None,
    interceptors: list[Any] | None = None,
) -> grpc.aio.Channel:
    """A channel with ``tls`` (plaintext only when it is ``insecure``); ``expect`` is the
    role or identity name the server's certificate must carry (None: the dialed host)."""
    opts = list(channel_options(16 * 1024 * 1024) if options is None else options)
    if tls.insecure:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    name = expect.value if isinstance(expect, Role) else expect
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(), options=opts + name_override(name), interceptors=interceptors
    )


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
