"""Harness-side client of the scheduler (gRPC) and the router (OpenAI HTTP).

The scheduler requires mutual TLS and a harness credential. The client presents the
certificate in ``tls_dir`` (an identity directory: tls.crt, tls.key, ca.crt; default
``$GYRE_HARNESS_TLS_DIR``), and, where harnesses share a certificate, an API key
(``api_key``, or the file named by ``$GYRE_HARNESS_API_KEY_FILE``, or
``$GYRE_HARNESS_API_KEY``) in the ``x-gyre-api-key`` metadata of every call.
``insecure=True`` dials plaintext (a scheduler run with ``tls.insecure``).

Failover is invisible to the harness. ``scheduler_target`` may name several scheduler
replicas ("host:a,host:b", or a list); only the leader serves harness calls, a standby
answers UNAVAILABLE naming the leader, and the client follows it. Every call is retried on
UNAVAILABLE and DEADLINE_EXCEEDED (capped exponential back-off with jitter, gyre.backoff)
until ``retry_s`` has passed since its first attempt (default 30 s, or ``$GYRE_HARNESS_RETRY_S``): long enough for a
leader failover (the old leader's lease TTL, 10 s by default, plus the election and the
rebuild). Retries are safe: AcquireExecution and FinishExecution carry idempotency keys (a
retried acquire returns the same execution and token, also from the new leader), and a
heartbeat changes nothing but a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp
import grpc

from gyre.apikeys import METADATA_KEY
from gyre.backoff import Backoff
from gyre.client.router_stream import RouterStream
from gyre.errors import GyreError, InvalidArgument, NotFound, Unavailable, from_http_status, from_rpc_error
from gyre.execution import ExecutionStatus
from gyre.grpcx.channel import dial
from gyre.grpcx.tls import TlsFiles, TlsNotConfigured
from gyre.identity import Role
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

HARNESS_STATUSES = ("completed", "failed", "cancelled")
"""The ends a harness may report (TIMED_OUT is the scheduler's own)."""


LEADER_METADATA = "x-gyre-leader"
"""Trailing metadata of a standby's UNAVAILABLE: the leader's gRPC target."""
_LEADER_IN_DETAILS = re.compile(r"the leader is at (\S+?)[;,)]?(?:\s|$)")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
DEFAULT_RETRY_S = 30.0
ROUTER_CONNECT_RETRY_S = 120.0
"""How long a model call keeps reconnecting to a router that refuses connections (restarting):
longer than a supervised restart takes (its back-off, at most 30 s, and the start, whose ready
line the supervisor awaits up to 60 s). 30 s failed 28 episodes of the vLLM chaos demo, whose
router came back after 30.2 s (its tokenizer loads slowly on a loaded machine); the
execution's heartbeats go on meanwhile, so waiting loses nothing."""
T = TypeVar("T")


class NoExecution(Exception):
    """Raised by :meth:`HarnessClient.acquire_or_raise` when the burst has nothing left."""


def _targets(spec: str | Sequence[str]) -> list[str]:
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [t.strip() for t in items if t.strip()]
    if not out:
        raise ValueError("no scheduler target")
    return out


def leader_hint(err: grpc.aio.AioRpcError) -> str:
    """The leader's target a standby named in its UNAVAILABLE answer ("" if none)."""
    for key, value in err.trailing_metadata() or ():
        if key == LEADER_METADATA:
            return value if isinstance(value, str) else value.decode(errors="replace")
    m = _LEADER_IN_DETAILS.search(err.details() or "")
    return m.group(1) if m else ""


class HarnessClient:
    """Asks the scheduler for executions. One per harness process.

    ``scheduler_target``: one target or several (a list, or comma-separated); the client
    follows the leader among them. ``timeout_s``: deadline of one attempt. ``retry_s``:
    how long one call keeps retrying through UNAVAILABLE / DEADLINE_EXCEEDED (a leader
    failover); None reads ``$GYRE_HARNESS_RETRY_S`` (default 30 s)."""

    def __init__(
        self,
        scheduler_target: str | Sequence[str],
        harness_id: str = "",
        timeout_s: float = 10.0,
        *,
        tls_dir: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        insecure: bool = False,
        retry_s: float | None = None,
    ) -> None:
        self._targets = _targets(scheduler_target)
        self._current = 0
        self.harness_id = harness_id or f"harness-{uuid.uuid4().hex[:8]}"
        self._timeout_s = timeout_s
        self.retry_s = (
            float(os.environ.get("GYRE_HARNESS_RETRY_S", DEFAULT_RETRY_S)) if retry_s is None else retry_s
        )
        self._tls_dir = tls_dir or os.environ.get("GYRE_HARNESS_TLS_DIR", "")
        self._insecure = insecure
        key = api_key or _key_from_env()
        self.metadata: tuple[tuple[str, str], ...] = ((METADATA_KEY, key),) if key else ()
        self._tls: TlsFiles | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._router_streams: dict[str, tuple[grpc.aio.Channel, RouterStream]] = {}
        self._http: aiohttp.ClientSession | None = None
        self.retries = 0
        """Attempts retried so far (UNAVAILABLE / DEADLINE_EXCEEDED), for monitoring."""

    async def __aenter__(self) -> Self:
        if self._insecure:
            self._tls = TlsFiles(insecure=True)
        elif self._tls_dir:
            self._tls = TlsFiles.from_dir(self._tls_dir)
        else:
            raise TlsNotConfigured(
                "the scheduler requires mTLS: pass tls_dir= (or set GYRE_HARNESS_TLS_DIR) to a harness "
                "identity directory (python -m gyre.certs issue DIR harness NAME)"
            )
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        for ch, stream in self._router_streams.values():
            await stream.close()
            await ch.close()
        self._router_streams.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._tls = None

    def router_stream(self, target: str) -> RouterStream:
        """The ``Router.GenerateStream`` of this client to the router at ``target`` (an
        execution's ``router_target``), shared by every execution it runs there and closed
        with the client: their token-level model calls on one stream instead of a gRPC call
        each (:mod:`gyre.client.router_stream`)."""
        if self._tls is None:
            raise RuntimeError("use `async with HarnessClient(...)`")
        if not target:
            raise InvalidArgument("no router target (the scheduler's router_target is not set)")
        held = self._router_streams.get(target)
        if held is None:
            ch = dial(target, self._tls, Role.ROUTER)
            held = self._router_streams[target] = (ch, RouterStream(ch))
        return held[1]

    @property
    def target(self) -> str:
        """The scheduler the next call goes to (the leader, as far as the client knows)."""
        return self._targets[self._current]

    @property
    def stub(self) -> scheduler_pb2_grpc.HarnessServiceStub:
        """A stub on the current target (no retries: prefer the client's methods)."""
        if self._tls is None:
            raise RuntimeError("use `async with HarnessClient(...)`")
        ch = self._channels.get(self.target)
        if ch is None:
            ch = self._channels[self.target] = dial(self.target, self._tls, Role.SCHEDULER)
        return scheduler_pb2_grpc.HarnessServiceStub(ch)  # type: ignore[no-untyped-call]  # generated

    def _follow(self, err: grpc.aio.AioRpcError) -> bool:
        """After a retryable error: switch to the leader a standby named, or (none named)
        to the next target. True when the next attempt may go out at once."""
        hint = leader_hint(err)
        if hint and hint != self.target:
            if hint not in self._targets:
                self._targets.append(hint)
            self._current = self._targets.index(hint)
            return True
        if len(self._targets) > 1:
            self._current = (self._current + 1) % len(self._targets)
        return False

    async def call(
        self,
        what: str,
        attempt_fn: Callable[[scheduler_pb2_grpc.HarnessServiceStub, float], Awaitable[T]],
        timeout_s: float,
    ) -> T:
        """Runs ``attempt_fn(stub, timeout)`` until it succeeds, fails with a status other
        than UNAVAILABLE / DEADLINE_EXCEEDED, or ``retry_s`` has passed (then raises the
        last error as a GyreError). Only for calls that are safe to repeat."""
        started = time.monotonic()
        backoff = Backoff(0.1, 2.0)
        followed = False
        while True:
            try:
                return await attempt_fn(self.stub, timeout_s)
            except grpc.aio.AioRpcError as err:
                left = started + self.retry_s - time.monotonic()
                if err.code() not in _RETRYABLE or left <= 0:
                    raise from_rpc_error(err) from err
                # A leader named by a standby is tried at once, but not twice in a row (two
                # replicas naming each other mid-election must not be spun on).
                at_once = self._follow(err) and not followed
                followed = at_once
                self.retries += 1
                log.info(
                    "%s: %s from the scheduler; retrying at %s (%.1f s left)",
                    what,
                    err.code().name,
                    self.target,
                    left,
                )
                if not at_once:
                    await asyncio.sleep(min(backoff.next(), max(left, 0.0)))

    async def acquire(self, wait_s: float = 10.0) -> ExecutionHandle | None:
        """The next execution, or None if none could be launched within ``wait_s``.

        Retried across a failover with one idempotency key: a retry never launches a second
        execution. Check :attr:`last_burst_exhausted` to tell "wait and retry" from "burst
        done"."""
        request = scheduler_pb2.AcquireExecutionRequest(
            harness_id=self.harness_id, wait_s=wait_s, idempotency_key=secrets.token_urlsafe(24)
        )
        reply = await self.call(
            "acquire",
            lambda stub, t: stub.AcquireExecution(request, timeout=t, metadata=self.metadata),
            wait_s + self._timeout_s,
        )
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
        self.router_target = proto.router_target
        """The router's gRPC address (``HarnessClient.router_stream``)."""
        self.model = proto.model
        self._http = http
        self._timeout_s = timeout_s
        self._metadata = (("authorization", f"Bearer {self.token}"), *client.metadata)
        self._idempotency_key = uuid.uuid4().hex
        self._heartbeat: asyncio.Task[None] | None = None
        self.finished = False
        self._reported_cancel = False
        self.closed_as: str = ""
        """The final status the scheduler holds for this execution once it is closed
        ("COMPLETED", "FAILED", "TIMED_OUT", "CANCELLED"; "" while it runs). "CANCELLED"
        without a cancel from this harness means the scheduler cancelled it (its group could
        no longer be trained within the staleness bound): its model calls end with HTTP 409,
        heartbeats stop, and a finish report is answered as a duplicate (by this client
        itself when the scheduler has archived the burst since, and forgotten the execution:
        a harness waiting on a long tool call reports after the archive grace; its heartbeats
        then get NOT_FOUND, logged once)."""

    # Lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self.start_heartbeats()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
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
        unknown = False
        while True:
            await asyncio.sleep(interval)
            try:
                reply = await self.heartbeat()
            except NotFound as exc:
                # Closed and archived while this harness was away (or a scheduler that does
                # not know it yet): beating on costs nothing and is safe, saying so once is enough.
                if not unknown:
                    log.info(
                        "the scheduler does not know this execution",
                        extra={"execution_id": self.execution_id, "error": str(exc)},
                    )
                unknown = True
                continue
            except GyreError as exc:
                log.warning("heartbeat failed", extra={"execution_id": self.execution_id, "error": str(exc)})
                continue
            if self._closed(reply.status):
                log.info(
                    "execution closed by the scheduler",
                    extra={"execution_id": self.execution_id, "status": self.closed_as},
                )
                return

    @property
    def cancelled_by_scheduler(self) -> bool:
        """True when the scheduler closed this execution as CANCELLED before this harness
        reported an end (see ``closed_as``)."""
        return self.closed_as == "CANCELLED" and not self._reported_cancel

    def _closed(self, status: int) -> bool:
        """Records a final status the scheduler reports; True when the execution is closed."""
        closed = ExecutionStatus.closed_from_proto(status)
        if closed is not None:
            self.closed_as = closed.value
        return closed is not None

    async def heartbeat(self) -> scheduler_pb2.HeartbeatResponse:
        """Keeps the execution alive; retried across a failover (it only pushes a deadline)."""
        request = scheduler_pb2.HeartbeatRequest(execution_id=self.execution_id)
        return await self._client.call(
            "heartbeat",
            lambda stub, t: stub.Heartbeat(request, timeout=t, metadata=self._metadata),
            self._timeout_s,
        )

    async def finish(
        self, reward: float = 0.0, status: str = "completed"
    ) -> scheduler_pb2.FinishExecutionResponse:
        """Reports the end, retried across a failover (up to the client's ``retry_s``).
        Safe to retry: the idempotency key makes repeats no-ops."""
        if status not in HARNESS_STATUSES:
            raise InvalidArgument(f"status must be one of {sorted(HARNESS_STATUSES)}")
        if status == "completed" and not math.isfinite(reward):
            raise InvalidArgument("reward must be finite")
        request = scheduler_pb2.FinishExecutionRequest(
            execution_id=self.execution_id,
            status=ExecutionStatus.from_name(status).to_proto(),
            reward=reward,
            idempotency_key=self._idempotency_key,
        )
        try:
            reply: scheduler_pb2.FinishExecutionResponse = await self._client.call(
                "finish",
                lambda stub, t: stub.FinishExecution(request, timeout=t, metadata=self._metadata),
                self._timeout_s,
            )
        except NotFound:
            if not self.closed_as:
                raise
            # The scheduler closed it (its heartbeat or a model call said so) and has since
            # archived its burst: the report is the duplicate it would have been answered as.
            reply = scheduler_pb2.FinishExecutionResponse(
                status=ExecutionStatus(self.closed_as).to_proto(), duplicate=True
            )
        self.finished = True
        self._reported_cancel = status == "cancelled" and not reply.duplicate
        self._closed(reply.status)
        if asyncio.current_task() is not self._heartbeat:
            await self.stop_heartbeats()
        return reply

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
        idempotency_key: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """One non-streaming chat completion; returns the assistant message (``content``,
        and ``tool_calls`` when the model called one of ``tools``). Append it to the history
        as it is: the router then continues the execution's tokens exactly.

        ``idempotency_key`` names the call: send a call again after Unavailable (its router
        died: sent, no answer) with the key of its first try, and the packer keeps one turn
        for it, the answer you got."""
        body = {
            "model": self.model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": temperature,
            **extra,
        }
        if tools:
            body["tools"] = list(tools)
        data = await self.post("/chat/completions", body, idempotency_key=idempotency_key)
        return dict(data["choices"][0]["message"])

    async def post(
        self, path: str, body: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """POSTs to the router's OpenAI-compatible API with this execution's token (and
        the call's ``Idempotency-Key`` when given)."""
        url = self.openai_base_url + path
        # The execution id lets the router tell "this execution's route has not arrived yet"
        # (it waits for the watch) from a token of another execution (403).
        headers = {"Authorization": f"Bearer {self.token}", "x-gyre-execution-id": self.execution_id}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        _inject_trace_context(headers)
        backoff = Backoff(0.2, 2.0)
        deadline = time.monotonic() + ROUTER_CONNECT_RETRY_S
        while True:
            try:
                async with self._http.post(url, json=body, headers=headers) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise _http_error(resp.status, text)
                    answer: dict[str, Any] = json.loads(text)
                    return answer
            except aiohttp.ClientConnectorError as exc:
                # Not connected: the request never left, so it is safe to send again (the
                # router restarting under a supervisor comes back on the same address).
                if time.monotonic() + backoff.ceiling_s > deadline:
                    raise Unavailable(
                        f"router {url} unreachable for {ROUTER_CONNECT_RETRY_S:g} s: {exc}"
                    ) from exc
                await backoff.sleep()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Sent, then lost: the router may have acted on it; the caller decides.
                raise Unavailable(f"router {url}: {type(exc).__name__}: {exc}") from exc


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
