"""The harness client's execution handle when the scheduler no longer knows the execution
(its burst was archived after the scheduler closed it): a finish report after a close the
handle learned of is answered as the duplicate it is; one without is an error; heartbeats
that get NOT_FOUND go on and are logged once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from gyre.client.harness import ExecutionHandle
from gyre.errors import NotFound
from gyre.v1 import common_pb2, scheduler_pb2


class ForgetfulClient:
    """A HarnessClient stand-in whose scheduler answers NOT_FOUND to everything."""

    metadata: tuple[tuple[str, str], ...] = ()

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call(self, what: str, attempt_fn: Any, timeout_s: float) -> Any:
        self.calls.append(what)
        raise NotFound("execution 'b1-t0-0' was closed and its burst archived; its record is gone")


def handle(client: ForgetfulClient) -> ExecutionHandle:
    proto = scheduler_pb2.Execution(execution_id="b1-t0-0", token="t", heartbeat_interval_s=0.1)
    return ExecutionHandle(client, proto, http=None, timeout_s=1.0)  # type: ignore[arg-type]


async def test_a_finish_after_a_known_close_is_the_duplicate() -> None:
    h = handle(ForgetfulClient())
    h.closed_as = "CANCELLED"  # what its heartbeats learned before the archive
    reply = await h.finish(status="cancelled")
    assert reply.duplicate and reply.status == common_pb2.EXECUTION_STATUS_CANCELLED
    assert h.finished and h.cancelled_by_scheduler


async def test_a_finish_without_a_known_close_is_an_error() -> None:
    h = handle(ForgetfulClient())
    with pytest.raises(NotFound, match="archived"):
        await h.finish()
    assert not h.finished


async def test_unknown_heartbeats_go_on_and_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    client = ForgetfulClient()
    h = handle(client)
    with caplog.at_level(logging.INFO, logger="gyre.client.harness"):
        h.start_heartbeats()
        await asyncio.sleep(0.45)
        assert h._heartbeat is not None and not h._heartbeat.done()
        await h.stop_heartbeats()
    assert client.calls.count("heartbeat") >= 3
    said = [r for r in caplog.records if "does not know this execution" in r.getMessage()]
    assert len(said) == 1
