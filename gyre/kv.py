"""A KV-cache handoff handle: the domain form of ``gyre.v1.KvHandle``, shared by the router
(which passes it from the source engine to the destination) and the engines (which export
and import it)."""

from __future__ import annotations

import dataclasses

from gyre.errors import InvalidArgument
from gyre.v1 import cell_agent_pb2


@dataclasses.dataclass(frozen=True)
class KvHandle:
    """Where a request's pinned KV blocks can be read (see ``gyre.v1.KvHandle``)."""

    handle_id: str
    source_cell: str
    num_tokens: int
    locator: str
    medium: str

    def to_proto(self) -> cell_agent_pb2.KvHandle:
        return cell_agent_pb2.KvHandle(
            handle_id=self.handle_id,
            source_cell=self.source_cell,
            num_tokens=self.num_tokens,
            locator=self.locator,
            medium=self.medium,
        )

    @classmethod
    def from_proto(cls, msg: cell_agent_pb2.KvHandle) -> KvHandle | None:
        if not msg.handle_id:
            return None
        if msg.num_tokens < 0:
            raise InvalidArgument("kv_handle.num_tokens must be >= 0")
        return cls(msg.handle_id, msg.source_cell, int(msg.num_tokens), msg.locator, msg.medium)
