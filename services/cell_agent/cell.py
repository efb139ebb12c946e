"""One cell: its engine, its lifecycle and the side effects of each role change.

:class:`Cell` is the domain object the servicer calls. It gates new requests by state
(only ROLLOUT takes new ones), runs fenced role commands one at a time (check, wait for the
engine to drain when needed, persist through the store under the leader's fence, commit,
then act on the engine and the training hook), loads policies in place, and watches the
engine: a dead engine or a probe that times out fails every waiter and ends the process
(crash-only). No grpc, no etcd here; persistence goes through :class:`CellStateStore`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from gyre.errors import FailedPrecondition, FatalError, InvalidArgument, Unavailable
from gyre.etcd.values import CellRecord
from gyre.failpoints import failpoint
from gyre.history import History
from gyre.tokens import missing_logprobs
from services.cell_agent.engines.base import Chunk, Engine, EngineDead, KvHandle, Sampling
from services.cell_agent.hooks import JoinBatch, NoopTrainingHook, SnapshotPuller, TrainingHook, default_pull
from services.cell_agent.lifecycle import ENGINE_UP, SERVING, CellKind, CellState, Lifecycle, Transition

log = logging.getLogger(__name__)


class CellStateStore(Protocol):
    """Persistence of a cell's registration and state (etcd in production)."""

    async def write_state(self, state: CellState, epoch: int, updated_s: float) -> None:
        """Writes the state under the leader fence ``epoch``; StaleEpoch if that leader is
        gone. ``epoch == 0`` is the cell's own unfenced write (start-up, failure)."""

    async def register(self, record: CellRecord) -> None:
        """(Re)writes the cell's registration record."""

    async def verify_leader(self, epoch: int) -> None:
        """StaleEpoch unless ``epoch`` is the current scheduler leader's epoch."""


@dataclasses.dataclass(frozen=True)
class CellIdentity:
    """Who the cell is (static for the process's life)."""

    cell_id: str
    kind: CellKind
    index: int
    slots: int
    engine: str


@dataclasses.dataclass(frozen=True)
class CellStatus:
    """A snapshot of the cell for GetCellStatus / GetLoad."""

    identity: CellIdentity
    state: CellState
    epoch: int
    running_requests: int
    policy_version: int
    accepting: bool
    sleeping: bool


