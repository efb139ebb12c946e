"""Stand-in servers on a loopback port, in the process of the test or benchmark that
drives them, served the way a Gyre service serves: with an identity's certificate,
requiring the caller's (or plaintext where the TLS files say ``insecure``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from gyre.grpcx.tls import TlsFiles

Registrar = Callable[[Any, grpc.aio.Server], None]


async def serve_loopback(
    servicers: Sequence[tuple[Any, Registrar]], tls: TlsFiles, port: int = 0
) -> tuple[grpc.aio.Server, str]:
    """Starts a server with ``servicers`` (each with its generated ``add_*_to_server``) on
    ``127.0.0.1:port`` (0: a free port); returns it and its target."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    for servicer, register in servicers:
        register(servicer, server)
    address = f"127.0.0.1:{port}"
    bound = (
        server.add_insecure_port(address)
        if tls.insecure
        else server.add_secure_port(address, tls.server_credentials())
    )
    if bound == 0:
        raise RuntimeError(f"cannot bind {address}")
    await server.start()
    return server, f"127.0.0.1:{bound}"
