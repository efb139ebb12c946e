"""The values under the keys of :mod:`gyre.etcd.keys`: one definition each, used by every
service that writes or reads them.

- :class:`CellKind` and :class:`CellState`: a cell's kind (``keys.cell`` JSON) and role
  state (``keys.cell_state`` JSON), with their ``gyre.v1`` proto numbers;
- :class:`CellRecord`: a cell's registration (``keys.cell``);
- :func:`encode_cell_state` / :func:`decode_cell_state`: the ``keys.cell_state`` value;
- :class:`Route`: one execution's route (``keys.route``), parsed with one strictness;
- :func:`token_sha256`: the digest a route stores instead of the execution token;
- :func:`encode_endpoint` / :func:`endpoint_target`: a service's registration and the
  scheduler leader's key (where the process listens);
- :func:`encode_policy_record` / :func:`decode_policy_record` / :func:`policy_version`: the
  published policy (``keys.policy``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from typing import Any, cast

from gyre.errors import InvalidArgument
from gyre.v1 import common_pb2


class CellKind(enum.Enum):
    """Whether a cell can change role; values as in ``keys.cell`` JSON."""

    STANDALONE = "standalone"
    ELASTIC = "elastic"

    @classmethod
    def from_name(cls, name: str) -> CellKind:
        """``standalone`` / ``ELASTIC`` ... (any case); InvalidArgument otherwise."""
        try:
            return cls(str(name).lower())
        except ValueError:
            raise InvalidArgument(f"unknown cell kind {name!r}") from None

    @classmethod
    def from_proto(cls, value: int) -> CellKind:
        try:
            return _KIND_FROM_PROTO[value]
        except KeyError:
            raise InvalidArgument(f"unknown cell kind {value}") from None

    def to_proto(self) -> common_pb2.CellKind:
        return cast(common_pb2.CellKind, _KIND_TO_PROTO[self])


@dataclasses.dataclass(frozen=True)
class CellRecord:
    """A cell's registration (``keys.cell``): written by its agent under its lease, read by
    the scheduler (placement) and anyone listing cells."""

    cell_id: str
    kind: CellKind
    index: int
    slots: int
    target: str
    engine: str = "mock"
    policy_version: int = 0
    kv_tokens: int = 0
    """Tokens the engine's KV cache holds (0: unknown, e.g. a record from an older agent)."""

    @classmethod
    def from_json(cls, raw: bytes) -> CellRecord:
        d = json.loads(raw)
        kind = CellKind.from_name(str(d.get("kind", "standalone")))
        index = int(d.get("index", -1))
        if kind is CellKind.STANDALONE:
            index = -1
        return cls(
            str(d["cell_id"]),
            kind,
            index,
            max(0, int(d.get("slots", 0))),
            str(d.get("target", "")),
            str(d.get("engine", "mock")),
            int(d.get("policy_version", 0)),
            max(0, int(d.get("kv_tokens", 0))),
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "cell_id": self.cell_id,
                "kind": self.kind.value,
                "index": self.index,
                "slots": self.slots,
                "target": self.target,
                "engine": self.engine,
                "policy_version": self.policy_version,
                "kv_tokens": self.kv_tokens,
            }
        ).encode()


class CellState(enum.Enum):
    """The role lifecycle of a cell; values as in ``keys.cell_state`` JSON (its names)."""

    STARTING = "STARTING"
    ROLLOUT = "ROLLOUT"
    DRAINING = "DRAINING"
    TRAINING = "TRAINING"
    RETURNING = "RETURNING"
    FAILED = "FAILED"

    @classmethod
    def from_name(cls, name: str) -> CellState:
        """``ROLLOUT`` / ``rollout`` ...; InvalidArgument otherwise."""
        try:
            return cls(str(name).upper())
        except ValueError:
            raise InvalidArgument(f"unknown cell state {name!r}") from None

    @classmethod
    def from_proto(cls, value: int) -> CellState:
        try:
            return _STATE_FROM_PROTO[value]
        except KeyError:
            raise InvalidArgument(f"unknown cell state {value}") from None

    def to_proto(self) -> common_pb2.CellState:
        return cast(common_pb2.CellState, _STATE_TO_PROTO[self])


_KIND_TO_PROTO: dict[CellKind, int] = {
    CellKind.STANDALONE: common_pb2.CELL_KIND_STANDALONE,
    CellKind.ELASTIC: common_pb2.CELL_KIND_ELASTIC,
}
_KIND_FROM_PROTO: dict[int, CellKind] = {v: k for k, v in _KIND_TO_PROTO.items()}
_STATE_TO_PROTO: dict[CellState, int] = {
    state: int(common_pb2.CellState.Value(f"CELL_STATE_{state.value}")) for state in CellState
}
_STATE_FROM_PROTO: dict[int, CellState] = {v: k for k, v in _STATE_TO_PROTO.items()}


