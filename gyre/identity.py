"""Who a process is: a role and a name, carried by its X.509 certificate.

Every Gyre certificate names its holder in the subject: ``OU=<role>, CN=<name>`` (``O=gyre``).
The role says what the holder may do (each RPC admits a set of roles, see
:mod:`gyre.grpcx.auth`); the name tells holders of one role apart: a cell agent's name is
its cell id (``cell-0``), so a cell can claim micro-steps only for itself, and a harness's
name is what its per-harness limits count against. etcd uses the same name (the
certificate's CN) as the etcd user, so one certificate gives a process both its gRPC
identity and its etcd permissions.

Names are unique across roles: no one but the scheduler may be named ``scheduler``.
"""

from __future__ import annotations

import dataclasses
import enum
import re


class Role(str, enum.Enum):
    """The roles of a Gyre cluster (the certificate's OU)."""

    SCHEDULER = "scheduler"
    ROUTER = "router"
    PACKER = "packer"
    CELL_AGENT = "cell-agent"
    DASHBOARD = "dashboard"
    HARNESS = "harness"
    OPERATOR = "operator"
    ETCD = "etcd"
    """The etcd server's own certificate (serves etcd; calls no Gyre RPC)."""

    @classmethod
    def parse(cls, value: str) -> Role:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(r.value for r in cls)
            raise ValueError(f"unknown role {value!r} (known: {known})") from None


_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class Identity:
    """A certificate holder: ``role`` (what it may do) and ``name`` (who exactly)."""

    role: Role
    name: str

    def __post_init__(self) -> None:
        check_name(self.name, self.role)

    def __str__(self) -> str:
        return self.name if self.name == self.role.value else f"{self.role.value}/{self.name}"


def check_name(name: str, role: Role) -> str:
    """A DNS-label-like name (it also becomes a DNS SAN and an etcd user); a role's name is
    reserved for that role."""
    if not _NAME_RE.match(name):
        raise ValueError(f"bad identity name {name!r}: letters, digits, '.', '_' or '-', 1..63 characters")
    for other in Role:
        if name == other.value and other is not role:
            raise ValueError(f"the name {name!r} is reserved for the {other.value} role")
    return name


# The identity of each service process. A cell agent (and a training-only cell) is named
# after its cell id; every other service after its role.
SERVICE_ROLES: dict[str, Role] = {
    "scheduler": Role.SCHEDULER,
    "router": Role.ROUTER,
    "packer": Role.PACKER,
    "cell_agent": Role.CELL_AGENT,
    "trainer_cell": Role.CELL_AGENT,
    "dashboard": Role.DASHBOARD,
}


def service_identity(service: str, cell_id: str = "") -> Identity:
    """The identity a service process presents (``cell_id`` for cell agents)."""
    role = SERVICE_ROLES.get(service)
    if role is None:
        raise ValueError(f"no identity for service {service!r}")
    if role is Role.CELL_AGENT:
        if not cell_id:
            raise ValueError("a cell agent's identity needs its cell_id")
        return Identity(role, cell_id)
    return Identity(role, role.value)
