"""Model calls of many executions over one ``Router.GenerateStream`` (harness side).

For a harness process that runs many executions at once (a rollout worker, the cluster
emulator): every call goes on one long-lived stream instead of a gRPC call of its own, each
answered once with its whole output. Calls made between two writes go out as one message,
and the router answers calls that end together in one message, so a model call costs a
few hundred bytes on a stream instead of a call's frames, TLS records and objects at both
ends (docs/benchmarks/router.md).

:meth:`RouterStream.generate_stream` streams a call's tokens instead, as ``Generate`` does.
A call whose stream breaks fails UNAVAILABLE, like a ``Generate`` call whose router died;
send it again with the same ``idempotency_key`` (the next call opens a new stream, at
whichever router the channel reaches). Cancelling the awaiting task cancels the call at
the router (its engine request is aborted).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from gyre.errors import GyreError, Unavailable, from_rpc_error, from_status
from gyre.v1 import router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)


class RouterStream:
    """One GenerateStream on ``channel`` (opened at the first call, reopened after it broke)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._stub = router_pb2_grpc.RouterStub(channel)  # type: ignore[no-untyped-call]  # generated
        self._metadata = tuple(metadata)
        self._tags = itertools.count(1)
        self._call: Any = None
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        self._waiting: dict[int, asyncio.Future[list[router_pb2.GenerateResponse]]] = {}
        self._streaming: dict[int, asyncio.Queue[list[router_pb2.GenerateResponse] | GyreError | None]] = {}
        self._calls: list[router_pb2.StreamCall] = []
        self._cancels: list[int] = []
        self._queued = asyncio.Event()
        self._closed = False
        self.streams = 0
        """Streams opened so far (1 unless one broke)."""

    async def generate(
        self, token: str, request: router_pb2.GenerateRequest
    ) -> list[router_pb2.GenerateResponse]:
        """One model call of the execution ``token`` belongs to, answered once: its responses
        (one per policy version its tokens came from). Raises the GyreError ``Generate``
        would have ended with; Unavailable when the stream broke first."""
        self._open()
        tag = next(self._tags)
        done: asyncio.Future[list[router_pb2.GenerateResponse]] = asyncio.get_running_loop().create_future()
        self._waiting[tag] = done
        self._calls.append(router_pb2.StreamCall(tag=tag, token=token, request=request))
        self._queued.set()
        try:
            return await done
        except asyncio.CancelledError:
            if tag in self._waiting:
                self._forget(tag)
            raise

    async def generate_stream(
        self, token: str, request: router_pb2.GenerateRequest
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """One model call, streamed: its responses as the router sends them (coalesced as
        ``Generate``'s messages are; the last carries the finish reason). Raises as
        :meth:`generate`; closing the iterator early cancels the call at the router."""
        self._open()
        tag = next(self._tags)
        inbox: asyncio.Queue[list[router_pb2.GenerateResponse] | GyreError | None] = asyncio.Queue()
        self._streaming[tag] = inbox
        self._calls.append(router_pb2.StreamCall(tag=tag, token=token, request=request, stream=True))
        self._queued.set()
        ended = False
        try:
            while True:
                item = await inbox.get()
                if item is None:
                    ended = True
                    return
                if isinstance(item, GyreError):
                    ended = True
                    raise item
                for response in item:
                    yield response
        finally:
            if not ended:
                self._forget(tag)

    def _forget(self, tag: int) -> None:
        """A call its caller gave up: never sent, or cancelled at the router."""
        self._waiting.pop(tag, None)
        self._streaming.pop(tag, None)
        if self._call is None:
            return  # the stream broke: the router ended its calls
        unsent = [c for c in self._calls if c.tag != tag]
        if len(unsent) < len(self._calls):
            self._calls = unsent  # not written yet: it never reaches the router
        else:
            self._cancels.append(tag)
            self._queued.set()

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._streaming)

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("the RouterStream is closed")
        if self._call is not None:
            return
        self._call = self._stub.GenerateStream(metadata=self._metadata)
        self.streams += 1
        self._tasks = (
            asyncio.create_task(self._write(self._call), name="router-stream.write"),
            asyncio.create_task(self._read(self._call), name="router-stream.read"),
        )

    async def _write(self, call: Any) -> None:
        try:
            while True:
                await self._queued.wait()
                self._queued.clear()
                calls, self._calls = self._calls, []
                cancels, self._cancels = self._cancels, []
                await call.write(router_pb2.GenerateStreamRequest(calls=calls, cancels=cancels))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            self._broke(call, from_rpc_error(err))
        except Exception as exc:  # a write on a call that ended (its reader says why)
            self._broke(call, Unavailable(f"router stream failed: {type(exc).__name__}: {exc}"))

    async def _read(self, call: Any) -> None:
        error: GyreError = Unavailable("router stream ended")
        try:
            async for message in call:
                for answer in message.answers:
                    inbox = self._streaming.get(answer.tag)
                    if inbox is not None:
                        if answer.code:
                            del self._streaming[answer.tag]
                            inbox.put_nowait(from_status(answer.code, answer.message))
                            continue
                        inbox.put_nowait(list(answer.responses))
                        if not answer.more:
                            del self._streaming[answer.tag]
                            inbox.put_nowait(None)
                        continue
                    done = self._waiting.pop(answer.tag, None)
                    if done is None or done.done():
                        continue  # cancelled meanwhile
                    if answer.code:
                        done.set_exception(from_status(answer.code, answer.message))
                    else:
                        done.set_result(list(answer.responses))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err)
        self._broke(call, error)

    def _broke(self, call: Any, error: GyreError) -> None:
        """The stream ended: its calls fail with ``error`` (each with its own copy); the next
        call opens a new stream."""
        if self._call is not call:
            return
        self._call = None
        waiting, self._waiting = self._waiting, {}
        streaming, self._streaming = self._streaming, {}
        self._calls, self._cancels = [], []
        for done in waiting.values():
            if not done.done():
                done.set_exception(copy.copy(error))
        for inbox in streaming.values():
            inbox.put_nowait(copy.copy(error))
        if waiting or streaming:
            log.warning(
                "router stream broke", extra={"calls": len(waiting) + len(streaming), "error": str(error)}
            )
        call.cancel()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        """Ends the stream (calls still waiting fail Unavailable); no call may follow."""
        self._closed = True
        call, tasks = self._call, self._tasks
        if call is not None:
            self._broke(call, Unavailable("router stream closed"))
        await asyncio.gather(*tasks, return_exceptions=True)
