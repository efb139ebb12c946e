"""How an execution stands, named once: :class:`ExecutionStatus`, with its proto numbers
(``gyre.v1.ExecutionStatus``) at the edge. The scheduler's ledger, the packer's finish
reports and the harness client all use it; what they persist keeps its spelling through
:meth:`ExecutionStatus.from_name` (the packer's WAL writes ``completed``, the scheduler's
records ``COMPLETED``)."""

from __future__ import annotations

import enum
from typing import cast

from gyre.errors import InvalidArgument
from gyre.v1 import common_pb2


class ExecutionStatus(enum.Enum):
    """An execution's status (names as in the proto's ExecutionStatus, without the prefix)."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"

    @property
    def final(self) -> bool:
        """Closed: no transition leaves it."""
        return self in FINAL

    @property
    def ok(self) -> bool:
        return self is ExecutionStatus.COMPLETED

    @classmethod
    def from_name(cls, name: str) -> ExecutionStatus:
        """``COMPLETED`` / ``completed`` ...; InvalidArgument otherwise."""
        try:
            return cls(str(name).upper())
        except ValueError:
            raise InvalidArgument(f"unknown execution status {name!r}") from None

    @classmethod
    def from_proto(cls, value: int) -> ExecutionStatus:
        """The status of a proto number; InvalidArgument for UNSPECIFIED or an unknown one."""
        try:
            return _FROM_PROTO[value]
        except KeyError:
            raise InvalidArgument(f"unknown execution status {value}") from None

    @classmethod
    def closed_from_proto(cls, value: int) -> ExecutionStatus | None:
        """The final status of a proto number; None for QUEUED, RUNNING, UNSPECIFIED or an
        unknown number (a finish report's status, a closed execution's answer)."""
        status = _FROM_PROTO.get(value)
        return status if status is not None and status.final else None

    def to_proto(self) -> common_pb2.ExecutionStatus:
        return cast(common_pb2.ExecutionStatus, _TO_PROTO[self])


FINAL = frozenset(
    {ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.TIMED_OUT, ExecutionStatus.CANCELLED}
)
"""The closed statuses."""

_TO_PROTO: dict[ExecutionStatus, int] = {
    s: common_pb2.ExecutionStatus.Value(f"EXECUTION_STATUS_{s.value}") for s in ExecutionStatus
}
_FROM_PROTO: dict[int, ExecutionStatus] = {v: k for k, v in _TO_PROTO.items()}
