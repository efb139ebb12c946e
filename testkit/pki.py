"""A benchmark's own CA: the identities a load generator presents and serves with, so
benchmarks measure Gyre as it runs by default (mutual TLS on every gRPC hop)."""

from __future__ import annotations

import os
from pathlib import Path

import grpc

from gyre import certs
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles
from gyre.identity import Identity, Role


class BenchPki:
    """Identities under ``root`` (issued on first use); ``root/{identity}`` is the
    ``tls.dir`` to give the services under test."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        certs.CertificateAuthority(self.root).ensure()

    @property
    def tls_dir(self) -> str:
        return f"{self.root}/{{identity}}"

    def tls(self, name: str, role: Role) -> TlsFiles:
        certs.ensure(self.root, [Identity(role, name)])
        return TlsFiles.from_dir(self.root / name)

    def channel(
        self,
        target: str,
        name: str,
        role: Role,
        expect: Role,
        options: list[tuple[str, object]] | None = None,
    ) -> grpc.aio.Channel:
        return dial(target, self.tls(name, role), expect, options)
