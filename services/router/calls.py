"""One model call and its continuation across engines: the attempt loop that moves a live
stream to a new route (a scheduler move, or an engine that died) as prompt + tokens already
generated with the remaining budget, so the harness sees one unbroken response.

Pure asyncio: the engine is behind :class:`~services.router.engine.EngineClient` and routes
come from a :class:`~services.router.routes.RouteTable`. The loop is:

1. read the execution's current route; start an attempt (:mod:`services.router.attempt`:
   the engine client's reader hands it each chunk, or, for a client that only streams, a
   *pump* task reads the stream; each chunk is appended to the call's output and handed to
   the consumer through an :class:`~services.router.outbox.Outbox`);
2. wait for the attempt to end or for a move (one future: no task of its own);
3. on a move: optionally export the KV blocks at the source, stop the attempt, abort the
   source request, and go to 1 (a move costs no retry budget);
4. on an engine failure: spend one unit of retry budget, report the engine to the scheduler
   (which probes it and, if it is dead, moves the route within about a second), hold the
   call open up to ``failover_wait_s`` for the move (no longer once the scheduler answered
   that the engine lives), then go to 1; past the budget, fail cleanly.

A call answered once (``whole``) runs in its caller's task; a streamed one runs in a task
of its own while the caller takes its chunks.

Tokens are appended to the call's output by the attempt only, on the one event loop, so the
continuation prompt is exactly prompt + what the harness has been (or will be) given: no
token is duplicated or lost. An HTTP call also carries an :class:`OutputText` (its text and
stop strings): a stop string ends the call here, at the token that completed it, so the
text and the recorded tokens are cut at the same place and the engine request is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from gyre.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    GyreError,
    InvalidArgument,
    Unavailable,
)
from gyre.failpoints import failpoint
from gyre.tokens import Chunk, FinishReason
from services.router.attempt import Attempt, CallEngine
from services.router.engine import EngineClient, EngineRequest, KvHandle, Sampling
from services.router.outbox import Outbox
from services.router.routes import Route, RouteTable, closed_error
from services.router.stops import OutputText

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallPolicy:
    """How a call reacts to moves and failures (from RouterConfig)."""

    retry_budget: int = 2
    failover_wait_s: float = 12.0
    engine_idle_timeout_s: float = 30.0
    abort_timeout_s: float = 0.5
    kv_handoff: bool = False
    kv_timeout_s: float = 1.0
    coalesce_s: float = 0.0
    turn_record_wait_s: float = 0.0  # a completed call ends once its turn is recorded (bounded)
    rebuild_wait_s: float = 30.0  # a call waits this long at most for the packer's GetTrajectory


@dataclasses.dataclass(kw_only=True)
class RouterStats:
    """Counters of one router process (GetRouterStatus)."""

    inflight: int = 0
    reroutes: int = 0
    moves: int = 0
    engine_failures: int = 0
    failed_calls: int = 0
    turn_records: int = 0
    turn_records_dropped: int = 0
    kv_handoffs: int = 0
    kv_recomputes: int = 0
    aborts_sent: int = 0
    closed_calls: int = 0
    """Calls ended because their execution closed under them (e.g. cancelled by the scheduler)."""


_RETRYABLE = (Unavailable, DeadlineExceeded, FailedPrecondition)


class ModelCall:
    """One model call of an execution; iterate :meth:`stream` once to run it."""

    def __init__(
        self,
        *,
        call_id: str,
        execution_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        routes: RouteTable,
        engines: EngineClient,
        policy: CallPolicy,
        stats: RouterStats,
        deadline: float,
        background: Callable[[Any], None],
        output_text: OutputText | None = None,
        report: Callable[[str, str, str], asyncio.Future[bool | None]] | None = None,
        whole: bool = False,
    ) -> None:
        self.call_id = call_id
        self.execution_id = execution_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.policy_versions: list[int] = []
        self.reroutes = 0
        self.failures = 0
        self.attempts = 0
        self.finish: FinishReason | None = None
        self.route: Route | None = None
        """The route of the attempt running now (None between attempts)."""
        self.cells_visited: list[str] = []
        """The cell of every attempt so far, in order."""
        self._routes = routes
        self._engine = CallEngine(engines, policy, stats, background)
        self._policy = policy
        self._stats = stats
        self._deadline = deadline
        self._report = report
        self._stops = frozenset(sampling.stop_token_ids)
        self._whole = whole  # the caller wants the whole answer: run and answer at the end
        self._version = 0
        """The policy version of the last engine chunk taken (an empty answer's)."""
        self.output_text = output_text
        self.trajectory: Any = None
        """The execution's trajectory this call produced, once it completed (the manager's)."""
        self._attempt: Attempt | None = None
        """The attempt running now (set with ``route``)."""
        self._closed = False
        self._route_changed = asyncio.Event()
        self._move_waiters: list[asyncio.Future[None]] = []
        self._out = Outbox()
        self._started = False
        self._runner: asyncio.Task[None] | None = None

    # Control ---------------------------------------------------------------------------

    def request_move(self) -> asyncio.Future[None] | None:
        """The execution's route changed: moves the running attempt if it is at a stale
        engine, and wakes a call waiting for a route after an engine failure.

        Returns a future resolved once the source attempt is stopped (cancelled and its
        abort sent), or None when the call is not at a stale route.
        """
        self._route_changed.set()
        route, current = self.route, self._routes.get(self.execution_id)
        if (
            route is None
            or current is None
            or (current.cell_id == route.cell_id and current.target == route.target)
        ):
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._move_waiters.append(fut)
        if self._attempt is not None:
            self._attempt.wake_up()
        return fut

    def end_execution(self) -> None:
        """The execution closed (its route was deleted: finished, timed out, or cancelled by
        the scheduler): the running attempt stops at once (its engine request aborted) and
        the call fails with FAILED_PRECONDITION (HTTP 409) naming the closed execution."""
        self._closed = True
        self._route_changed.set()
        if self._attempt is not None:
            self._attempt.wake_up()

    @property
    def at_cell(self) -> str:
        return self.route.cell_id if self.route is not None else ""

    # The harness side --------------------------------------------------------------------

    async def stream(self) -> AsyncIterator[Chunk]:
        """Yields coalesced chunks; the last one carries the finish reason. Raises a
        GyreError when the call cannot complete. Closing or cancelling the iterator aborts
        the engine request."""
        if self._started:
            raise RuntimeError("ModelCall.stream() runs once")
        self._started = True
        if self._whole:  # nothing to hand out before the end: run in the caller's task
            await self._run()
            self._out.raise_failure()
            for chunk in self._answer():
                yield chunk
            return
        self._runner = asyncio.create_task(self._run(), name=f"call.{self.call_id}")
        try:
            coalesce_s = self._policy.coalesce_s
            while (merged := await self._out.next(coalesce_s)) is not None:
                yield merged
        finally:
            if not self._runner.done():
                self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    def _answer(self) -> list[Chunk]:
        """A whole call's answer: its output, one chunk per run of one policy version (one
        chunk unless a move crossed a weight update); the last carries the finish reason and
        the text."""
        ids, logprobs, versions = self.output_ids, self.logprobs, self.policy_versions
        chunks: list[Chunk] = []
        if ids and versions[0] == versions[-1]:
            chunks.append(Chunk(list(ids), list(logprobs), versions[0]))
        else:
            start = 0
            for i in range(1, len(ids) + 1):
                if i == len(ids) or versions[i] != versions[start]:
                    chunks.append(Chunk(ids[start:i], logprobs[start:i], versions[start]))
                    start = i
        if not chunks:
            chunks.append(Chunk([], [], self._version))
        chunks[-1].finish_reason = self.finish
        if self.output_text is not None:
            chunks[-1].text = self.output_text.take(finished=True)
        return chunks

    # The attempt loop --------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            async with asyncio.timeout_at(self._deadline):
                await self._attempts()
            self._out.end()
        except TimeoutError:
            self._stats.failed_calls += 1
            self._out.fail(DeadlineExceeded(f"model call {self.call_id} passed its deadline"))
        except GyreError as exc:
            self._stats.failed_calls += 1
            self._out.fail(exc)
        except Exception as exc:  # a bug must end the call cleanly, never hang the harness
            log.exception("model call crashed", extra={"execution_id": self.execution_id})
            self._stats.failed_calls += 1
            self._out.fail(GyreError(f"internal error: {type(exc).__name__}"))
        finally:
            self.route, self._attempt = None, None
            self._resolve_move_waiters()

    async def _attempts(self) -> None:
        kv: tuple[KvHandle, str] | None = None  # handle + source target, for the next attempt
        while True:
            if self._complete():
                return
            route = self._routes.get(self.execution_id)
            if self._closed:
                raise self._closed_error()
            if route is None:
                raise Unavailable(
                    f"execution {self.execution_id} has no route (closed, or no engine can take it)"
                )
            request = self._next_request(kv[0] if kv else None)
            if self.attempts > 1 and kv is None:
                self._stats.kv_recomputes += 1
            self._resolve_move_waiters()  # the previous attempt, if any, is stopped
            attempt = self._engine.start(self, route, request, kv, self._deadline)
            self.route, self._attempt = route, attempt
            self.cells_visited.append(route.cell_id)
            kv = None
            try:
                await attempt.woken
            except asyncio.CancelledError:
                await self._engine.stop(attempt, route, request)
                raise
            if attempt.ended:
                await attempt.close()
                if attempt.error is None and attempt.finish in (FinishReason.STOP, FinishReason.LENGTH):
                    return
                self.route, self._attempt = None, None
                if self._closed:
                    raise self._closed_error()
                await self._failed(route, request, attempt.error)
                continue
            if self._closed:
                await self._engine.stop(attempt, route, request)
                self.route, self._attempt = None, None
                raise self._closed_error()
            # A move: 3. export (optional), stop the source, continue at the new route.
            self._stats.moves += 1
            self.reroutes += 1
            self._stats.reroutes += 1
            if self._policy.kv_handoff:
                handle = await self._engine.export(route, request)
                kv = (handle, route.target) if handle is not None else None
            await self._engine.stop(attempt, route, request)
            failpoint("router.move.stopped")  # the source attempt stopped, the continuation not started
            self.route, self._attempt = None, None
            self._resolve_move_waiters()

    def _closed_error(self) -> FailedPrecondition:
        self._stats.closed_calls += 1
        return closed_error(self.execution_id)

    def _complete(self) -> bool:
        """True (and emits the final chunk) when the output is already complete."""
        if self.output_ids and self.output_ids[-1] in self.sampling.stop_token_ids:
            self.finish = FinishReason.STOP
        elif len(self.output_ids) >= self.sampling.max_tokens:
            self.finish = FinishReason.LENGTH
        else:
            return False
        if self._whole:
            return True  # the answer is built from the output at the end (_answer)
        version = self.policy_versions[-1] if self.policy_versions else 0
        text = self.output_text.take(finished=True) if self.output_text is not None else ""
        self._out.put(Chunk([], [], version, self.finish, text))
        return True

    def _next_request(self, kv_handle: KvHandle | None) -> EngineRequest:
        self.attempts += 1
        remaining = self.sampling.max_tokens - len(self.output_ids)
        return EngineRequest(
            request_id=f"{self.call_id}.{self.attempts}",
            execution_id=self.execution_id,
            prompt_token_ids=tuple(self.prompt_token_ids + self.output_ids),
            sampling=dataclasses.replace(self.sampling, max_tokens=remaining),
            # A continuation must be served by the policy that produced the tokens so far.
            required_policy_version=self.policy_versions[-1] if self.policy_versions else 0,
            kv_handle=kv_handle,
        )

    def take(self, chunk: Chunk) -> FinishReason | None:
        """Appends an engine chunk to the output and hands it to the consumer. A chunk
        without a log-prob per token raises Internal (the attempt failed: nothing of it is
        taken, and the turn is never recorded with a made-up log-prob)."""
        chunk.check()
        room = self.sampling.max_tokens - len(self.output_ids)
        ids, logprobs = chunk.token_ids, chunk.logprobs
        if len(ids) > room:
            ids, logprobs = ids[:room], logprobs[:room]
        finish = chunk.finish_reason
        if self._stops and not self._stops.isdisjoint(ids):
            for i, tok in enumerate(ids):
                if tok in self._stops:  # nothing after a stop token
                    ids, logprobs, finish = ids[: i + 1], logprobs[: i + 1], FinishReason.STOP
                    break
        elif len(self.output_ids) + len(ids) >= self.sampling.max_tokens:
            finish = FinishReason.LENGTH
        if self.output_text is not None and ids:
            kept = self.output_text.push(ids)
            if self.output_text.stop_reason is not None:  # a stop string completed
                ids, logprobs, finish = ids[:kept], logprobs[:kept], FinishReason.STOP
        if finish is FinishReason.ABORT:
            # The engine gave the request up (draining): keep its tokens, continue elsewhere.
            self._commit(ids, logprobs, chunk.policy_version, None)
            return FinishReason.ABORT
        self._commit(ids, logprobs, chunk.policy_version, finish)
        return finish

    def _commit(
        self, ids: list[int], logprobs: list[float], version: int, finish: FinishReason | None
    ) -> None:
        if not ids and finish is None:
            return
        self.output_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.policy_versions.extend([version] * len(ids))
        self._version = version
        if finish is not None:
            self.finish = finish
        if self._whole:
            return  # the answer is built from the output at the end (_answer)
        text = self.output_text.take(finished=finish is not None) if self.output_text is not None else ""
        self._out.put(Chunk(ids, logprobs, version, finish, text))

    @property
    def text(self) -> str:
        """The output text so far (HTTP calls), stop strings applied."""
        return self.output_text.text if self.output_text is not None else ""

    async def _failed(self, route: Route, request: EngineRequest, exc: BaseException | None) -> None:
        """4. An attempt ended without finishing: spend budget, wait for a move, retry."""
        if isinstance(exc, InvalidArgument):
            raise exc  # the request itself is bad; no engine will take it
        if exc is not None and not isinstance(exc, _RETRYABLE) and not isinstance(exc, GyreError):
            raise exc
        self._engine.abort(route, request)
        self.failures += 1
        self._stats.engine_failures += 1
        reason = f"{exc}" if exc is not None else "stream ended early"
        log.warning(
            "engine attempt failed",
            extra={
                "execution_id": self.execution_id,
                "cell_id": route.cell_id,
                "error": reason,
                "failures": self.failures,
            },
        )
        if self.failures > self._policy.retry_budget:
            raise Unavailable(
                f"model call failed after {self.failures} engine failure(s) "
                f"(retry budget {self._policy.retry_budget}): {reason}"
            )
        verdict = None
        if self._report is not None and exc is not None:
            verdict = self._report(route.cell_id, route.target, reason)
            verdict.add_done_callback(lambda _f: self._route_changed.set())
        await self._wait_route_change(route, self._policy.failover_wait_s, verdict)
        self.reroutes += 1
        self._stats.reroutes += 1

    async def _wait_route_change(
        self, old: Route, timeout_s: float, verdict: asyncio.Future[bool | None] | None = None
    ) -> None:
        """Until the execution's route changes, ``timeout_s`` passes, or the scheduler
        answers that the engine is not dead (retry there at once)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while loop.time() < until:
            current = self._routes.get(self.execution_id)
            if (
                current is None
                or current.epoch != old.epoch
                or current.created_revision != old.created_revision
            ):
                return
            if (
                verdict is not None
                and verdict.done()
                and not verdict.cancelled()
                and verdict.result() is False
            ):
                return
            self._route_changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(until):
                    await self._route_changed.wait()

    def _resolve_move_waiters(self) -> None:
        waiters, self._move_waiters = self._move_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
