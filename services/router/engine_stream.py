"""The router's engine client over ``Engine.GenerateStream``: every request this router has
on one engine shares one long-lived stream (issue 20).

Per target, one :class:`EngineStream` holds the call, a writer task that sends whatever
starts and cancels were queued since its last write as one message, and a reader task that
decodes each :class:`EngineStep` once and hands every tag its tokens as list slices of the
step's columns (one :class:`Chunk` per tag entry: no per-token Python objects). Each request
has a :class:`ChunkSink`; the reader calls it synchronously. Two ways to use it:

- :meth:`StreamEngineClient.attach` (what the call loop uses): the caller's sink gets each
  chunk and the end directly, so a token costs the router no task wake-up at all;
- :meth:`StreamEngineClient.generate`, the ``EngineClient`` interface: an async iterator
  over an :class:`_Inbox` sink that behaves like ``GrpcEngineClient.generate`` (the finish
  reason rides on the last chunk, a failed request raises its domain error, one that ends
  with neither just stops, closing it early cancels the tag).

Cancelling a tag aborts its engine request. The deadline is the router's: a timer per
request that ends it with DEADLINE_EXCEEDED and cancels the tag. A broken stream (the engine
died, the connection reset, a status error) fails every request open on it with the
stream's status as a domain error (UNAVAILABLE for a dead engine: the call loop retries
those elsewhere); the next request to that target opens a new stream. Abort, ExportKv and
ReleaseKv stay unary calls on the same channel.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from opentelemetry import propagate, trace

from gyre.config import ServiceConfig
from gyre.errors import DeadlineExceeded, GyreError, Unavailable, from_rpc_error, from_status
from gyre.tokens import Chunk, FinishReason, missing_logprobs
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc
from services.router.engine import ChunkSink, EngineRequest
from services.router.engine_client import GrpcEngineClient

log = logging.getLogger(__name__)


class _Inbox:
    """The sink behind :meth:`StreamEngineClient.generate`: chunks not yet taken, and how
    the request ended."""

    __slots__ = ("chunks", "done", "finish", "error", "version", "_waiter")

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.done = False
        self.finish: FinishReason | None = None
        self.error: BaseException | None = None
        self.version = 0
        """Policy version of the last chunk (what an end without tokens reports)."""
        self._waiter: asyncio.Future[None] | None = None

    def on_chunk(self, chunk: Chunk) -> None:
        self.version = chunk.policy_version
        self.chunks.append(chunk)
        self._wake()

    def on_end(self, finish: FinishReason | None, error: BaseException | None) -> None:
        self.done, self.finish, self.error = True, finish, error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Chunk]:
        """Waits until there are chunks or the request is over; returns the chunks."""
        while not self.chunks and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks, self.chunks = self.chunks, []
        return chunks


class EngineStream:
    """One GenerateStream call to one engine and the requests open on it."""

    def __init__(self, target: str, stub: cell_agent_pb2_grpc.EngineStub) -> None:
        self.target = target
        self._loop = asyncio.get_running_loop()
        self._call = stub.GenerateStream()
        self._tags = itertools.count(1)
        self._sinks: dict[int, ChunkSink] = {}
        self._deadlines: dict[int, asyncio.TimerHandle] = {}
        self._starts: list[pb.EngineStreamStart] = []
        self._cancels: list[int] = []
        self._queued = asyncio.Event()
        self.broken = False
        self._tasks = (
            asyncio.create_task(self._write(), name=f"engine-stream.write.{target}"),
            asyncio.create_task(self._read(), name=f"engine-stream.read.{target}"),
        )

    def start(self, request: EngineRequest, sink: ChunkSink, timeout_s: float) -> int:
        """Queues a start; ``sink`` gets its chunks and its end. Returns the request's tag."""
        tag = next(self._tags)
        self._sinks[tag] = sink
        self._deadlines[tag] = self._loop.call_later(timeout_s, self._expire, tag, request.request_id)
        start = pb.EngineStreamStart(tag=tag, request=request.to_proto())
        if trace.get_current_span().get_span_context().is_valid:  # tracing on: the engine joins it
            propagate.inject(start.trace_context)
        self._starts.append(start)
        self._queued.set()
        return tag

    def cancel(self, tag: int) -> None:
        """Stops a request that has not ended (its engine request is aborted; its sink hears
        nothing more); a no-op once it ended or the stream broke."""
        if self._sinks.pop(tag, None) is None:
            return
        self._deadlines.pop(tag).cancel()
        self._cancels.append(tag)
        self._queued.set()

    def _expire(self, tag: int, request_id: str) -> None:
        sink = self._sinks.get(tag)
        if sink is not None:
            self.cancel(tag)
            sink.on_end(None, DeadlineExceeded(f"engine request {request_id} passed its deadline"))

    async def _write(self) -> None:
        """Sends every start and cancel queued since the last write as one message."""
        try:
            while True:
                await self._queued.wait()
                self._queued.clear()
                starts, self._starts = self._starts, []
                cancels, self._cancels = self._cancels, []
                await self._call.write(pb.EngineStreamRequest(starts=starts, cancels=cancels))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            self._break(functools.partial(from_rpc_error, err))
        except Exception as exc:  # a bug here must not leave later starts unsent
            log.exception("engine stream writer crashed", extra={"target": self.target})
            why = f"engine stream to {self.target} failed: {type(exc).__name__}"
            self._break(lambda: Unavailable(why))

    async def _read(self) -> None:
        """Decodes each step once and hands every tag its slice of the columns."""
        try:
            while True:
                step = await self._call.read()
                if step is grpc.aio.EOF:
                    self._break(lambda: Unavailable(f"engine stream to {self.target} ended"))
                    return
                self._dispatch(step)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            self._break(functools.partial(from_rpc_error, err))
        except Exception as exc:  # a bug here must not leave the requests waiting forever
            log.exception("engine stream reader crashed", extra={"target": self.target})
            why = f"engine stream to {self.target} failed: {type(exc).__name__}"
            self._break(lambda: Unavailable(why))

    def _dispatch(self, step: pb.EngineStep) -> None:
        sinks = self._sinks
        ids = step.token_ids
        logprobs = step.logprobs
        if len(logprobs) != len(ids):
            # Whose tokens lack a log-prob cannot be told: every request with tokens in the
            # step fails (a failed engine attempt: the call loop retries it), none is recorded
            # with a made-up log-prob. Their sinks are gone, so their ends below are skipped.
            self._refuse(step.tags, missing_logprobs(len(ids), len(logprobs), f"engine {self.target}"))
        elif step.tags:
            pos = 0
            for tag, n, version in zip(step.tags, step.counts, step.policy_versions, strict=True):
                end = pos + n
                sink = sinks.get(tag)
                if sink is not None:  # None: cancelled by us meanwhile
                    sink.on_chunk(Chunk(ids[pos:end], logprobs[pos:end], version))
                pos = end
        for end_ in step.ends:
            sink = sinks.pop(end_.tag, None)
            if sink is None:
                continue
            self._deadlines.pop(end_.tag).cancel()
            if end_.code:
                sink.on_end(None, from_status(end_.code, end_.message))
            else:
                sink.on_end(FinishReason.from_proto(end_.finish_reason), None)

    def _refuse(self, tags: Iterable[int], error: GyreError) -> None:
        """Ends these requests with ``error`` and cancels them (their engine requests are
        aborted); the stream goes on for the others."""
        for tag in dict.fromkeys(tags):
            sink = self._sinks.get(tag)
            if sink is not None:
                self.cancel(tag)
                sink.on_end(None, error)
        log.error("engine step refused", extra={"target": self.target, "error": str(error)})

    def _break(self, error: Callable[[], GyreError]) -> None:
        """Fails every open request (each with its own error instance), ends the call and the
        other task; the client opens a new stream for the next request."""
        if self.broken:
            return
        self.broken = True
        sinks, self._sinks = self._sinks, {}
        for deadline in self._deadlines.values():
            deadline.cancel()
        self._deadlines.clear()
        for sink in sinks.values():
            sink.on_end(None, error())
        if sinks:
            log.warning("engine stream broke", extra={"target": self.target, "requests": len(sinks)})
        self._call.cancel()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        self._break(lambda: Unavailable(f"engine stream to {self.target} closed"))
        await asyncio.gather(*self._tasks, return_exceptions=True)