def encode_cell_state(state: CellState, epoch: int, updated_s: float) -> bytes:
    """The ``keys.cell_state`` value a cell agent writes under the leader's fence ``epoch``."""
    return json.dumps({"state": state.value, "epoch": epoch, "updated_s": updated_s}).encode()


def decode_cell_state(raw: bytes | None) -> CellState:
    """A ``keys.cell_state`` value; no value (a cell with no state yet) or an unreadable one
    is STARTING: the scheduler places nothing on it until the cell says more."""
    if raw is None:
        return CellState.STARTING
    try:
        return CellState.from_name(json.loads(raw)["state"])
    except (ValueError, KeyError, TypeError, InvalidArgument):
        return CellState.STARTING


def token_sha256(token: str) -> str:
    """The hex digest a route (and the ledger) stores instead of the execution token."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one execution's model calls go (``keys.route``).

    ``epoch`` is the key's version (it is not in the value); ``created_revision`` tells a
    re-created route from a newer epoch of the same one (the router's rule); ``mod_revision``
    guards the scheduler's compare-and-swap moves. Both are 0 for a route not read from etcd.
    """

    execution_id: str
    cell_id: str
    target: str
    token_sha256: str
    group_id: str
    burst_id: int
    policy_version: int
    epoch: int = 0
    created_revision: int = 0
    mod_revision: int = 0
    expires_s: float = 0.0
    """Wall-clock time (unix seconds) the execution's token expires; 0: never."""

    @classmethod
    def from_json(
        cls, value: bytes, epoch: int = 0, *, created_revision: int = 0, mod_revision: int = 0
    ) -> Route:
        """Parses a route key's value; InvalidArgument when a required field is missing or
        a number is not one."""
        try:
            raw: Any = json.loads(value)
            return cls(
                execution_id=str(raw["execution_id"]),
                cell_id=str(raw["cell_id"]),
                target=str(raw["target"]),
                token_sha256=str(raw["token_sha256"]).lower(),
                group_id=str(raw.get("group_id", "")),
                burst_id=int(raw.get("burst_id", 0) or 0),
                policy_version=int(raw.get("policy_version", 0) or 0),
                epoch=int(epoch),
                created_revision=int(created_revision),
                mod_revision=int(mod_revision),
                expires_s=float(raw.get("expires_s", 0.0) or 0.0),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"malformed route: {exc!r}") from exc

    def to_json(self) -> bytes:
        """The key's value (epoch and revisions live in the key's metadata)."""
        return json.dumps(
            {
                "execution_id": self.execution_id,
                "cell_id": self.cell_id,
                "target": self.target,
                "token_sha256": self.token_sha256,
                "group_id": self.group_id,
                "burst_id": self.burst_id,
                "policy_version": self.policy_version,
                "expires_s": self.expires_s,
            }
        ).encode()


def encode_endpoint(target: str, **fields: Any) -> bytes:
    """Where a process listens: a service's registration (``keys.service``: target, pid) or
    the scheduler leader's key (``keys.leader``: instance, target)."""
    return json.dumps({"target": target, **fields}).encode()


def endpoint_target(raw: bytes | str | None) -> str:
    """The ``target`` of an :func:`encode_endpoint` value; "" when it is missing or unreadable
    (a caller then acts as if nobody were there)."""
    try:
        body = json.loads(raw) if raw else None
        return str(body["target"]) if isinstance(body, dict) and "target" in body else ""
    except ValueError:
        return ""


def encode_policy_record(version: int, **fields: Any) -> bytes:
    """The published policy (``keys.policy``): its version, where its weights are served
    (``source_target``), the batch that made it and that step's training diagnostics."""
    return json.dumps({"version": version, **fields}).encode()


def decode_policy_record(raw: bytes | str) -> dict[str, Any]:
    """A :func:`encode_policy_record` value; InvalidArgument unless it is an object whose
    ``version`` is a whole number >= 0."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidArgument(f"malformed policy record: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgument("malformed policy record: not an object")
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidArgument(f"malformed policy record: version {version!r}")
    return body


def policy_version(raw: bytes | str | None) -> int | None:
    """The version of a policy record; None when there is none or it is unreadable."""
    if raw is None:
        return None
    try:
        return int(decode_policy_record(raw)["version"])
    except InvalidArgument:
        return None
