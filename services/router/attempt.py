"""A model call's side of the engines: one attempt at one engine (:class:`Attempt`) and
the operations around it (:class:`CallEngine`): starting an attempt (attached to the engine
client's reader, or a pump task reading the engine's stream), the idle watchdog, stopping
and aborting it, and a move's KV hand-off (the export at the source, the release of the
source's blocks once the destination took over, or never did).

An attempt takes each chunk into its :class:`~services.router.calls.ModelCall` (which cuts
the output at stop tokens, stop strings and ``max_tokens`` and hands it on) and wakes the
call's loop when it ended or the call must move; what comes next (done, a move, a retry on
another engine) is the call's to decide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from gyre.errors import GyreError, Unavailable
from gyre.tokens import Chunk, FinishReason
from services.router.engine import EngineClient, EngineRequest, KvHandle
from services.router.routes import Route

if TYPE_CHECKING:
    from services.router.calls import CallPolicy, ModelCall, RouterStats

log = logging.getLogger(__name__)


class CallEngine:
    """What a model call does at the engines: start an attempt, stop and abort it, export a
    moving attempt's KV blocks, release them. Aborts and releases run in the background
    (``background``), so an engine that is gone never holds the call up."""

    def __init__(
        self,
        engines: EngineClient,
        policy: CallPolicy,
        stats: RouterStats,
        background: Callable[[Any], None],
    ) -> None:
        self._engines = engines
        self._policy = policy
        self._stats = stats
        self._background = background

    @property
    def idle_s(self) -> float:
        """How long an engine may stay silent before its attempt fails."""
        return self._policy.engine_idle_timeout_s

    def start(
        self,
        call: ModelCall,
        route: Route,
        request: EngineRequest,
        kv: tuple[KvHandle, str] | None,
        deadline: float,
    ) -> Attempt:
        """Starts one attempt of ``call`` at ``route``: the engine client's reader hands it
        each chunk (a client that can ``attach``), or a pump task reads the engine's stream.
        An engine silent for ``engine_idle_timeout_s`` fails the attempt (a watchdog timer,
        re-armed lazily, not per chunk)."""
        loop = asyncio.get_running_loop()
        attempt = Attempt(call, self, loop, kv, route.target)
        timeout_s = max(0.001, deadline - loop.time())
        attach = getattr(self._engines, "attach", None)
        if attach is None:
            attempt.iterate(self._engines.generate(route.target, request, timeout_s), request.request_id)
            return attempt
        try:
            attempt.detach = attach(route.target, request, timeout_s, attempt)
        except Exception as exc:  # the engine client refused it: a failed attempt
            attempt.on_end(None, exc)
        return attempt

    async def stop(self, attempt: Attempt, route: Route, request: EngineRequest) -> None:
        """Stops an attempt (detaching or closing its stream cancels the engine call) and
        aborts it."""
        self.abort(route, request)
        await attempt.close()

    def abort(self, route: Route, request: EngineRequest) -> None:
        self._stats.aborts_sent += 1
        self._background(self._send_abort(route.target, request.request_id))

    async def _send_abort(self, target: str, request_id: str) -> None:
        try:
            await self._engines.abort(target, request_id, self._policy.abort_timeout_s)
        except GyreError as exc:  # the engine may be gone; cancelling the stream sufficed
            log.info("abort failed", extra={"target": target, "request_id": request_id, "error": str(exc)})

    async def export(self, route: Route, request: EngineRequest) -> KvHandle | None:
        try:
            async with asyncio.timeout(self._policy.kv_timeout_s):
                return await self._engines.export_kv(
                    route.target, request.request_id, self._policy.kv_timeout_s
                )
        except (GyreError, TimeoutError) as exc:  # timeout or no support: the destination recomputes
            log.info("kv export failed; recomputing", extra={"target": route.target, "error": str(exc)})
            return None

    def handed_off(self, kv: tuple[KvHandle, str]) -> None:
        """The destination took over: counts the hand-off, releases the source's blocks."""
        self._stats.kv_handoffs += 1
        self.release(kv)

    def release(self, kv: tuple[KvHandle, str]) -> None:
        self._background(self._release(kv))

    async def _release(self, kv: tuple[KvHandle, str]) -> None:
        handle, target = kv
        try:
            await self._engines.release_kv(target, handle.handle_id, self._policy.kv_timeout_s)
        except GyreError as exc:
            log.info("kv release failed", extra={"target": target, "error": str(exc)})