class StreamEngineClient(GrpcEngineClient):
    """Engine calls with generate over one GenerateStream per target (opened lazily, reopened
    after it broke); the unary calls and channels are :class:`GrpcEngineClient`'s."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self._streams: dict[str, EngineStream] = {}

    def _stream(self, target: str) -> EngineStream:
        stream = self._streams.get(target)
        if stream is None or stream.broken:  # a broken one already ended its call and tasks
            stream = self._streams[target] = EngineStream(target, self._stub(target))
        return stream

    def attach(
        self, target: str, request: EngineRequest, timeout_s: float, sink: ChunkSink
    ) -> Callable[[], None]:
        """Starts ``request``; the stream's reader hands ``sink`` each chunk and the end.
        Returns the detach: it cancels the request unless it already ended."""
        stream = self._stream(target)
        return functools.partial(stream.cancel, stream.start(request, sink, timeout_s))

    async def generate(self, target: str, request: EngineRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        inbox = _Inbox()
        detach = self.attach(target, request, timeout_s, inbox)
        try:
            while True:
                chunks = await inbox.take()
                if inbox.done:
                    break
                for chunk in chunks:
                    yield chunk
            if inbox.error is not None:
                for chunk in chunks:
                    yield chunk
                raise inbox.error
            if inbox.finish is not None:
                if chunks:
                    chunks[-1].finish_reason = inbox.finish
                else:
                    chunks.append(Chunk([], [], inbox.version, inbox.finish))
            for chunk in chunks:
                yield chunk
        finally:
            detach()  # a no-op when it ended; aborts the engine request otherwise

    async def close(self) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        await asyncio.gather(*(s.close() for s in streams))
        await super().close()
