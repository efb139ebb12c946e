"""Engine failures told to the scheduler leader, so that a dead engine is noticed in about a
second instead of when its lease lapses.

A call whose engine failed (the stream broke, the connection was refused, the engine fell
silent) asks :class:`FailureReporter` to report it and then holds the harness's call open
while it waits for the route to move. One report per engine is in flight at a time, and an
answer is reused for ``reuse_s`` (a dead engine fails every call it held at once). The answer
says whether the scheduler found the engine dead: if it did not, the call retries at once
instead of waiting for a move that will not come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gyre.config import ServiceConfig
from gyre.errors import GyreError
from gyre.etcd.values import endpoint_target
from gyre.grpcx.channel import open_channel, unary
from gyre.identity import Role
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

Send = Callable[[str, str, str], Awaitable[bool | None]]
"""``send(cell_id, target, reason)``: True/False (the scheduler found the engine dead or
not), None when no answer came."""


class FailureReporter:
    """Reports failed engines, one report per engine at a time."""

    def __init__(self, send: Send, reuse_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._reuse_s = reuse_s
        self._clock = clock
        self._inflight: dict[tuple[str, str], asyncio.Task[bool | None]] = {}
        self._answers: dict[tuple[str, str], tuple[float, bool | None]] = {}
        self.sent = 0

    def report(self, cell_id: str, target: str, reason: str) -> asyncio.Future[bool | None]:
        """The scheduler's verdict on the engine (a future; never raises)."""
        key = (cell_id, target)
        task = self._inflight.get(key)
        if task is not None:
            return task
        answered = self._answers.get(key)
        if answered is not None and self._clock() - answered[0] < self._reuse_s:
            fut: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
            fut.set_result(answered[1])
            return fut
        task = asyncio.create_task(self._report(key, reason), name=f"report.{cell_id}")
        self._inflight[key] = task
        return task

    async def _report(self, key: tuple[str, str], reason: str) -> bool | None:
        self.sent += 1
        try:
            verdict = await self._send(key[0], key[1], reason)
        except GyreError as exc:  # a report is a hint: the lease lapsing says the same later
            log.info("engine failure report failed", extra={"cell_id": key[0], "error": repr(exc)})
            verdict = None
        finally:
            self._inflight.pop(key, None)
        self._answers[key] = (self._clock(), verdict)
        return verdict


class SchedulerReports:
    """``send`` over gRPC to whoever leads now (read from the leader key's mirror)."""

    def __init__(
        self, config: ServiceConfig, leader_items: Callable[[], Mapping[bytes, Any]], timeout_s: float = 2.0
    ) -> None:
        self._config = config
        self._leader_items = leader_items
        self._timeout_s = timeout_s
        self._channels: dict[str, Any] = {}

    def _leader_target(self) -> str:
        for kv in self._leader_items().values():
            return endpoint_target(kv.value)
        return ""

    async def send(self, cell_id: str, target: str, reason: str) -> bool | None:
        leader = self._leader_target()
        if not leader:
            return None
        channel = self._channels.get(leader)
        if channel is None:
            channel = self._channels[leader] = open_channel(leader, self._config, Role.SCHEDULER)
        stub = scheduler_pb2_grpc.SchedulerControlStub(channel)
        request = scheduler_pb2.ReportEngineFailureRequest(
            cell_id=cell_id, target=target, reason=reason[:512]
        )
        try:
            reply = await unary(stub.ReportEngineFailure, request, self._timeout_s)
        except GyreError as exc:
            log.info("scheduler did not take the engine failure report", extra={"error": str(exc)})
            return None
        return bool(reply.dead)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
