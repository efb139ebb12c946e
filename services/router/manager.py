"""The calls in flight: creates model calls, finds the ones a route change or a scheduler
move concerns, numbers each execution's turns, keeps each execution's trajectory (its token
sequence, :mod:`services.router.trajectory`) and hands finished turns to the recorder."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import os
import struct
from collections.abc import AsyncGenerator, Callable
from typing import Any

from gyre.backoff import Backoff
from gyre.errors import DeadlineExceeded, GyreError, Unavailable
from gyre.failpoints import failpoint
from gyre.telemetry import execution_id_var
from gyre.tokens import Chunk, FinishReason
from services.router.calls import CallPolicy, ModelCall, RouterStats
from services.router.engine import EngineClient, Sampling
from services.router.failures import FailureReporter
from services.router.routes import Route, RouteTable
from services.router.stops import OutputText
from services.router.trajectory import ChatState, Trajectory, TrajectoryStore
from services.router.turns import Turn, TurnRecorder, TurnSource

log = logging.getLogger(__name__)


class CallManager:
    """Owns every ModelCall of this router process."""

    def __init__(
        self,
        *,
        routes: RouteTable,
        engines: EngineClient,
        policy: CallPolicy,
        turns: TurnRecorder,
        stats: RouterStats | None = None,
        reporter: FailureReporter | None = None,
        turn_source: TurnSource | None = None,
    ) -> None:
        self.routes = routes
        self._turn_source = turn_source
        self._reporter = reporter
        self.stats = stats or RouterStats()
        self._engines = engines
        self._policy = policy
        self._turns = turns
        self._calls: dict[str, set[ModelCall]] = {}
        self._turn_index: dict[str, int] = {}
        self.trajectories = TrajectoryStore()
        self._ids = itertools.count(1)
        self._prefix = f"r{os.getpid():x}"
        self._background: set[asyncio.Task[Any]] = set()
        if turns.renumber is None:
            turns.renumber = self._renumber
        routes.add_listener(self._on_route)
        routes.add_remove_listener(self.forget)

    def spawn(self, coro: Any) -> None:
        """Runs a short background coroutine (aborts, KV releases), kept until done."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(
        self,
        route: Route,
        prompt_token_ids: list[int],
        sampling: Sampling,
        timeout_s: float,
        call_box: list[ModelCall] | None = None,
        output_text: OutputText | None = None,
        break_reason: str | None = None,
        whole: bool = False,
        idempotency_key: str = "",
        chat_state: Callable[[str], ChatState] | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """Runs one model call of ``route``'s execution (the caller already authorized it).

        Yields coalesced chunks; raises a GyreError on failure. A completed call becomes the
        execution's trajectory and its turn is queued for the packer. ``call_box`` receives
        the call (for reroute counts); ``output_text`` detokenizes and applies stop strings
        (HTTP calls); ``break_reason`` names why the prompt does not continue the
        trajectory, if it does not; ``whole``: the caller wants the answer at once (chunks
        come when the call ends, one per policy version); ``idempotency_key``: the harness's
        key for this call (validated), carried by its turn record; ``chat_state``: a chat
        call's state from its output text, once it completed (kept with the trajectory and
        carried by the turn record).
        """
        execution_id = route.execution_id
        execution_id_var.set(execution_id)
        if sampling.temperature > 0 and sampling.seed == 0:
            sampling = dataclasses.replace(sampling, seed=call_seed(execution_id, prompt_token_ids))
        loop = asyncio.get_running_loop()
        call = ModelCall(
            call_id=f"{self._prefix}-{next(self._ids)}",
            execution_id=execution_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            routes=self.routes,
            engines=self._engines,
            policy=self._policy,
            stats=self.stats,
            deadline=loop.time() + timeout_s,
            background=self.spawn,
            output_text=output_text,
            report=self._reporter.report if self._reporter is not None else None,
            whole=whole,
        )
        if call_box is not None:
            call_box.append(call)
        self._calls.setdefault(execution_id, set()).add(call)
        self.stats.inflight += 1
        try:
            async for chunk in call.stream():
                yield chunk
            if call.finish in (FinishReason.STOP, FinishReason.LENGTH):
                chat = chat_state(call.text) if chat_state is not None else None
                call.trajectory = self.trajectories.record(
                    execution_id,
                    call.prompt_token_ids,
                    call.output_ids,
                    chat,
                    break_reason,
                    idempotency_key,
                )
                failpoint("router.turn.completed")  # every token streamed, the turn not yet queued
                recorded = self._record(route, call, idempotency_key, chat)
                if recorded is not None and self._policy.turn_record_wait_s > 0:
                    # The call ends for the harness once the packer holds its turn (bounded):
                    # the harness reports the execution's finish only after its last call, so
                    # its group cannot become ready before the turn is there, and recording
                    # cannot fall behind the calls under load.
                    await self._turns.wait_recorded(recorded, self._policy.turn_record_wait_s)
        finally:
            self.stats.inflight -= 1
            calls = self._calls.get(execution_id)
            if calls is not None:
                calls.discard(call)
                if not calls:
                    del self._calls[execution_id]

    def _record(
        self, route: Route, call: ModelCall, idempotency_key: str, chat: ChatState | None
    ) -> asyncio.Future[bool] | None:
        current = self.routes.get(route.execution_id) or route
        index = self._turn_index.get(route.execution_id, 0)
        self._turn_index[route.execution_id] = index + 1
        return self._turns.submit(
            Turn(
                execution_id=route.execution_id,
                group_id=current.group_id,
                turn_index=index,
                prompt_token_ids=tuple(call.prompt_token_ids),
                output_token_ids=tuple(call.output_ids),
                output_logprobs=tuple(call.logprobs),
                output_policy_versions=tuple(call.policy_versions),
                idempotency_key=idempotency_key,
                chat_state=chat.encode() if chat is not None else "",
                temperature=call.sampling.temperature,
            )
        )

    async def resume(
        self, execution_id: str, idempotency_key: str, wait_s: float | None = None
    ) -> Resumed | None:
        """Rebuilds the execution's token sequence from the packer's record of its turns: the
        trajectory a call with this idempotency key continues and the index its turn takes
        (None when the packer holds no turn of it: the call is then rendered afresh). For a
        call whose history has answers this router's state does not end with (another
        router served the calls since, or this one restarted). :meth:`adopt` installs it.

        A packer that does not answer (down, restarting, a partition) is asked again with
        back-off for up to ``rebuild_wait_s`` (and the call's ``wait_s``); past it the call
        fails UNAVAILABLE (the harness retries it). A prompt rendered afresh instead is not
        what the call's first try had, when this is a retry after a router died: the packer
        refuses it (``recorded for another prompt``) and the turn is lost. Other failures
        (a misconfigured router) still render afresh, counted."""
        if self._turn_source is None:
            return None
        limit = self._policy.rebuild_wait_s if wait_s is None else min(wait_s, self._policy.rebuild_wait_s)
        loop = asyncio.get_running_loop()
        until = loop.time() + limit
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                async with asyncio.timeout_at(until):  # one hung answer never outlasts the wait
                    turn, index = await self._turn_source.trajectory(execution_id, idempotency_key)
                break
            except (Unavailable, DeadlineExceeded, TimeoutError) as exc:
                delay = backoff.next()
                if loop.time() + delay >= until:
                    self.trajectories.resume_failed += 1
                    raise Unavailable(
                        f"cannot continue execution {execution_id}: the packer did not say where its "
                        f"token sequence stands within {limit:g} s ({exc}); retry the call",
                        retry_after_s=1.0,
                    ) from exc
                log.info("packer did not answer GetTrajectory; asking again", extra={"error": str(exc)})
                await asyncio.sleep(delay)
            except GyreError as exc:
                self.trajectories.resume_failed += 1
                log.warning("could not resume a trajectory from the packer", extra={"error": str(exc)})
                return None
        if turn is None:
            return None
        trajectory = Trajectory(
            tokens=turn.prompt_token_ids + turn.output_token_ids,
            prompt_len=len(turn.prompt_token_ids),
            segment=0,
            turns=turn.turn_index + 1,
            chat=ChatState.decode(turn.chat_state),
            call_key=turn.idempotency_key,
        )
        return Resumed(trajectory, index)

    def adopt(self, execution_id: str, resumed: Resumed) -> None:
        """A resumed trajectory the call continues becomes this router's state of the
        execution; its turns are numbered on from the packer's."""
        self.trajectories.install(execution_id, resumed.trajectory)
        self._turn_index[execution_id] = max(self._turn_index.get(execution_id, 0), resumed.next_turn_index)

    def _renumber(self, turn: Turn) -> Turn:
        """The next index past ``turn``'s for its execution (its index was taken)."""
        index = max(self._turn_index.get(turn.execution_id, 0), turn.turn_index + 1)
        self._turn_index[turn.execution_id] = index + 1
        return dataclasses.replace(turn, turn_index=index)

    def _on_route(self, route: Route) -> None:
        for call in list(self._calls.get(route.execution_id, ())):
            call.request_move()

    def forget(self, execution_id: str) -> None:
        """The execution closed (its route is gone): its calls still running end now (their
        engine requests aborted, the harness told why), and its turn counter and trajectory
        are dropped."""
        for call in list(self._calls.get(execution_id, ())):
            call.end_execution()
        self._turn_index.pop(execution_id, None)
        self.trajectories.forget(execution_id)

    async def move(self, execution_ids: list[str], from_cells: set[str]) -> tuple[int, int]:
        """Moves the outstanding calls of these executions to their current routes.

        Returns (calls of these executions that left one of ``from_cells`` — whether this
        command or the route watch moved them first —, calls still attempting at any of
        ``from_cells``) once every moved call's source attempt is stopped.
        """
        calls = [call for execution_id in execution_ids for call in self._calls.get(execution_id, ())]
        waits = [fut for fut in (call.request_move() for call in calls) if fut is not None]
        if waits:
            await asyncio.gather(*waits)
        if from_cells:
            moved = sum(
                1 for c in calls if from_cells.intersection(c.cells_visited) and c.at_cell not in from_cells
            )
        else:
            moved = len(waits)
        remaining = sum(1 for cs in self._calls.values() for c in cs if c.at_cell in from_cells)
        return moved, remaining

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """An execution's trajectory as the packer's record of its turns has it."""

    trajectory: Trajectory
    next_turn_index: int


def call_seed(execution_id: str, prompt_token_ids: list[int]) -> int:
    """The seed of a sampled call that came without one: a hash of its execution and its
    prompt. Members of a group (same task, same prompt) then sample differently, which
    group-relative advantages need; one execution's call is reproducible; and a rerouted
    call keeps its seed, so its continuation samples from the same stream."""
    h = hashlib.blake2b(execution_id.encode(), digest_size=8)
    h.update(struct.pack(f"<{len(prompt_token_ids)}i", *prompt_token_ids))
    return 1 + int.from_bytes(h.digest(), "little") % (2**31 - 1)
