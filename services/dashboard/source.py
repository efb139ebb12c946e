"""Where the dashboard's status comes from: SchedulerControl.GetStatus over gRPC.

A status source is any async callable returning a SchedulerStatus-like dict (proto field
names). :class:`GrpcStatusSource` is the one the standalone dashboard uses; the demo runner
may pass its own (e.g. reading the scheduler in-process).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from gyre.config import ServiceConfig
from gyre.grpcx.channel import open_channel, unary
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc

StatusSource = Callable[[], Awaitable[dict[str, Any]]]


def status_to_dict(status: scheduler_pb2.SchedulerStatus) -> dict[str, Any]:
    """A SchedulerStatus as a dict with the proto's field names and every field present."""
    return json_format.MessageToDict(
        status,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )


class GrpcStatusSource:
    """Calls ``SchedulerControl.GetStatus`` on ``target`` with a deadline.

    After a failed call the channel is dropped and the next call opens a new one, so a
    target that names several replicas (a Kubernetes Service) gets a fresh resolution.
    """

    def __init__(self, target: str, config: ServiceConfig, timeout_s: float = 2.0) -> None:
        self.target = target
        self._config = config
        self._timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerControlStub | None = None

    async def __call__(self) -> dict[str, Any]:
        if self._stub is None:
            self._channel = open_channel(self.target, self._config)
            self._stub = scheduler_pb2_grpc.SchedulerControlStub(self._channel)
        try:
            status = await unary(self._stub.GetStatus, scheduler_pb2.GetStatusRequest(), self._timeout_s)
        except BaseException:
            await self.close()
            raise
        return status_to_dict(status)

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
