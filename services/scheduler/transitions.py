"""Transition orchestration: moving a cell rollout -> training and back, resumably.

Rollout -> training (ARCHITECTURE.md "Rerouting a live execution"), for cell c:
  1. record the transition in etcd (``keys.transition(c)``), fenced;
  2. CellControl.SetState(c, DRAINING): c takes no new requests, no launch goes to c;
  3. for each execution routed to c, reserve a destination (standalone engines first, then
     rollout cells by descending index) and CAS its route (route epoch + 1), fenced;
  4. Router.MoveExecutions on every router: outstanding requests continue at the destination;
  5. wait until c's engine runs no request (bounded by ``drain_timeout_s``);
  6. CellControl.SetState(c, TRAINING), then JoinBatch(current batch, prefix size, core);
  7. delete the transition record.
Training -> rollout: SetState(RETURNING), LoadPolicy(newest) if the cell is behind,
SetState(ROLLOUT) (a cell still DRAINING is simply called back: DRAINING -> ROLLOUT).

Every step is idempotent (a SetState to the current state succeeds, a route already moved
is not moved again), so a new leader resumes a recorded transition by running it again
from the top. Every command carries the fencing epoch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gyre.backoff import Backoff
from gyre.errors import Conflict, FailedPrecondition, GyreError, StaleEpoch
from services.scheduler.peers import MoveOrder
from services.scheduler.placement import pick_destinations
from services.scheduler.policy import CellState, training_set

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REFUSALS = 15
"""FAILED_PRECONDITION answers (not a stale epoch) a command survives before it gives up."""


class CellGone(Exception):
    """The cell's registration vanished (its lease lapsed) mid-transition."""


