"""One router's requests on this engine over one stream (``Engine.GenerateStream``).

A decode step gives every running request one token, so one message per token per request
costs each side a gRPC message, a proto and a task wake-up per token. Here every request a
router has on this engine shares one long-lived stream: the router sends starts and cancels,
and each engine step comes back as one :class:`EngineStep` carrying, in columns, the new
tokens of all of them.

How a step is gathered: each request runs in a task of its own that drains the engine's
stream for it (the same ``Cell.generate`` that ``Engine.Generate`` serves, so validation,
policy checks, aborts and KV handoff are the same) into one pending list; a single writer
wakes when that list becomes non-empty, lets every task woken by the same engine step run
(one loop turn), and sends whatever is pending as one message. Per request, the tokens come
in order (a tag may appear more than once in a step, in order) and its end (finish, or the
status ``Generate`` would have failed with) follows its last tokens.

A start whose tag is already running ends the call with INVALID_ARGUMENT (the two requests'
outputs could not be told apart). Cancelling a tag aborts its engine request (closing the
engine stream does, as cancelling a ``Generate`` call does); the end of the router's
request stream lets the running requests finish and then ends the call; the call's
cancellation (the router died or gave up the stream) cancels every request on it.

When the cell stops (:meth:`EngineStreamSession.drain`, at the start of its graceful
shutdown), new starts are answered UNAVAILABLE (the router continues them at another
engine), the running requests finish, and then the call ends: a stopping cell waits for its
requests, not for the router to close a stream that would otherwise stay open for the whole
grace period (every cell of a demo waited its full 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import propagate, trace

from gyre.errors import GyreError, ResourceExhausted, Unavailable, status_for
from gyre.grpcx.tagged import TaggedRequests
from gyre.telemetry import tag_execution
from gyre.tokens import Chunk
from gyre.v1 import cell_agent_pb2 as pb

log = logging.getLogger(__name__)

Start = Callable[[pb.EngineGenerateRequest], AsyncIterator[Chunk]]
"""Validates a request and starts it: the engine's chunks (raises a GyreError for bad input)."""


Answer = tuple[int, Chunk] | pb.EngineStreamEnd
"""A request's new tokens (its tag and chunk), or its end."""


class EngineStreamSession:
    """The state of one GenerateStream call: its requests in flight and what is pending
    (on :class:`gyre.grpcx.tagged.TaggedRequests`, as the router's tagged stream is)."""

    def __init__(self, start: Start, max_requests: int) -> None:
        self._start = start
        self._requests: TaggedRequests[Answer] = TaggedRequests(max_requests)
        self._draining = False

    def drain(self) -> None:
        """The cell is stopping: refuse new starts, end the call once nothing runs."""
        self._draining = True
        self._requests.close_when_idle()

    async def serve(self, requests: AsyncIterator[pb.EngineStreamRequest]) -> AsyncIterator[pb.EngineStep]:
        async def read() -> None:
            async for msg in requests:
                for start in msg.starts:
                    self._begin(start)
                for tag in msg.cancels:
                    self._requests.cancel(int(tag))

        # one_turn: the other requests woken by the same engine step join its message.
        async for answers in self._requests.serve(read, one_turn=True):
            yield _step(answers)

    def _begin(self, start: pb.EngineStreamStart) -> None:
        tag = int(start.tag)
        self._requests.check_tag(tag)  # its outputs could not be told apart: the caller is broken
        if self._draining:
            self._end(tag, error=Unavailable("the engine is stopping"))
            return
        if self._requests.full():
            self._end(
                tag,
                error=ResourceExhausted(f"more than {self._requests.max_requests} requests on one stream"),
            )
            return
        carrier = dict(start.trace_context)
        self._requests.start(tag, self._run(tag, start.request, carrier), f"engine-stream.{tag}")

    async def _run(self, tag: int, request: pb.EngineGenerateRequest, carrier: dict[str, str]) -> None:
        with _request_span(carrier):
            await self._serve(tag, request)

    async def _serve(self, tag: int, request: pb.EngineGenerateRequest) -> None:
        finish = None
        try:
            tag_execution(request.execution_id, request_id=request.request_id)
            async for chunk in self._start(request):
                # A chunk short of log-probs fails its request (INTERNAL), never the step's
                # columns: every other request's tokens stay aligned with their log-probs.
                self._requests.send((tag, chunk.check()))
                finish = chunk.finish_reason
        except asyncio.CancelledError:
            return  # cancelled by the router (nothing to send) or by the call's end
        except GyreError as exc:
            self._end(tag, error=exc)
        except Exception as exc:  # a bug fails this request, never the others on the stream
            log.exception("engine stream request crashed", extra={"request_id": request.request_id})
            self._end(tag, error=exc)
        else:
            self._end(tag, finish=finish.value if finish is not None else 0)

    def _end(self, tag: int, finish: int = 0, error: BaseException | None = None) -> None:
        if error is not None:
            code, message = status_for(error)
            self._requests.send(pb.EngineStreamEnd(tag=tag, code=code.value[0], message=message))
        else:
            self._requests.send(pb.EngineStreamEnd(tag=tag, finish_reason=finish))  # type: ignore[arg-type]


def _step(answers: list[Answer]) -> pb.EngineStep:
    """One message of the answers pending: the requests' new tokens in columns (a tag may
    appear more than once, in order), then the ends (each after its request's tokens)."""
    tags: list[int] = []
    counts: list[int] = []
    versions: list[int] = []
    ids: list[int] = []
    logprobs: list[float] = []
    ends: list[pb.EngineStreamEnd] = []
    for answer in answers:
        if isinstance(answer, pb.EngineStreamEnd):
            ends.append(answer)
            continue
        tag, chunk = answer
        n = len(chunk.token_ids)
        if not n:
            continue
        tags.append(tag)
        counts.append(n)
        versions.append(chunk.policy_version)
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)  # one per token (checked in _serve)
    return pb.EngineStep(
        tags=tags, counts=counts, policy_versions=versions, token_ids=ids, logprobs=logprobs, ends=ends
    )


def _request_span(carrier: dict[str, str]) -> AbstractContextManager[Any]:
    """A span of one request in the caller's trace (as ``Engine.Generate`` gets one per call
    from the gRPC instrumentation); nothing when the caller sent no trace context."""
    if not carrier:
        return contextlib.nullcontext()
    return trace.get_tracer(__name__).start_as_current_span(
        "gyre.v1.Engine/GenerateStream request",
        context=propagate.extract(carrier),
        kind=trace.SpanKind.SERVER,
    )