class Cell:
    """The cell agent's domain object (see the module docstring)."""

    def __init__(
        self,
        identity: CellIdentity,
        engine: Engine,
        store: CellStateStore,
        hook: TrainingHook | None = None,
        pull: SnapshotPuller | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        drain_wait_s: float = 10.0,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 10.0,
        snapshot_timeout_s: float = 120.0,
        history: History | None = None,
    ) -> None:
        self.identity = identity
        self.history = history or History()
        """Role changes and weight loads, written once persisted (``apps.checker``)."""
        self.engine = engine
        self.store = store
        self.hook: TrainingHook = hook or NoopTrainingHook()
        self._pull: SnapshotPuller = pull or default_pull
        self._wall = wall_clock
        self.lifecycle = Lifecycle(identity.kind, clock)
        self._lock = asyncio.Lock()
        self._drain_wait_s = drain_wait_s
        self._probe_interval_s = probe_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self._fatal: asyncio.Future[None] | None = None
        self.target = ""
        self.tokens_generated = 0
        self.last_probe_s = 0.0

    # Start-up ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the engine (the cell stays STARTING until :meth:`open`)."""
        await self.engine.start()

    async def open(self, target: str) -> None:
        """Registers the cell at ``target`` and moves it STARTING -> ROLLOUT."""
        self.target = target
        await self.store.register(self.registration())
        t = self.lifecycle.check_unfenced(CellState.ROLLOUT, 0, "engine up")
        await self.store.write_state(t.target, 0, self._wall())
        self.lifecycle.commit(t)
        self._record_state(t.source, t.target, 0)
        log.info("cell open", extra={"target": target, "state": t.target.name})

    def _record_state(self, source: CellState, target: CellState, epoch: int, reason: str = "") -> None:
        self.history.append(
            "state", epoch, frm=source.name, to=target.name, v=self.engine.policy_version, reason=reason
        )

    def registration(self) -> CellRecord:
        """The record at ``keys.cell(cell_id)``."""
        i = self.identity
        return CellRecord(
            i.cell_id,
            i.kind,
            i.index,
            i.slots,
            self.target,
            i.engine,
            self.engine.policy_version,
            self.engine.kv_tokens,
        )

    async def close(self) -> None:
        await self.engine.shutdown()

    # Serving -------------------------------------------------------------------------------

    @property
    def state(self) -> CellState:
        return self.lifecycle.state

    @property
    def accepting(self) -> bool:
        return self.state in SERVING and self.engine.dead is None and not self.engine.sleeping

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        required_policy_version: int = 0,
        kv_handle: KvHandle | None = None,
    ) -> AsyncIterator[Chunk]:
        """Streams one request if the cell takes new requests; UNAVAILABLE otherwise (the
        router re-reads the route and retries where it points now)."""
        if not request_id:
            raise InvalidArgument("request_id is empty")
        self.engine.check_alive()
        if not self.accepting:
            raise Unavailable(f"cell {self.identity.cell_id} is {self.state.name}; not taking new requests")
        stream = self.engine.generate(
            request_id, prompt_token_ids, sampling, required_policy_version, kv_handle
        )
        async for chunk in stream:
            if len(chunk.logprobs) != len(chunk.token_ids):  # never padded: INTERNAL
                raise missing_logprobs(
                    len(chunk.token_ids), len(chunk.logprobs), f"{self.engine.kind} engine"
                )
            self.tokens_generated += len(chunk.token_ids)
            yield chunk

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def export_kv(self, request_id: str) -> KvHandle | None:
        return await self.engine.export_kv(request_id)

    async def release_kv(self, handle_id: str) -> None:
        await self.engine.release_kv(handle_id)

    def status(self) -> CellStatus:
        return CellStatus(
            identity=self.identity,
            state=self.state,
            epoch=self.lifecycle.epoch,
            running_requests=self.engine.running_requests,
            policy_version=self.engine.policy_version,
            accepting=self.accepting,
            sleeping=self.engine.sleeping,
        )

    # Role commands -------------------------------------------------------------------------

    async def set_state(self, target: CellState, epoch: int, reason: str = "") -> CellState:
        """A fenced role command. Refused (nothing changes) for a stale epoch, an illegal
        transition, or DRAINING -> TRAINING while the engine still holds requests after
        ``drain_wait_s``."""
        async with self._lock:
            t = self.lifecycle.check(target, epoch, reason)
            if t.noop:
                return self.state
            if t.target is CellState.FAILED:
                await self.store.verify_leader(epoch)
                await self._go_failed(f"ordered by the scheduler: {reason}", epoch)
                return self.state
            # Preconditions that may refuse the command (nothing changed yet).
            if t.target is CellState.TRAINING:
                await self._wait_drained()
            if (t.source, t.target) == (CellState.TRAINING, CellState.RETURNING):
                await self.store.verify_leader(epoch)
                await self.hook.on_leave_training()  # finishes the batch in progress
            await self.store.write_state(t.target, epoch, self._wall())
            failpoint(f"cell.state.{t.target.name.lower()}")  # in etcd, not yet acted on
            self.lifecycle.commit(t)
            self._record_state(t.source, t.target, epoch, reason)
            log.info(
                "cell state",
                extra={"from": t.source.name, "to": t.target.name, "epoch": epoch, "reason": reason},
            )
            # The state is written: its side effects complete even when the caller goes away
            # (a scheduler killed mid-command cancels this call). Cut short, they would leave
            # the cell RETURNING with its engine asleep, refusing every later command.
            applying = asyncio.ensure_future(self._apply(t))
            cancelled = False
            while not applying.done():
                try:
                    await asyncio.wait({applying})  # waits without cancelling it or raising its error
                except asyncio.CancelledError:
                    cancelled = True  # still under the lock: no command sees a half-made state
            exc = applying.exception()
            if exc is not None:
                await self._go_failed(f"{t.source.name} -> {t.target.name} failed: {exc!r}")
                if not cancelled:
                    raise Unavailable(
                        f"cell failed during {t.source.name} -> {t.target.name}: {exc}"
                    ) from exc
            if cancelled:
                raise asyncio.CancelledError()
            return self.state

    async def _verify_epoch(self, epoch: int) -> None:
        """A fenced command that writes nothing to etcd: refuse a stale epoch, then ask the
        store whether ``epoch`` is the current leader's before it becomes the floor."""
        self.lifecycle.check_epoch(epoch)
        await self.store.verify_leader(epoch)
        self.lifecycle.observe_epoch(epoch)

    async def _wait_drained(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_wait_s
        while self.engine.running_requests > 0:
            if loop.time() >= deadline:
                raise FailedPrecondition(
                    f"engine still holds {self.engine.running_requests} requests "
                    f"after {self._drain_wait_s}s; "
                    "move its executions first"
                )
            await asyncio.sleep(0.02)

    async def _apply(self, t: Transition) -> None:
        """The side effects of a committed transition."""
        s = CellState
        if (t.source, t.target) == (s.DRAINING, s.TRAINING):
            released = await self.engine.sleep()
            log.info("rollout resources released", extra={"freed_memory": released})
            await self.hook.on_enter_training()
        elif (t.source, t.target) == (s.TRAINING, s.RETURNING):
            await self.engine.wake()
        elif t.target is s.ROLLOUT:
            await self.engine.probe(self._probe_timeout_s)  # serve only a proven engine

    async def load_policy(self, epoch: int, version: int, source_target: str) -> tuple[int, float]:
        """Pulls policy ``version`` from ``source_target`` and loads it in place (requests
        in flight continue on the new weights). An empty source relabels the current
        weights as ``version``. Returns (version served, seconds)."""
        if version < 0:
            raise InvalidArgument("version must be >= 0")
        async with self._lock:
            await self._verify_epoch(epoch)
            if self.state not in ENGINE_UP or self.engine.sleeping:
                raise FailedPrecondition(f"cannot load weights while {self.state.name}")
            loop = asyncio.get_running_loop()
            start, invoked, before = loop.time(), self._wall(), self.engine.policy_version
            weights = None
            if source_target:
                try:
                    async with asyncio.timeout(self._snapshot_timeout_s):
                        got_version, weights = await self._pull(source_target, version)
                except TimeoutError as exc:
                    raise Unavailable(f"pulling policy {version} from {source_target} timed out") from exc
                if version and got_version != version:
                    raise FailedPrecondition(f"{source_target} served version {got_version}, not {version}")
                version = got_version
            await self.engine.load_weights(version, weights)
            self.history.append("load", epoch, prev=before, v=self.engine.policy_version, t0=invoked)
            await self.store.register(self.registration())
            return self.engine.policy_version, loop.time() - start

    async def join_batch(self, cmd: JoinBatch) -> bool:
        async with self._lock:
            await self._verify_epoch(cmd.epoch)
            if self.state is not CellState.TRAINING:
                raise FailedPrecondition(f"cannot join a batch while {self.state.name}")
        return await self.hook.join_batch(cmd)

    # Crash-only ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Watches the engine until it dies or hangs; then fails every waiter, marks the
        cell FAILED and raises FatalError (the process exits, its lease lapses)."""
        self._fatal = asyncio.get_running_loop().create_future()
        while True:
            died = asyncio.ensure_future(self.engine.died.wait())
            waiters: list[asyncio.Future[Any]] = [died, self._fatal]
            try:
                await asyncio.wait(
                    waiters, timeout=self._probe_interval_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                died.cancel()
            if self._fatal.done():
                raise FatalError(str(self._fatal.exception() or "cell failed"))
            if self.engine.dead is not None:
                await self._go_failed(f"engine dead: {self.engine.dead}")
                self._retrieve_fatal()
                raise FatalError(f"engine dead: {self.engine.dead}")
            if self.state in ENGINE_UP and not self.engine.sleeping and not self._lock.locked():
                loop = asyncio.get_running_loop()
                started = loop.time()
                try:
                    await self.engine.probe(self._probe_timeout_s)
                    self.last_probe_s = loop.time() - started
                except EngineDead as exc:
                    await self._go_failed(str(exc))
                    self._retrieve_fatal()
                    raise FatalError(str(exc)) from exc

    def _retrieve_fatal(self) -> None:
        # The monitor raises its own FatalError; mark the future's as retrieved.
        if self._fatal is not None and self._fatal.done():
            self._fatal.exception()

    async def _go_failed(self, reason: str, epoch: int = 0) -> None:
        if self.state is CellState.FAILED:
            return
        source = self.state
        self.lifecycle.fail(reason)
        self._record_state(source, CellState.FAILED, epoch, reason)
        log.error("cell failed", extra={"reason": reason})
        if self.engine.dead is None:
            await self.engine.fail(EngineDead(f"cell failed: {reason}"))
        try:
            async with asyncio.timeout(2.0):
                await self.store.write_state(CellState.FAILED, 0, self._wall())
        except Exception as exc:  # best effort: the lease lapsing says the same
            log.warning("could not record FAILED", extra={"error": repr(exc)})
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(FatalError(reason))
