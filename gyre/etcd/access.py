"""etcd users and roles: each Gyre identity may write only the keys it owns.

etcd (3.4) with ``--client-cert-auth`` and auth enabled takes the client certificate's CN
as the user, so the user of a process is its identity name (:mod:`gyre.identity`). Each
user gets one role per cluster, ``<cluster>:<name>``, holding:

* read on the whole cluster (``/gyre/<cluster>/``): services mirror each other's keys;
* read-write on what the identity owns (:func:`grants`): the scheduler its leader key, the
  ledger, the routes and the transitions; a cell only its own registration, its own state
  and the published policy version (the core trainer publishes it); the packer its WAL
  incarnation; every service its own registration under ``services/``.

A write anywhere else is refused by etcd ("permission denied": :class:`PermissionDenied`).
Dashboards, harnesses and operators do not use etcd (operators get read access).

    python -m gyre.etcd.access --endpoint https://127.0.0.1:2379 --tls-dir CERTS/root \\
        --cluster local scheduler router packer dashboard cell-agent/cell-0 cell-agent/cell-1

provisions the users and roles and turns auth on (idempotent), as the root user (a
certificate with CN ``root``, which ``python -m gyre.certs`` issues as an operator).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import logging
import sys
from collections.abc import Iterable, Sequence

import aetcd.rpc

from gyre.etcd.client import Etcd
from gyre.etcd.keys import Keys
from gyre.identity import Identity, Role

log = logging.getLogger(__name__)


class Perm(enum.IntEnum):
    """etcd's authpb.Permission.Type."""

    READ = 0
    WRITE = 1
    READWRITE = 2


@dataclasses.dataclass(frozen=True)
class Grant:
    """One permission: a key (``prefix``: the key and everything under it)."""

    key: bytes
    perm: Perm
    prefix: bool = True


def grants(keys: Keys, identity: Identity) -> list[Grant]:
    """What ``identity`` may do in one cluster's keys (read everything, write its own)."""
    root = keys.root.encode()
    out = [Grant(root, Perm.READ)]
    rw = Perm.READWRITE
    name = identity.name
    if identity.role is Role.SCHEDULER:
        out += [
            Grant(keys.leader(), rw, prefix=False),
            Grant(keys.executions()[: -len(b"exec/")], rw),  # ledger/: bursts and executions
            Grant(keys.routes(), rw),
            Grant(keys.transitions(), rw),
            Grant(keys.services("scheduler"), rw),
        ]
    elif identity.role is Role.ROUTER:
        out += [Grant(keys.services("router"), rw)]
    elif identity.role is Role.PACKER:
        out += [Grant(f"{keys.root}packer/".encode(), rw), Grant(keys.services("packer"), rw)]
    elif identity.role is Role.CELL_AGENT:
        out += [
            Grant(keys.cell(name), rw, prefix=False),
            Grant(keys.cell_state(name), rw, prefix=False),
            Grant(keys.service("cell_agent", name), rw, prefix=False),
            Grant(keys.service("trainer_cell", name), rw, prefix=False),
            Grant(keys.policy(), rw, prefix=False),
        ]
    elif identity.role in (Role.DASHBOARD, Role.HARNESS, Role.OPERATOR, Role.ETCD):
        pass  # read only (or no etcd at all)
    return out


def _range_end(key: bytes) -> bytes:
    """The end of the prefix range of ``key`` (etcd's "prefix" convention)."""
    end = bytearray(key)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


async def _ignore_exists(call: object) -> None:
    try:
        await call  # type: ignore[misc]
    except aetcd.rpc.AioRpcError as exc:
        if "already exists" not in (exc.details() or ""):
            raise


async def provision(
    etcd: Etcd, cluster: str, identities: Iterable[Identity], timeout_s: float = 10.0
) -> None:
    """Creates a user per identity and its role in ``cluster``, then enables auth.

    ``etcd`` must be connected as root (CN ``root``) or to an etcd without auth yet.
    Idempotent: existing users and roles are kept and their grants (re)applied."""
    stub = aetcd.rpc.AuthStub(etcd.client.channel)
    keys = Keys(cluster)
    kw = {"timeout": timeout_s}
    users = {"root": None} | {i.name: i for i in identities}
    for name in users:
        await _ignore_exists(
            stub.UserAdd(
                aetcd.rpc.AuthUserAddRequest(name=name, options=aetcd.rpc.UserAddOptions(no_password=True)),
                **kw,
            )
        )
    await _ignore_exists(stub.RoleAdd(aetcd.rpc.AuthRoleAddRequest(name="root"), **kw))
    await stub.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root"), **kw)
    for name, identity in users.items():
        if identity is None:
            continue
        role = f"{cluster}:{name}"
        await _ignore_exists(stub.RoleAdd(aetcd.rpc.AuthRoleAddRequest(name=role), **kw))
        for g in grants(keys, identity):
            perm = aetcd.rpc.Permission(
                permType=int(g.perm), key=g.key, range_end=_range_end(g.key) if g.prefix else b""
            )
            await stub.RoleGrantPermission(
                aetcd.rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm), **kw
            )
        await stub.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user=name, role=role), **kw)
    await stub.AuthEnable(aetcd.rpc.AuthEnableRequest(), **kw)
    log.info("etcd auth provisioned", extra={"cluster": cluster, "users": sorted(users)})


def parse_identity(text: str) -> Identity:
    """``role`` or ``role/name`` (e.g. ``scheduler``, ``cell-agent/cell-0``)."""
    role, _, name = text.partition("/")
    r = Role.parse(role)
    return Identity(r, name or r.value)


def main(argv: Sequence[str] | None = None) -> int:
    from gyre.grpcx.tls import TlsFiles

    parser = argparse.ArgumentParser(prog="python -m gyre.etcd.access", description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="https://host:port of etcd")
    parser.add_argument("--tls-dir", required=True, help="identity directory of the root user (CN root)")
    parser.add_argument("--cluster", required=True, help="cluster name (keys under /gyre/<cluster>/)")
    parser.add_argument("identities", nargs="+", help="role or role/name, e.g. scheduler cell-agent/cell-0")
    args = parser.parse_args(argv)
    identities = [parse_identity(t) for t in args.identities]

    async def run() -> None:
        async with Etcd([args.endpoint], tls=TlsFiles.from_dir(args.tls_dir)) as etcd:
            await provision(etcd, args.cluster, identities)

    asyncio.run(run())
    print(f"etcd auth on; users: {', '.join(i.name for i in identities)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
