"""The harness client across a leader change, against scripted HarnessService servers on
loopback (mutual TLS, as the scheduler serves).

Invariants: a standby's UNAVAILABLE naming the leader (``x-gyre-leader``) sends the next
attempt to the leader, which the client then keeps using; a retried AcquireExecution keeps
its idempotency key (one key per acquire, a new one for the next acquire); heartbeats and
finishes are retried through UNAVAILABLE and DEADLINE_EXCEEDED until the leader answers;
an error that is not retryable is raised at once; past ``retry_s`` the last error is raised;
two replicas naming each other as the leader are not spun on (back-off between attempts).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gyre.client import HarnessClient
from gyre.client.harness import LEADER_METADATA
from gyre.errors import InvalidArgument, Unavailable
from gyre.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from testkit.tls import PKI, add_port, tls

pytestmark = pytest.mark.timeout(60)


class ScriptedScheduler(scheduler_pb2_grpc.HarnessServiceServicer):
    """Answers each call with the next scripted outcome: "ok", a status code, or
    ("standby", leader target)."""

    def __init__(self) -> None:
        self.script: list[object] = []
        self.calls: list[tuple[str, object]] = []
        self.target = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> ScriptedScheduler:
        self._server = grpc.aio.server()
        scheduler_pb2_grpc.add_HarnessServiceServicer_to_server(self, self._server)
        self.target = f"127.0.0.1:{add_port(self._server, '127.0.0.1:0', 'scheduler')}"
        await self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    async def _next(self, method: str, request: object, context: grpc.aio.ServicerContext) -> None:
        self.calls.append((method, request))
        step = self.script.pop(0) if self.script else "ok"
        if isinstance(step, tuple):
            context.set_trailing_metadata(((LEADER_METADATA, step[1]),))
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"not the scheduler leader; the leader is at {step[1]}"
            )
        if isinstance(step, grpc.StatusCode):
            await context.abort(step, f"scripted {step.name}")

    async def AcquireExecution(self, request, context):
        await self._next("acquire", request, context)
        return scheduler_pb2.AcquireExecutionResponse(
            execution=scheduler_pb2.Execution(
                execution_id="b1-t0-0",
                token="tok",
                heartbeat_interval_s=60.0,
                openai_base_url="http://127.0.0.1:9/v1",
            )
        )

    async def Heartbeat(self, request, context):
        await self._next("heartbeat", request, context)
        return scheduler_pb2.HeartbeatResponse(deadline_s=30.0, status=common_pb2.EXECUTION_STATUS_RUNNING)

    async def FinishExecution(self, request, context):
        await self._next("finish", request, context)
        return scheduler_pb2.FinishExecutionResponse(status=request.status)


@pytest.fixture
async def pair():
    tls("harness")
    a, b = await ScriptedScheduler().start(), await ScriptedScheduler().start()
    yield a, b
    await a.stop()
    await b.stop()


def _client(*targets: str, retry_s: float = 10.0) -> HarnessClient:
    return HarnessClient(
        list(targets), harness_id="h", tls_dir=PKI / "harness", retry_s=retry_s, timeout_s=2.0
    )


async def test_standby_names_the_leader_and_the_client_follows(pair):
    standby, leader = pair
    standby.script = [("standby", leader.target)] * 100  # a standby always names the leader
    leader.script = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]  # still rebuilding
    async with _client(standby.target) as client:  # only the standby is known
        execution = await client.acquire(wait_s=0.1)
        assert execution is not None and client.target == leader.target
        keys = {req.idempotency_key for _, req in standby.calls + leader.calls}
        assert len(keys) == 1 and len(next(iter(keys))) >= 16  # every retry kept the key
        leader.script = [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE]
        await execution.heartbeat()
        leader.script = [grpc.StatusCode.UNAVAILABLE]
        out = await execution.finish(reward=1.0)
        assert out.status == common_pb2.EXECUTION_STATUS_COMPLETED
        await client.acquire(wait_s=0.1)
        acquires = [req.idempotency_key for m, req in leader.calls if m == "acquire"]
        assert len(set(acquires)) == 2  # the next acquire has a key of its own
        finishes = {req.idempotency_key for m, req in leader.calls if m == "finish"}
        assert len(finishes) == 1
    assert client.retries >= 6


async def test_dead_replica_is_skipped(pair):
    a, b = pair
    await a.stop()  # connection refused
    async with _client(a.target, b.target) as client:
        assert await client.acquire(wait_s=0.1) is not None
        assert client.target == b.target


async def test_not_retryable_is_raised_at_once_and_the_budget_ends_retries(pair):
    a, _ = pair
    async with _client(a.target, retry_s=1.0) as client:
        a.script = [grpc.StatusCode.INVALID_ARGUMENT]
        with pytest.raises(InvalidArgument):
            await client.acquire(wait_s=0.1)
        assert len(a.calls) == 1
        a.script = [grpc.StatusCode.UNAVAILABLE] * 1000
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await client.acquire(wait_s=0.1)
        assert 1.0 <= time.monotonic() - started < 5.0


async def test_replicas_naming_each_other_are_not_spun_on(pair):
    a, b = pair
    a.script = [("standby", b.target)] * 1000
    b.script = [("standby", a.target)] * 1000
    async with _client(a.target, retry_s=1.5) as client:
        with pytest.raises(Unavailable):
            await client.acquire(wait_s=0.1)
    assert len(a.calls) + len(b.calls) < 40  # backed off, not hundreds of calls
    await asyncio.sleep(0)
