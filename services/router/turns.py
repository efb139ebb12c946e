"""Turn records to the packer: one per completed model call, buffered and retried in the
background so that a slow or absent packer never fails a call. ``submit`` returns a future
settled when the packer holds the turn (or refused it, or the buffer dropped it): the call
manager makes a completed call wait for it, bounded (``turn_record_wait_s``).

RecordTurn is idempotent on (execution_id, turn_index), so a retry after an ambiguous
failure (UNAVAILABLE / DEADLINE_EXCEEDED do not prove the call did nothing) is safe. The
buffer is bounded; when it is full the oldest record is dropped and counted.

Turn indexes are counted in the router's memory, from the packer's when the router resumed
the execution from it (a chat call whose history this router's state does not end with:
``CallManager.resume``). After a router restart (or with two routers on one execution) a
token-level call's index can already hold another turn at the packer, which refuses it
("recorded with other content"); the recorder then renumbers the turn past it
(``renumber``) instead of losing it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gyre.backoff import Backoff
from gyre.errors import (
    FailedPrecondition,
    GyreError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from gyre.failpoints import failpoint
from gyre.history import History
from gyre.v1 import packer_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model call of an execution, as training data."""

    execution_id: str
    group_id: str
    turn_index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_policy_versions: tuple[int, ...]
    output_loss_mask: tuple[int, ...] = ()
    idempotency_key: str = ""
    """The harness's key for the model call: the packer keeps one turn per key (a retried
    call's answer replaces its first try's)."""
    chat_state: str = ""
    """A chat call's :class:`~services.router.trajectory.ChatState`, encoded ("": a
    token-level call): what another router needs to continue the execution."""
    temperature: float = 1.0
    """The call's sampling temperature (0: greedy): the trainer scores the turn's tokens at
    it (the engines report log-probs after temperature). A packer record without one: 1."""

    def to_proto(self) -> packer_pb2.TurnRecord:
        return packer_pb2.TurnRecord(
            execution_id=self.execution_id,
            group_id=self.group_id,
            turn_index=self.turn_index,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            output_logprobs=self.output_logprobs,
            output_policy_versions=self.output_policy_versions,
            output_loss_mask=self.output_loss_mask,
            idempotency_key=self.idempotency_key,
            chat_state=self.chat_state,
            temperature=self.temperature,
        )

    @classmethod
    def from_proto(cls, msg: packer_pb2.TurnRecord) -> Turn:
        return cls(
            execution_id=msg.execution_id,
            group_id=msg.group_id,
            turn_index=msg.turn_index,
            prompt_token_ids=tuple(msg.prompt_token_ids),
            output_token_ids=tuple(msg.output_token_ids),
            output_logprobs=tuple(msg.output_logprobs),
            output_policy_versions=tuple(msg.output_policy_versions),
            output_loss_mask=tuple(msg.output_loss_mask),
            idempotency_key=msg.idempotency_key,
            chat_state=msg.chat_state,
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        )


class TurnSink(Protocol):
    """Where turns go (the packer's RecordTurn); raises a GyreError on failure."""

    async def record(self, turn: Turn) -> None: ...


class TurnSource(Protocol):
    """Where an execution's recorded turns stand (the packer's GetTrajectory): the turn a new
    call with this idempotency key continues (None: none) and the index its turn takes;
    raises a GyreError on failure."""

    async def trajectory(self, execution_id: str, idempotency_key: str) -> tuple[Turn | None, int]: ...


# RESOURCE_EXHAUSTED: a turn over the packer's limits never fits, so retrying would loop forever.
_PERMANENT = (InvalidArgument, FailedPrecondition, NotFound, PermissionDenied, ResourceExhausted)


