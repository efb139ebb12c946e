"""Many model calls of one harness process over one stream (``Router.GenerateStream``).

A gRPC call costs the router about as much CPU as the 32 tokens a short model call relays
(its HTTP/2 frames, TLS records, call object and task, the access guard: profiled in
docs/benchmarks/router.md), so a harness process that runs many executions may send every
call on one stream instead, each with a tag of its own and its execution's token; a call
is answered once with its whole output (``answer_once``), or streamed (``StreamCall.stream``:
partial answers as ``Generate``'s messages would come, then the last), or with the status
``Generate`` would have ended with; answers that are ready together go out as one message.

Each call runs in a task of its own through the same code ``Generate`` runs (the servicer
passes it in): the token is checked against the call's execution per call (the caller's
role was checked when the stream opened), and a refused call is answered with its status
while the stream goes on. At most ``max_calls`` are in flight: one beyond is answered
RESOURCE_EXHAUSTED. A cancel ends a call without an answer (the call manager aborts its
engine request). A tag reused while its call is in flight ends the stream with
INVALID_ARGUMENT (the two answers could not be told apart), as a message that does not
parse does. The end of the harness's request stream lets the calls in flight finish, then
ends the stream; the stream's cancellation cancels them.

It runs on :class:`gyre.grpcx.tagged.TaggedRequests`, as the engine's stream does, with the
answers batched per message: a router's answers arrive at the rate calls end, hundreds a
second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from gyre.errors import GyreError, ResourceExhausted, status_for
from gyre.grpcx.tagged import TaggedRequests
from gyre.v1 import router_pb2 as pb

log = logging.getLogger(__name__)

Part = Callable[[pb.GenerateResponse], None]
"""Sends a streamed call's partial answer."""

Serve = Callable[[str, pb.GenerateRequest, Part | None], Awaitable[list[pb.GenerateResponse]]]
"""Serves one call as ``Generate`` does, given the execution's token: answered once (no
``Part``), or streamed (every response but the last through ``Part``); returns the
responses of its last answer, or raises a GyreError."""


def failure(tag: int, error: BaseException) -> pb.StreamAnswer:
    """The answer to call ``tag`` that failed with ``error``: Generate's status."""
    code, message = status_for(error)
    return pb.StreamAnswer(tag=tag, code=code.value[0], message=message)


class CallStreamSession:
    """The state of one GenerateStream: its calls in flight and the answers not yet sent."""

    def __init__(self, serve: Serve, max_calls: int) -> None:
        self._serve = serve
        self._calls: TaggedRequests[pb.StreamAnswer] = TaggedRequests(max_calls)

    async def serve(
        self, requests: AsyncIterator[pb.GenerateStreamRequest]
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async def read() -> None:
            async for msg in requests:
                for call in msg.calls:
                    self._begin(call)
                for tag in msg.cancels:  # after the calls: a cancel may end a call of the same message
                    self._calls.cancel(int(tag))

        async for answers in self._calls.serve(read):
            yield pb.GenerateStreamResponse(answers=answers)

    @property
    def in_flight(self) -> int:
        return self._calls.in_flight

    def _begin(self, call: pb.StreamCall) -> None:
        tag = int(call.tag)
        self._calls.check_tag(tag)
        if self._calls.full():
            self._calls.send(
                failure(tag, ResourceExhausted(f"more than {self._calls.max_requests} calls in flight"))
            )
            return
        self._calls.start(tag, self._run(tag, call.token, call.request, call.stream), f"call-stream.{tag}")

    async def _run(self, tag: int, token: str, request: pb.GenerateRequest, stream: bool) -> None:
        def part(response: pb.GenerateResponse) -> None:
            self._calls.send(pb.StreamAnswer(tag=tag, responses=[response], more=True))

        try:
            responses = await self._serve(token, request, part if stream else None)
        except asyncio.CancelledError:
            return  # cancelled by the caller, or the stream ended: nothing to send
        except GyreError as exc:
            self._calls.send(failure(tag, exc))
        except Exception as exc:  # a bug fails this call (INTERNAL), never the others
            log.exception("call stream call crashed", extra={"tag": tag})
            self._calls.send(failure(tag, exc))
        else:
            self._calls.send(pb.StreamAnswer(tag=tag, responses=responses))
