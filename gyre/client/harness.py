"""Harness-side client of the scheduler (gRPC) and the router (OpenAI HTTP).

The scheduler requires mutual TLS and a harness credential. The client presents the
certificate in ``tls_dir`` (an identity directory: tls.crt, tls.key, ca.crt; default
``$GYRE_HARNESS_TLS_DIR``), and, where harnesses share a certificate, an API key
(``api_key``, or the file named by ``$GYRE_HARNESS_API_KEY_FILE``, or
``$GYRE_HARNESS_API_KEY``) in the ``x-gyre-api-key`` metadata of every call.
``insecure=True`` dials plaintext (a scheduler run with ``tls.insecure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from gyre.apikeys import METADATA_KEY
from gyre.backoff import Backoff
from gyre.errors import GyreError, InvalidArgument, Unavailable, from_http_status, from_rpc_error
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles, TlsNotConfigured
from gyre.identity import Role
from gyre.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

_STATUS = {
    "completed": common_pb2.EXECUTION_STATUS_COMPLETED,
    "failed": common_pb2.EXECUTION_STATUS_FAILED,
    "cancelled": common_pb2.EXECUTION_STATUS_CANCELLED,
}


class NoExecution(Exception):
    """Raised by :meth:`HarnessClient.acquire_or_raise` when the burst has nothing left."""


class HarnessClient:
    """Asks the scheduler for executions. One per harness process."""

    def __init__(self, scheduler_target: str, harness_id: str = "", timeout_s: float = 10.0, *,
                 tls_dir: str | os.PathLike[str] | None = None, api_key: str | None = None,
                 insecure: bool = False) -> None:
        self._target = scheduler_target
        self.harness_id = harness_id or f"harness-{uuid.uuid4().hex[:8]}"
        self._timeout_s = timeout_s
        self._tls_dir = tls_dir or os.environ.get("GYRE_HARNESS_TLS_DIR", "")
        self._insecure = insecure
        key = api_key or _key_from_env()
        self.metadata: tuple[tuple[str, str], ...] = ((METADATA_KEY, key),) if key else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.HarnessServiceStub | None = None
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HarnessClient:
        if self._insecure:
            tls = TlsFiles(insecure=True)
        elif self._tls_dir:
            tls = TlsFiles.from_dir(self._tls_dir)
        else:
            raise TlsNotConfigured(
                "the scheduler requires mTLS: pass tls_dir= (or set GYRE_HARNESS_TLS_DIR) to a harness "
                "identity directory (python -m gyre.certs issue DIR harness NAME)"
            )
        self._channel = dial(self._target, tls, Role.SCHEDULER)
        self._stub = scheduler_pb2_grpc.HarnessServiceStub(self._channel)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def stub(self) -> scheduler_pb2_grpc.HarnessServiceStub:
        if self._stub is None:
            raise RuntimeError("use `async with HarnessClient(...)`")
        return self._stub

    async def acquire(self, wait_s: float = 10.0) -> ExecutionHandle | None:
        """The next execution, or None if none could be launched within ``wait_s``.

        Check :attr:`last_burst_exhausted` to tell "wait and retry" from "burst done"."""
        request = scheduler_pb2.AcquireExecutionRequest(harness_id=self.harness_id, wait_s=wait_s)
        try:
            reply = await self.stub.AcquireExecution(request, timeout=wait_s + self._timeout_s,
                                                     metadata=self.metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        self.last_burst_exhausted = reply.burst_exhausted
        self.last_retry_after_s = reply.retry_after_s
        if not reply.HasField("execution"):
            return None
        assert self._http is not None
        return ExecutionHandle(self, reply.execution, self._http, self._timeout_s)

    last_burst_exhausted: bool = False
    last_retry_after_s: float = 0.0


class ExecutionHandle:
    """One execution held by this harness: heartbeats, model calls, and the finish report."""

    def __init__(
        self,
        client: HarnessClient,
        proto: scheduler_pb2.Execution,
        http: aiohttp.ClientSession,
        timeout_s: float,
    ) -> None:
        self._client = client
        self.proto = proto
        self.execution_id = proto.execution_id
        self.token = proto.token
        self.task_id = proto.task_id
        self.group_id = proto.group_id
        self.policy_version = proto.policy_version
        self.task: dict[str, Any] = json.loads(proto.task_json) if proto.task_json else {}
        self.openai_base_url = proto.openai_base_url.rstrip("/")
        self.model = proto.model
        self._http = http
        self._timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {self.token}"), *client.metadata)
        self._idempotency_key = uuid.uuid4().hex
        self._heartbeat: asyncio.Task[None] | None = None
        self.finished = False

    # Lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> ExecutionHandle:
        self.start_heartbeats()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if not self.finished:
                # Leaving the block without a report: an exception is a failure, anything
                # else a cancellation. Either way the execution closes exactly once.
                await self.finish(status="failed" if exc_type is not None else "cancelled")
        finally:
            await self.stop_heartbeats()

    def start_heartbeats(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat(), name=f"heartbeat-{self.execution_id}")

    async def stop_heartbeats(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    async def _beat(self) -> None:
        interval = max(self.proto.heartbeat_interval_s or 2.0, 0.1)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.heartbeat()
            except GyreError as exc:
                log.warning("heartbeat failed", extra={"execution_id": self.execution_id, "error": str(exc)})

    async def heartbeat(self) -> scheduler_pb2.HeartbeatResponse:
        request = scheduler_pb2.HeartbeatRequest(execution_id=self.execution_id)
        try:
            return await self._client.stub.Heartbeat(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err

    async def finish(self, reward: float = 0.0, status: str = "completed", attempts: int = 5) -> scheduler_pb2.FinishExecutionResponse:
        """Reports the end. Safe to retry: the idempotency key makes repeats no-ops."""
        if status not in _STATUS:
            raise InvalidArgument(f"status must be one of {sorted(_STATUS)}")
        if status == "completed" and not math.isfinite(reward):
            raise InvalidArgument("reward must be finite")
        request = scheduler_pb2.FinishExecutionRequest(
            execution_id=self.execution_id,
            status=_STATUS[status],
            reward=reward,
            idempotency_key=self._idempotency_key,
        )
        backoff = Backoff(0.2, 2.0)
        for attempt in range(attempts):
            try:
                reply = await self._client.stub.FinishExecution(request, timeout=self._timeout_s, metadata=self._metadata)
                self.finished = True
                if asyncio.current_task() is not self._heartbeat:
                    await self.stop_heartbeats()
                return reply
            except grpc.aio.AioRpcError as err:
                retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not retryable or attempt == attempts - 1:
                    raise from_rpc_error(err) from err
                await backoff.sleep()
        raise Unavailable("finish not acknowledged")  # pragma: no cover

    # Model calls -------------------------------------------------------------------------

    async def chat(
        self,
        messages: Sequence[dict[str, str]],
        max_tokens: int = 64,
        temperature: float = 1.0,
        **extra: Any,
    ) -> str:
        """One non-streaming chat completion through the router; returns the text."""
        message = await self.chat_message(messages, max_tokens, temperature, **extra)
        return str(message.get("content") or "")

    async def chat_message(
        self,
        messages: Sequence[dict[str, Any]],
        max_tokens: int = 64,
        temperature: float = 1.0,
        tools: Sequence[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """One non-streaming chat completion; returns the assistant message (``content``,
        and ``tool_calls`` when the model called one of ``tools``). Append it to the history
        as it is: the router then continues the execution's tokens exactly."""
        body = {"model": self.model, "messages": list(messages), "max_tokens": max_tokens, "temperature": temperature, **extra}
        if tools:
            body["tools"] = list(tools)
        data = await self.post("/chat/completions", body)
        return dict(data["choices"][0]["message"])

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs to the router's OpenAI-compatible API with this execution's token."""
        url = self.openai_base_url + path
        # The execution id lets the router tell "this execution's route has not arrived yet"
        # (it waits for the watch) from a token of another execution (403).
        headers = {"Authorization": f"Bearer {self.token}", "x-gyre-execution-id": self.execution_id}
        _inject_trace_context(headers)
        async with self._http.post(url, json=body, headers=headers) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise _http_error(resp.status, text)
            return json.loads(text)


def _key_from_env() -> str | None:
    path = os.environ.get("GYRE_HARNESS_API_KEY_FILE", "")
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get("GYRE_HARNESS_API_KEY") or None


def _inject_trace_context(headers: dict[str, str]) -> None:
    """Adds W3C trace context (traceparent) when the harness traces with OpenTelemetry, so
    the router's and the engine's spans join the harness's trace."""
    try:
        from opentelemetry import propagate
    except ImportError:  # tracing is optional for harnesses
        return
    propagate.inject(headers)


def _http_error(status: int, text: str) -> GyreError:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:200]
    return from_http_status(status, message)