class Attempt:
    """One attempt's side of the engine: takes its chunks into the call, and wakes the call's
    loop (:attr:`woken`, one future) when the attempt ended or the call must move.

    With an engine client that can *attach* (``attach(target, request, timeout_s, sink)``,
    the router's GenerateStream client), the engine's reader hands each chunk to
    :meth:`on_chunk` synchronously and :meth:`on_end` once, so a token costs the router no
    task wake-up and no iterator step, and the attempt no task at all. Otherwise
    :meth:`iterate` starts a pump task reading the engine's stream of chunks (one Generate
    call per request).
    """

    __slots__ = (
        "call",
        "engine",
        "loop",
        "kv",
        "first",
        "last",
        "woken",
        "ended",
        "finish",
        "error",
        "detach",
        "_pump",
        "_idle_s",
        "_target",
        "_dog",
    )

    def __init__(
        self,
        call: ModelCall,
        engine: CallEngine,
        loop: asyncio.AbstractEventLoop,
        kv: tuple[KvHandle, str] | None,
        target: str,
    ) -> None:
        self.call = call
        self.engine = engine
        self.loop = loop
        self.kv = kv
        self.first = True
        self.last = loop.time()
        """When the engine last sent something (the watchdog reads it)."""
        self.woken: asyncio.Future[None] = loop.create_future()
        self.ended = False
        self.finish: FinishReason | None = None
        self.error: BaseException | None = None
        self.detach: Callable[[], None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._idle_s = idle_s = engine.idle_s
        self._target = target
        self._dog: asyncio.TimerHandle | None = loop.call_at(self.last + idle_s, self._watch)

    def wake_up(self) -> None:
        """Wakes the call's loop (the attempt ended, or the call must move)."""
        if not self.woken.done():
            self.woken.set_result(None)

    def _end(self, finish: FinishReason | None, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended, self.finish, self.error = True, finish, error
        if self._dog is not None:
            self._dog.cancel()
            self._dog = None
        self.wake_up()

    def _watch(self) -> None:
        """The watchdog: an engine silent for ``idle_s`` fails the attempt."""
        if self.loop.time() - self.last >= self._idle_s:
            self._dog = None
            self._end(None, Unavailable(f"engine at {self._target} sent nothing for {self._idle_s}s"))
        else:
            self._dog = self.loop.call_at(self.last + self._idle_s, self._watch)

    def _arrived(self) -> None:
        self.last = self.loop.time()
        if self.first:
            self.first = False
            if self.kv is not None:  # the destination took over: release the source's blocks
                self.engine.handed_off(self.kv)

    def iterate(self, stream: AsyncIterator[Chunk], name: str) -> None:
        async def pump() -> None:
            try:
                async for chunk in stream:
                    self.on_chunk(chunk)
                    if self.ended:
                        return
                self._end(None, None)  # the stream ended without a finish: it stopped early
            except Exception as exc:  # a domain error, or a bug: the attempt failed
                self._end(None, exc)
            finally:
                await _aclose(stream)

        self._pump = asyncio.create_task(pump(), name=f"pump.{name}")

    def on_chunk(self, chunk: Chunk) -> None:
        if self.ended:
            return  # the call already had what it needs (a stop token, max_tokens)
        self._arrived()
        try:
            finish = self.call.take(chunk)
        except Exception as exc:  # a bug must fail this call, not the engine's reader
            self._end(None, exc)
            return
        if finish is not None:
            self._end(finish, None)

    def on_end(self, finish: FinishReason | None, error: BaseException | None) -> None:
        """The engine ended the request: ``finish`` (its last tokens came before), ``error``,
        or neither (it stopped early: a failure the call retries)."""
        if finish is not None and error is None:
            versions = self.call.policy_versions
            self.on_chunk(Chunk([], [], versions[-1] if versions else 0, finish))
        self._end(None, error)

    async def close(self) -> None:
        """Stops what still runs: the watchdog, the engine request (detach, a no-op once
        the engine ended it), the pump; releases a KV hand-off the destination never
        took."""
        if self._dog is not None:
            self._dog.cancel()
            self._dog = None
        if self.detach is not None:
            detach, self.detach = self.detach, None
            detach()
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
            self._pump = None
        if self.first and self.kv is not None:
            kv, self.kv = self.kv, None
            self.engine.release(kv)  # the destination never took over


async def _aclose(stream: AsyncIterator[Chunk]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
