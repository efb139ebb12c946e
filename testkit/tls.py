"""Test-side TLS: identities from the session's CA (see conftest), channels that present
them, and servers that require them, so tests talk to services the way services talk to
each other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Self

import grpc

from gyre import certs
from gyre.etcd import Etcd
from gyre.etcd.access import provision
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles
from gyre.identity import Identity, Role

if TYPE_CHECKING:
    from services.cell_agent.engines.kv_transport import KvTls

PKI = Path(os.environ["GYRE_TEST_PKI"])


def identity(name: str, role: Role | None = None) -> Identity:
    """``name`` of ``role`` (default: the role named ``name``; ``root`` an operator,
    ``harness-*`` a harness, anything else a cell agent)."""
    if role is None:
        role = next((r for r in Role if r.value == name), None)
    if role is None:
        role = (
            Role.OPERATOR
            if name == "root"
            else Role.HARNESS
            if name.startswith("harness")
            else Role.CELL_AGENT
        )
    return Identity(role, name)


def tls(name: str = "operator", role: Role | None = None) -> TlsFiles:
    """The TLS files of an identity, issued on first use."""
    who = identity(name, role)
    certs.ensure(PKI, [who])
    return TlsFiles.from_dir(PKI / who.name)


def kv_tls(name: str, role: Role | None = None) -> KvTls:
    """The TLS files of an identity as the KV transport takes them (a ``KvServer``, a
    ``read``)."""
    from services.cell_agent.engines.kv_transport import KvTls  # torch: only where KV is moved

    files = tls(name, role)
    return KvTls(files.cert_file, files.key_file, files.ca_file)


def channel(
    target: str, name: str = "operator", role: Role | None = None, expect: Role | str | None = None
) -> grpc.aio.Channel:
    """A channel to ``target`` as identity ``name``."""
    return dial(target, tls(name, role), expect)


def add_port(server: grpc.aio.Server, address: str, name: str, role: Role | None = None) -> int:
    """A port on a hand-built test server that requires client certificates, presenting
    identity ``name`` (a fake packer presents ``packer``)."""
    return server.add_secure_port(address, tls(name, role).server_credentials())


async def provision_etcd(endpoint: str, cluster: str, *names: str) -> None:
    """Users and roles for ``names`` (role inferred as in :func:`identity`) in ``cluster``."""
    async with Etcd([endpoint], tls=tls("root")) as etcd:
        await provision(etcd, cluster, [identity(n) for n in names])


def etcd_client(endpoint: str, name: str = "root", role: Role | None = None) -> Etcd:
    """An etcd client as identity ``name`` (root: every key)."""
    return Etcd([endpoint], tls=tls(name, role))


_PREFERENCE = (
    Role.OPERATOR,
    Role.SCHEDULER,
    Role.ROUTER,
    Role.CELL_AGENT,
    Role.HARNESS,
    Role.DASHBOARD,
    Role.PACKER,
)


class RoleStubs:
    """A stub whose every call goes out as an identity the service's ACCESS table admits
    for that method: the first of operator, scheduler, router, cell agent, harness (or
    ``prefer``), and for ``own`` rules the cell the request names. Tests call services
    the way their real callers do, with one object::

        async with RoleStubs(target, PackerStub, PackerServicer.ACCESS) as stub:
            await stub.RecordTurn(turn)                  # as the router
            await stub.ClaimMicroSteps(claim)            # as the cell claim.cell_id names
    """

    def __init__(
        self,
        target: str,
        stub_cls: type,
        table: object,
        prefer: Role | None = None,
        expect: Role | str | None = None,
    ) -> None:
        self._target = target
        self._stub_cls = stub_cls
        self._table = table
        self._prefer = prefer
        self._expect = expect
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, object] = {}

    def identity_for(self, method: str, request: object) -> Identity:
        rule = self._table.rules[method]  # type: ignore[attr-defined]
        if rule.own:
            return Identity(Role.CELL_AGENT, getattr(request, rule.own) or "cell-0")
        order = ((self._prefer,) if self._prefer else ()) + _PREFERENCE
        role = next(r for r in order if r in rule.roles)
        return Identity(role, role.value)

    def as_(self, name: str, role: Role | None = None) -> object:
        """The raw stub of one identity."""
        if name not in self._stubs:
            ch = self._channels[name] = channel(self._target, name, role, self._expect)
            self._stubs[name] = self._stub_cls(ch)
        return self._stubs[name]

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        def call(request: object, *args: object, **kwargs: object):
            who = self.identity_for(method, request)
            return getattr(self.as_(who.name, who.role), method)(request, *args, **kwargs)

        return call

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
