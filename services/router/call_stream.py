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

The same shape as the packer's ClaimStream (``services/packer/claim_stream.py``), with the
answers batched per message: a router's answers arrive at the rate calls end, hundreds a
second, where a cell's claims come a few at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from gyre.errors import GyreError, InvalidArgument, ResourceExhausted, status_for
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
    """The state of one GenerateStream: its calls' tasks and the answers not yet sent."""

    def __init__(self, serve: Serve, max_calls: int) -> None:
        self._serve = serve
        self._max_calls = max_calls
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._out: list[pb.StreamAnswer] = []
        self._wake = asyncio.Event()
        self._reading = True

    async def serve(
        self, requests: AsyncIterator[pb.GenerateStreamRequest]
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        reader = asyncio.create_task(self._read(requests), name="call-stream.read")
        try:
            while True:
                if not self._out:
                    if reader.done() and reader.exception() is not None:
                        raise reader.exception()  # type: ignore[misc]  # a reused tag, a malformed message
                    if not self._reading and not self._tasks:
                        break
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                out, self._out = self._out, []
                yield pb.GenerateStreamResponse(answers=out)
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def _read(self, requests: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        try:
            async for msg in requests:
                for call in msg.calls:
                    self._begin(call)
                for tag in msg.cancels:  # after the calls: a cancel may end a call of the same message
                    task = self._tasks.pop(int(tag), None)
                    if task is not None:
                        task.cancel()
        finally:
            self._reading = False
            self._wake.set()

    def _begin(self, call: pb.StreamCall) -> None:
        tag = int(call.tag)
        if tag in self._tasks:  # the two answers could not be told apart: the caller is broken
            raise InvalidArgument(f"tag {tag} is already in flight on this stream")
        if len(self._tasks) >= self._max_calls:
            self._send(failure(tag, ResourceExhausted(f"more than {self._max_calls} calls in flight")))
            return
        run = self._run(tag, call.token, call.request, call.stream)
        self._tasks[tag] = asyncio.create_task(run, name=f"call-stream.{tag}")

    async def _run(self, tag: int, token: str, request: pb.GenerateRequest, stream: bool) -> None:
        def part(response: pb.GenerateResponse) -> None:
            self._send(pb.StreamAnswer(tag=tag, responses=[response], more=True))

        try:
            responses = await self._serve(token, request, part if stream else None)
        except asyncio.CancelledError:
            return  # cancelled by the caller, or the stream ended: nothing to send
        except GyreError as exc:
            self._send(failure(tag, exc))
        except Exception as exc:  # a bug fails this call (INTERNAL), never the others
            log.exception("call stream call crashed", extra={"tag": tag})
            self._send(failure(tag, exc))
        else:
            self._send(pb.StreamAnswer(tag=tag, responses=responses))
        finally:
            if self._tasks.get(tag) is asyncio.current_task():
                del self._tasks[tag]

    def _send(self, answer: pb.StreamAnswer) -> None:
        self._out.append(answer)
        if not self._wake.is_set():
            self._wake.set()
