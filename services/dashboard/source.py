"""Where the dashboard's data comes from: SchedulerControl.GetStatus and WatchEvents.

A status source is any async callable returning a SchedulerStatus-like dict (proto field
names). :class:`GrpcStatusSource` is the one the standalone dashboard uses; the demo runner
may pass its own (e.g. reading the scheduler in-process). An event source (optional) is a
callable ``(after_seq) -> async iterator of SchedulerEvent-like dicts``;
:class:`GrpcEventSource` streams ``WatchEvents`` in bounded calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from gyre.config import ServiceConfig
from gyre.errors import from_rpc_error
from gyre.grpcx.channel import open_channel, unary
from gyre.identity import Role
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc

StatusSource = Callable[[], Awaitable[dict[str, Any]]]
EventSource = Callable[[int], AsyncIterator[dict[str, Any]]]


def event_to_dict(event: scheduler_pb2.SchedulerEvent) -> dict[str, Any]:
    """A SchedulerEvent as a dict with the proto's field names and every field present."""
    return json_format.MessageToDict(
        event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


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
            self._channel = open_channel(self.target, self._config, Role.SCHEDULER)
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


class GrpcEventSource:
    """Streams ``SchedulerControl.WatchEvents`` from ``after_seq`` on.

    Each call is one stream bounded by ``stream_s`` (gRPC has no default deadline; a bounded
    stream that ends with DEADLINE_EXCEEDED just ends the iteration, and the caller resumes
    from the last sequence number it saw). Other failures raise a domain error.
    """

    def __init__(self, target: str, config: ServiceConfig, stream_s: float = 300.0) -> None:
        self.target = target
        self._config = config
        self._stream_s = stream_s

    async def __call__(self, after_seq: int) -> AsyncIterator[dict[str, Any]]:
        channel = open_channel(self.target, self._config, Role.SCHEDULER)
        try:
            stub = scheduler_pb2_grpc.SchedulerControlStub(channel)
            call = stub.WatchEvents(
                scheduler_pb2.WatchEventsRequest(after_seq=after_seq), timeout=self._stream_s
            )
            try:
                async for event in call:
                    yield event_to_dict(event)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise from_rpc_error(err) from err
            finally:
                call.cancel()
        finally:
            await channel.close()