class TransitionRunner:
    """Runs at most one transition per cell as a task; the policy runs one at a time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._side: set[asyncio.Task[None]] = set()
        self.loaded: dict[str, int] = {}

    def running(self, cell_id: str) -> bool:
        t = self._tasks.get(cell_id)
        return t is not None and not t.done()

    def start(self, cell_id: str, target: CellState, reason: str) -> None:
        if self.running(cell_id):
            return
        cur = self.s.cells.state(cell_id)
        if target is CellState.TRAINING:
            self.s.cells.overlay[cell_id] = CellState.DRAINING
        elif cur in (CellState.TRAINING, CellState.RETURNING):
            self.s.cells.overlay[cell_id] = CellState.RETURNING
        self._tasks[cell_id] = asyncio.create_task(self._run(cell_id, target, reason),
                name=f"transition.{cell_id}")

    def resume(self, cell_id: str, body: dict[str, Any]) -> None:
        """A transition recorded by an earlier leader: run it again from the top."""
        try:
            target = CellState(str(body.get("target", "")))
        except ValueError:
            target = CellState.ROLLOUT
        self.s.emit("transition_resumed", f"resuming {cell_id} -> {target.value} ({body.get('reason', '')})",
                cell_id=cell_id)
        self.start(cell_id, target, str(body.get("reason", "resumed")))

    def rejoin(self, cell_id: str) -> None:
        self._spawn(self._join(cell_id))

    def publish(self, version: int) -> None:
        self._spawn(self._publish(version))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    async def cancel_all(self) -> None:
        tasks = [*self._tasks.values(), *self._side]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # The runs -----------------------------------------------------------------------------

    async def _run(self, cell_id: str, target: CellState, reason: str) -> None:
        s = self.s
        try:
            await s._fenced(s.store.put_transition(cell_id, {"target": target.value, "reason": reason,
                    "epoch": s.epoch}))
            if target is CellState.TRAINING:
                await self._to_training(cell_id)
            else:
                await self._to_rollout(cell_id)
            await s._fenced(s.store.delete_transition(cell_id))
        except StaleEpoch as exc:
            s.mark_deposed(exc)
        except CellGone:
            s.cells.overlay.pop(cell_id, None)
            s.emit("transition_abandoned", f"{cell_id} left the cluster during its move to {target.value}",
                    cell_id=cell_id)
            try:
                await s._fenced(s.store.delete_transition(cell_id))
            except StaleEpoch as exc:
                s.mark_deposed(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("transition failed", extra={"cell_id": cell_id})
            s.cells.overlay.pop(cell_id, None)
            s.emit("transition_failed", f"{cell_id} -> {target.value} failed: {exc!r}", cell_id=cell_id)
            await self._call_off(cell_id, target)
        finally:
            self._tasks.pop(cell_id, None)
            s._settle_overlays()
            s._wake()

    async def _call_off(self, cell_id: str, target: CellState) -> None:
        """After a failed move to training, a cell left DRAINING would hold every later move:
        call the drain off (DRAINING -> ROLLOUT) and drop the record; the policy decides again."""
        s = self.s
        try:
            if target is CellState.TRAINING and s.cells.states.get(cell_id) is CellState.DRAINING:
                await self._retry(cell_id, lambda: s.peers.set_state(self._target(cell_id), s.epoch, CellState.ROLLOUT,
                                                                    "move failed; drain called off"), attempts=5)
            await s._fenced(s.store.delete_transition(cell_id))
        except StaleEpoch as exc:
            s.mark_deposed(exc)
        except (GyreError, CellGone) as exc:
            log.warning("could not call off %s: %r (the record stays for the next attempt)", cell_id, exc)

    async def _to_training(self, cell_id: str) -> None:
        s = self.s
        target = self._target(cell_id)
        await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.DRAINING,
                "moving to training"))
        moved = await self._reroute(cell_id)
        if moved is None:
            await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.ROLLOUT,
                    "move called off"))
            s.cells.overlay[cell_id] = CellState.ROLLOUT
            s.emit("transition_called_off",
                    f"called off {cell_id} -> TRAINING: no destination for its executions", cell_id=cell_id)
            return
        await self._wait_empty(cell_id)
        await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.TRAINING, "training"))
        s.cells.overlay[cell_id] = CellState.TRAINING
        s.emit("cell_in_training", f"{cell_id} is training ({moved} executions rerouted)", cell_id=cell_id)
        # Outside the transition (a later return must not wait on it), after it.
        self._spawn(self._join(cell_id, self._tasks.get(cell_id)))

    async def _reroute(self, cell_id: str) -> int | None:
        """Moves every route off ``cell_id``; None when destinations ran out."""
        s = self.s
        for _ in range(5):
            # Launches to this cell still in flight land first (a pending route has
            # mod_revision 0; its write would overwrite a rerouted one).
            for _ in range(500):
                if not any(r.mod_revision == 0 for r in s.routes.on_cell(cell_id)):
                    break
                await asyncio.sleep(0.01)
            async with s._launch_lock:
                leaving = s.routes.on_cell(cell_id)
                if any(r.mod_revision == 0 for r in leaving):
                    continue
                if not leaving:
                    return 0
                dests = pick_destinations(s.cells, s.routes, cell_id, len(leaving), self._version)
                if len(dests) < len(leaving):
                    return None
                pairs = [(old, dataclasses.replace(old, cell_id=d.cell_id, target=d.target)) for old,
                        d in zip(leaving, dests)]
                try:
                    revs = await s._fenced(s.store.move_routes(pairs))
                except Conflict:
                    # A chunk may have gone through before another lost its guard: resync.
                    await s.reload_routes()
                    continue
                moves = []
                for (old, new), rev in zip(pairs, revs):
                    s.routes.put(dataclasses.replace(new, epoch=old.epoch + 1, mod_revision=rev))
                    moves.append(MoveOrder(old.execution_id, old.cell_id, new.cell_id, old.epoch + 1))
                    s.history.append("reroute", s.epoch, rev=rev, execution_id=old.execution_id,
                                     from_cell=old.cell_id, to_cell=new.cell_id, route_epoch=old.epoch + 1)
            s.reroutes += len(moves)
            s.emit("reroute", f"rerouted {len(moves)} executions off {cell_id}: " + ", ".join(
                sorted({f"{m.to_cell}" for m in moves})), cell_id=cell_id)
            await self._tell_routers(moves)
            return len(moves)
        return None

    async def _tell_routers(self, moves: list[MoveOrder]) -> None:
        """Router.MoveExecutions on every router (a few tries: routers also follow the
        route keys, so a router that misses the call still converges)."""
        s = self.s
        routers = s.all_router_targets()
        backoff = Backoff(0.1, 1.6)
        for attempt in range(5):
            if not routers or s.deposed.is_set():
                return
            try:
                await s.peers.move_executions(routers, s.epoch, moves)
                return
            except GyreError as exc:
                log.warning("MoveExecutions failed (attempt %d)", attempt + 1, extra={"error": repr(exc)})
                await backoff.sleep()

    def rescue(self, cell_id: str) -> None:
        """Moves the executions of a cell that left the cluster (lease lapsed) elsewhere."""
        if not self.running(cell_id):
            self._tasks[cell_id] = asyncio.create_task(self._rescue(cell_id), name=f"rescue.{cell_id}")

    async def _rescue(self, cell_id: str) -> None:
        s = self.s
        try:
            n = len(s.routes.on_cell(cell_id))
            moved = await self._reroute(cell_id)
            if moved is None:
                s.emit("rescue_failed", f"{cell_id} is gone; no free slot for its {n} executions yet",
                        cell_id=cell_id)
            else:
                s.emit("rescued", f"{cell_id} is gone: rerouted its {moved} executions", cell_id=cell_id)
        except StaleEpoch as exc:
            s.mark_deposed(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rescue failed", extra={"cell_id": cell_id})
        finally:
            self._tasks.pop(cell_id, None)
            s._wake()

    async def _wait_empty(self, cell_id: str) -> None:
        s = self.s
        deadline = s.clock() + s.cfg.drain_timeout_s
        while s.clock() < deadline:
            try:
                if await s.peers.running_requests(self._target(cell_id)) == 0:
                    return
            except GyreError:
                pass
            await asyncio.sleep(0.1)
        s.emit("drain_timeout",
                f"{cell_id} still had requests after {s.cfg.drain_timeout_s:.0f} s; switching anyway", cell_id=cell_id)

    async def _to_rollout(self, cell_id: str) -> None:
        s = self.s
        target = self._target(cell_id)
        state = s.cells.states.get(cell_id, CellState.STARTING)
        if state is CellState.DRAINING:
            await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.ROLLOUT,
                    "drain called off"))
        elif state in (CellState.TRAINING, CellState.RETURNING):
            await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.RETURNING,
                    "returning to rollout"))
            await self._load(cell_id)
            await self._retry(cell_id, lambda: s.peers.set_state(target, s.epoch, CellState.ROLLOUT,
                    "rollout"))
        s.cells.overlay[cell_id] = CellState.ROLLOUT
        s.emit("cell_in_rollout", f"{cell_id} is back in rollout at policy v{self._version(cell_id)}",
                cell_id=cell_id)

    async def _load(self, cell_id: str) -> None:
        s = self.s
        v = s.policy_version
        if v <= self._version(cell_id) or not s.policy_source:
            return
        got = await self._retry(cell_id, lambda: s.peers.load_policy(self._target(cell_id), s.epoch, v,
                s.policy_source))
        self.loaded[cell_id] = max(int(got), v)

    async def _join(self, cell_id: str, after: asyncio.Task[None] | None = None) -> None:
        """JoinBatch(current batch) until the cell joins one, or leaves training, or a
        transition starts for it. A refusal (window closed, previous batch still stepping,
        no trainer) is retried with backoff: the next batch may take it."""
        s = self.s
        if after is not None:  # the move to training that spawned us finishes first
            await asyncio.wait([after])
        backoff, missed = Backoff(0.5, 5.0), set()
        while not s.deposed.is_set():
            if s.cells.state(cell_id) is not CellState.TRAINING or self.running(cell_id):
                return
            try:
                batch_id = await s.peers.current_batch()
            except GyreError:
                batch_id = s.supply_raw.batch_id
            views = s.cells.views()
            # Cells join in prefix order, so when cell i joins the prefix is [core .. i].
            rec = s.cells.get(cell_id)
            prefix = rec.index + 1 if rec is not None and rec.index >= 0 else len(training_set(views))
            core = next((s.cells.get(v.cell_id) for v in views if v.is_core), None)
            core_target = core.target if core is not None else ""
            try:
                joined = await self._retry(cell_id, lambda: s.peers.join_batch(
                    self._target(cell_id), s.epoch, batch_id, s.policy_version, max(prefix, 1), core_target), attempts=5)
            except (GyreError, CellGone) as exc:
                s.emit("join_failed", f"{cell_id} could not join batch {batch_id}: {exc}", cell_id=cell_id)
                return
            if joined:
                s.emit("joined_batch",
                        f"{cell_id} joined batch {batch_id} (prefix {prefix}, v{s.policy_version})", cell_id=cell_id)
                return
            if batch_id not in missed:
                missed.add(batch_id)
                s.emit("join_missed",
                        f"{cell_id} missed batch {batch_id} (prefix {prefix}, v{s.policy_version}); retrying", cell_id=cell_id)
            await backoff.sleep()

    async def _publish(self, version: int) -> None:
        s = self.s
        if not s.policy_source:
            s.emit("publish_skipped", f"policy v{version}: no source target known")
            return
        cells = [
            v.cell_id for v in s.cells.views()
            if v.state is CellState.ROLLOUT and not self.running(v.cell_id) and self._version(v.cell_id) < version
        ]

        async def one(cell_id: str) -> None:
            try:
                got = await self._retry(cell_id, lambda: s.peers.load_policy(self._target(cell_id), s.epoch,
                        version, s.policy_source), attempts=5)
                self.loaded[cell_id] = max(int(got), version)
            except (GyreError, CellGone) as exc:
                s.emit("load_failed", f"{cell_id} could not load policy v{version}: {exc}", cell_id=cell_id)

        await asyncio.gather(*(one(c) for c in cells))
        s.emit("policy_loaded", f"policy v{version} loaded on {len(cells)} rollout engines")

    # Helpers ------------------------------------------------------------------------------

    def _target(self, cell_id: str) -> str:
        rec = self.s.cells.get(cell_id)
        if rec is None:
            raise CellGone(cell_id)
        return rec.target

    def _version(self, cell_id: str) -> int:
        rec = self.s.cells.get(cell_id)
        return max(rec.policy_version if rec else 0, self.loaded.get(cell_id, 0))

    async def _retry(self, cell_id: str, fn: Callable[[], Awaitable[T]], attempts: int = 0) -> T:
        """Calls ``fn`` until it succeeds; gives up when the cell is gone (CellGone), after
        ``attempts`` tries if set, after MAX_REFUSALS refusals, or when our epoch is refused
        by a newer leader's (StaleEpoch)."""
        s = self.s
        backoff = Backoff(0.1, 2.0)
        n = refused = 0
        while True:
            if s.deposed.is_set():
                raise StaleEpoch("deposed")
            if s.cells.get(cell_id) is None:
                raise CellGone(cell_id)
            try:
                return await fn()
            except FailedPrecondition as exc:
                if await s.store.election.current_epoch() != s.epoch:
                    s.mark_deposed(exc)
                    raise StaleEpoch(str(exc)) from exc
                err: GyreError = exc
                refused += 1
            except GyreError as exc:
                err = exc
            n += 1
            # Unreachable cells are retried until they come back or their lease lapses; a
            # refusal (an illegal state for the command) is retried a bounded number of times:
            # the transition then fails, and the policy decides again on fresh state.
            if (attempts and n >= attempts) or refused >= MAX_REFUSALS:
                raise err
            log.warning("command to %s failed; retrying", cell_id, extra={"error": repr(err)})
            await backoff.sleep()