class TurnRecorder:
    """A bounded buffer drained by ``senders`` coroutines with capped exponential back-off."""

    def __init__(
        self,
        *,
        sink: TurnSink | None,
        capacity: int = 10000,
        senders: int = 4,
        retry_max_s: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        renumber: Callable[[Turn], Turn] | None = None,
        history: History | None = None,
    ) -> None:
        self._sink = sink
        self._history = history or History()
        self.renumber = renumber
        self._capacity = capacity
        self._senders = senders
        self._retry_max_s = retry_max_s
        self._sleep = sleep
        self._queue: collections.deque[tuple[Turn, asyncio.Future[bool] | None]] = collections.deque()
        self._wake = asyncio.Event()
        self._sending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self.renumbered = 0

    @property
    def pending(self) -> int:
        return len(self._queue) + self._sending

    def submit(self, turn: Turn) -> asyncio.Future[bool] | None:
        """Queues a turn; never blocks. Returns a future that becomes True once the packer
        holds the turn, False when it refused it or the buffer dropped it (None without a
        packer); :meth:`wait_recorded` waits for it, bounded."""
        if self._sink is None:
            return None
        if len(self._queue) >= self._capacity:
            lost, lost_done = self._queue.popleft()
            _settle(lost_done, False)
            self.dropped += 1
            self._history.append(
                "turn_dropped", 0, execution_id=lost.execution_id, turn_index=lost.turn_index
            )
            log.error(
                "turn buffer full; dropped a turn record",
                extra={"execution_id": lost.execution_id, "turn_index": lost.turn_index},
            )
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue.append((turn, done))
        self._idle.clear()
        self._wake.set()
        return done

    @staticmethod
    async def wait_recorded(done: asyncio.Future[bool], timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for a submitted turn to be settled; False on timeout
        (the turn is still sent in the background: waiting never cancels it)."""
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            return False

    async def run(self) -> None:
        """Sends forever (a supervised task)."""
        if self._sink is None:
            await asyncio.Event().wait()
        await asyncio.gather(*(self._sender() for _ in range(self._senders)))

    async def flush(self, timeout_s: float) -> bool:
        """Waits until everything queued was sent (or given up); False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def _sender(self) -> None:
        assert self._sink is not None
        while True:
            while not self._queue:
                if self._sending == 0:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
            turn, done = self._queue.popleft()
            self._sending += 1
            ok = False
            try:
                ok = await self._send(turn)
            finally:
                self._sending -= 1
                _settle(done, ok)

    def _refused(self, turn: Turn, exc: Exception) -> None:
        """A turn the packer refused for good: counted, in the history, logged."""
        self.rejected += 1
        self._history.append(
            "turn_refused",
            0,
            execution_id=turn.execution_id,
            turn_index=turn.turn_index,
            error=str(exc)[:200],
        )
        log.error(
            "packer refused a turn record",
            extra={"execution_id": turn.execution_id, "error": str(exc)},
        )

    async def _send(self, turn: Turn) -> bool:
        """Sends until the packer holds the turn (True) or refuses it for good (False)."""
        assert self._sink is not None
        backoff = Backoff(0.05, self._retry_max_s, sleep=self._sleep)
        while True:
            try:
                await self._sink.record(turn)
                failpoint("router.turn.recorded")  # the packer holds the turn, the call not yet ended
                self.sent += 1
                self._history.append(
                    "turn_recorded",
                    0,
                    execution_id=turn.execution_id,
                    turn_index=turn.turn_index,
                    versions=sorted(set(turn.output_policy_versions)),
                )
                return True
            except FailedPrecondition as exc:
                if "other content" in str(exc) and self.renumber is not None and self.renumbered < 1_000_000:
                    old = turn.turn_index
                    turn = self.renumber(turn)
                    self.renumbered += 1
                    log.warning(
                        "turn index taken at the packer; renumbered",
                        extra={"execution_id": turn.execution_id, "from": old, "to": turn.turn_index},
                    )
                    continue
                self._refused(turn, exc)
                return False
            except _PERMANENT as exc:
                self._refused(turn, exc)
                return False
            except GyreError as exc:
                delay = await backoff.sleep()
                log.info("packer unavailable; retried", extra={"error": str(exc), "backoff_s": delay})


def _settle(done: asyncio.Future[bool] | None, ok: bool) -> None:
    if done is not None and not done.done():
        done.set_result(ok)
