"""Transition orchestration: moving a cell rollout -> training and back, resumably.

Rollout -> training (docs/architecture.md, "Rerouting a live execution"), for cell c:
  1. record the transition in etcd (``keys.transition(c)``), fenced;
  2. CellControl.SetState(c, DRAINING): c takes no new requests, no launch goes to c;
  3. for each execution routed to c, reserve a destination (standalone engines first, then
     rollout cells by descending index) and CAS its route (route epoch + 1), fenced;
  4. Router.MoveExecutions on every router: outstanding requests continue at the destination;
  5. wait until c's engine runs no request (bounded by ``drain_timeout_s``);
  6. CellControl.SetState(c, TRAINING), then JoinBatch(current batch, prefix size, core),
     retried in the background (:mod:`joins`);
  7. delete the transition record.
Training -> rollout: SetState(RETURNING), LoadPolicy(newest) if the cell is behind,
SetState(ROLLOUT) (a cell still DRAINING is simply called back: DRAINING -> ROLLOUT).

Every step is idempotent (a SetState to the current state succeeds, a route already moved
is not moved again), so a new leader resumes a recorded transition by running it again
from the top. Every command carries the fencing epoch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from gyre.backoff import Backoff
from gyre.errors import Conflict, GyreError, InvalidArgument, StaleEpoch
from gyre.etcd.values import Route
from gyre.failpoints import failpoint
from services.scheduler.fleet import CellGone
from services.scheduler.joins import BatchJoins
from services.scheduler.parts import Part, Shared
from services.scheduler.peers import MoveOrder
from services.scheduler.placement import pick_destinations
from services.scheduler.policy import CellState
from services.scheduler.publication import Publication
from services.scheduler.supply import SupplyFollower

log = logging.getLogger(__name__)

T = TypeVar("T")


class SwitchTimes:
    """The recent durations of completed moves, per direction: a round trip is what a move
    costs the cell (drain and switch to training, switch back and wake)."""

    def __init__(self, keep: int = 16) -> None:
        self._times: dict[CellState, collections.deque[float]] = {
            CellState.TRAINING: collections.deque(maxlen=keep),
            CellState.ROLLOUT: collections.deque(maxlen=keep),
        }

    def record(self, target: CellState, seconds: float) -> None:
        if target in self._times and seconds >= 0:
            self._times[target].append(seconds)

    @property
    def round_trip_s(self) -> float:
        """Mean to-training plus mean to-rollout seconds; 0 until both were measured."""
        there, back = self._times[CellState.TRAINING], self._times[CellState.ROLLOUT]
        if not there or not back:
            return 0.0
        return sum(there) / len(there) + sum(back) / len(back)


class TransitionRunner(Part):
    """Runs at most one transition per cell as a task; the policy runs one at a time."""

    def __init__(
        self,
        *,
        shared: Shared,
        publication: Publication,
        supply: SupplyFollower,
        reload_routes: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(shared=shared)
        self.publication = publication
        self.reload_routes = reload_routes
        """Re-reads the routes from etcd (after a lost CAS)."""
        self.reroutes = 0
        """Executions rerouted so far (moves, rescues and migrations)."""
        self.migrations = 0
        """Executions migrated one by one (the policy's Migrate)."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._side: set[asyncio.Future[Any]] = set()
        self.joins = BatchJoins(
            shared=shared, publication=publication, supply=supply, moving=self.running, spawn=self._spawn
        )
        self.switch_times = SwitchTimes()
        """Durations of the moves that completed, per direction (the policy prices moves by
        them)."""

    def running(self, cell_id: str) -> bool:
        t = self._tasks.get(cell_id)
        return t is not None and not t.done()

    def start(self, cell_id: str, target: CellState, reason: str) -> None:
        if self.running(cell_id):
            return
        cells = self.fleet.cells
        cur = cells.state(cell_id)
        if target is CellState.TRAINING:
            cells.overlay[cell_id] = CellState.DRAINING
        elif cur in (CellState.TRAINING, CellState.RETURNING):
            cells.overlay[cell_id] = CellState.RETURNING
        self._tasks[cell_id] = asyncio.create_task(
            self._run(cell_id, target, reason), name=f"transition.{cell_id}"
        )

    def resume(self, cell_id: str, body: dict[str, Any]) -> None:
        """A transition recorded by an earlier leader: run it again from the top."""
        try:
            target = CellState.from_name(str(body.get("target", "")))
        except InvalidArgument:
            target = CellState.ROLLOUT
        self.telemetry.emit(
            "transition_resumed",
            f"resuming {cell_id} -> {target.value} ({body.get('reason', '')})",
            cell_id=cell_id,
        )
        self.start(cell_id, target, str(body.get("reason", "resumed")))

    def joined(self, cell_id: str) -> bool:
        """True once this leader term's JoinBatch to the cell succeeded."""
        return self.joins.joined(cell_id)

    def forget_joins(self) -> None:
        """A new term: the joins of an earlier one are not known to have landed."""
        self.joins.forget()

    def rejoin(self, cell_id: str) -> None:
        """JoinBatch for a cell that stays in training (the next batch), unless its join is
        already under way."""
        self.joins.rejoin(cell_id)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Runs ``coro`` in the background (joins, migrations); ``cancel_all`` cancels it."""
        task = asyncio.ensure_future(coro)
        self._side.add(task)
        task.add_done_callback(self._side.discard)
        return task

    async def cancel_all(self) -> None:
        tasks = [*self._tasks.values(), *self._side]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _done(self, cell_id: str) -> None:
        self._tasks.pop(cell_id, None)
        self.fleet.settle_overlays(self.running)
        self.changes.wake()

    async def _set_state(self, cell_id: str, state: CellState, reason: str, attempts: int = 0) -> None:
        await self.fleet.call(
            cell_id,
            lambda: self.peers.set_state(self.fleet.target(cell_id), self.lead.epoch, state, reason),
            attempts,
        )

    # The runs -----------------------------------------------------------------------------

    async def _run(self, cell_id: str, target: CellState, reason: str) -> None:
        lead, started = self.lead, self.clock()
        try:
            await lead.fenced(
                lead.store.put_transition(
                    cell_id, {"target": target.value, "reason": reason, "epoch": lead.epoch}
                )
            )
            failpoint("scheduler.transition.recorded")
            if target is CellState.TRAINING:
                await self._to_training(cell_id)
            else:
                await self._to_rollout(cell_id)
            failpoint("scheduler.transition.done")  # every step taken, the record still there
            if self.fleet.cells.overlay.get(cell_id) is target:  # not called off
                self.switch_times.record(target, self.clock() - started)
            await lead.fenced(lead.store.delete_transition(cell_id))
        except StaleEpoch as exc:
            lead.mark_deposed(exc)
        except CellGone:
            self.fleet.cells.overlay.pop(cell_id, None)
            self.telemetry.emit(
                "transition_abandoned",
                f"{cell_id} left the cluster during its move to {target.value}",
                cell_id=cell_id,
            )
            try:
                await lead.fenced(lead.store.delete_transition(cell_id))
            except StaleEpoch as exc:
                lead.mark_deposed(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("transition failed", extra={"cell_id": cell_id})
            self.fleet.cells.overlay.pop(cell_id, None)
            self.telemetry.emit(
                "transition_failed", f"{cell_id} -> {target.value} failed: {exc!r}", cell_id=cell_id
            )
            await self._call_off(cell_id, target)
        finally:
            self._done(cell_id)

    async def _call_off(self, cell_id: str, target: CellState) -> None:
        """After a failed move to training, a cell left DRAINING would hold every later move:
        call the drain off (DRAINING -> ROLLOUT) and drop the record; the policy decides again."""
        lead = self.lead
        try:
            if target is CellState.TRAINING and self.fleet.cells.states.get(cell_id) is CellState.DRAINING:
                await self._set_state(cell_id, CellState.ROLLOUT, "move failed; drain called off", attempts=5)
            await lead.fenced(lead.store.delete_transition(cell_id))
        except StaleEpoch as exc:
            lead.mark_deposed(exc)
        except (GyreError, CellGone) as exc:
            log.warning("could not call off %s: %r (the record stays for the next attempt)", cell_id, exc)

    async def _to_training(self, cell_id: str) -> None:
        await self._set_state(cell_id, CellState.DRAINING, "moving to training")
        failpoint("scheduler.transition.draining")
        moved = await self.reroute(cell_id)
        if moved is None:
            await self._set_state(cell_id, CellState.ROLLOUT, "move called off")
            self.fleet.cells.overlay[cell_id] = CellState.ROLLOUT
            self.telemetry.emit(
                "transition_called_off",
                f"called off {cell_id} -> TRAINING: no destination for its executions",
                cell_id=cell_id,
            )
            return
        await self._wait_empty(cell_id)
        await self._set_state(cell_id, CellState.TRAINING, "training")
        self.fleet.cells.overlay[cell_id] = CellState.TRAINING
        self.telemetry.emit(
            "cell_in_training", f"{cell_id} is training ({moved} executions rerouted)", cell_id=cell_id
        )
        # Outside the transition (a later return must not wait on it), after it.
        self.joins.start(cell_id, self._tasks.get(cell_id))

    async def reroute(self, cell_id: str) -> int | None:
        """Moves every route off ``cell_id``; None when destinations ran out."""
        fleet, lead = self.fleet, self.lead
        for _ in range(5):
            # Launches to this cell still in flight land first (a pending route has
            # mod_revision 0; its write would overwrite a rerouted one).
            for _ in range(500):
                if not any(r.mod_revision == 0 for r in fleet.routes.on_cell(cell_id)):
                    break
                await asyncio.sleep(0.01)
            async with fleet.placement_lock:
                leaving = fleet.routes.on_cell(cell_id)
                if any(r.mod_revision == 0 for r in leaving):
                    continue
                if not leaving:
                    return 0
                dests = pick_destinations(
                    fleet.cells,
                    fleet.routes,
                    cell_id,
                    len(leaving),
                    fleet.version,
                    fleet.planned,
                    fleet.spread,
                )
                if len(dests) < len(leaving):
                    return None
                pairs = [
                    (old, dataclasses.replace(old, cell_id=d.cell_id, target=d.target))
                    for old, d in zip(leaving, dests)
                ]
                try:
                    revs = await lead.fenced(lead.store.move_routes(pairs))
                except Conflict:
                    # A chunk may have gone through before another lost its guard: resync.
                    await self.reload_routes()
                    continue
                moves = []
                for (old, new), rev in zip(pairs, revs):
                    fleet.routes.put(dataclasses.replace(new, epoch=old.epoch + 1, mod_revision=rev))
                    moves.append(MoveOrder(old.execution_id, old.cell_id, new.cell_id, old.epoch + 1))
                    self.history.append(
                        "reroute",
                        lead.epoch,
                        rev=rev,
                        execution_id=old.execution_id,
                        from_cell=old.cell_id,
                        to_cell=new.cell_id,
                        route_epoch=old.epoch + 1,
                    )
            failpoint("scheduler.transition.rerouted")  # routes moved in etcd, routers not told
            self.reroutes += len(moves)
            self.telemetry.emit(
                "reroute",
                f"rerouted {len(moves)} executions off {cell_id}: "
                + ", ".join(sorted({f"{m.to_cell}" for m in moves})),
                cell_id=cell_id,
            )
            await self._tell_routers(moves)
            return len(moves)
        return None

    def migrate(self, execution_id: str, cell_id: str, reason: str) -> None:
        """Moves one live execution to ``cell_id`` (the policy's Migrate), in the background."""
        self._spawn(self._migrate(execution_id, cell_id, reason))

    async def _migrate(self, execution_id: str, cell_id: str, reason: str) -> bool:
        """The continuation reroute of one execution: CAS its route onto ``cell_id`` (which
        must be in rollout, serve the same policy version, and have a free slot), then
        Router.MoveExecutions. False (nothing changed) when any of that does not hold."""
        fleet, lead = self.fleet, self.lead
        async with fleet.placement_lock:
            old = fleet.routes.routes.get(execution_id)
            why = self._migration_refused(old, cell_id)
            if why or old is None:
                log.info("migration of %s to %s skipped: %s", execution_id, cell_id, why)
                return False
            dest = fleet.record(cell_id)
            new = dataclasses.replace(old, cell_id=cell_id, target=dest.target)
            try:
                rev = (await lead.fenced(lead.store.move_routes([(old, new)])))[0]
            except Conflict:
                await self.reload_routes()
                return False
            fleet.routes.put(dataclasses.replace(new, epoch=old.epoch + 1, mod_revision=rev))
            self.history.append(
                "reroute",
                lead.epoch,
                rev=rev,
                execution_id=execution_id,
                from_cell=old.cell_id,
                to_cell=cell_id,
                route_epoch=old.epoch + 1,
                migration=True,
            )
        self.reroutes += 1
        self.migrations += 1
        self.telemetry.emit(
            "migrated",
            f"migrated {execution_id} from {old.cell_id} to {cell_id}: {reason}",
            cell_id=cell_id,
            execution_id=execution_id,
        )
        await self._tell_routers([MoveOrder(execution_id, old.cell_id, cell_id, old.epoch + 1)])
        return True

    def _migration_refused(self, route: Route | None, cell_id: str) -> str:
        """Why a migration cannot happen now ("" when it can)."""
        fleet = self.fleet
        if route is None:
            return "no open route"
        if route.mod_revision == 0:
            return "its launch is still being written"
        if route.cell_id == cell_id:
            return "already there"
        dest = fleet.cells.get(cell_id)
        if dest is None or fleet.cells.state(cell_id) is not CellState.ROLLOUT or not dest.target:
            return f"{cell_id} is not a rollout engine"
        if self.running(cell_id):
            return f"{cell_id} is moving"
        if fleet.routes.counts().get(cell_id, 0) >= dest.slots:
            return f"{cell_id} has no free slot"
        if fleet.version(cell_id) != fleet.version(route.cell_id):
            return f"{cell_id} serves another policy version"
        return ""

    async def _tell_routers(self, moves: list[MoveOrder]) -> None:
        """Router.MoveExecutions on every router (a few tries: routers also follow the
        route keys, so a router that misses the call still converges)."""
        routers = self.fleet.all_router_targets()
        backoff = Backoff(0.1, 1.6)
        for attempt in range(5):
            if not routers or self.lead.deposed.is_set():
                return
            try:
                await self.peers.move_executions(routers, self.lead.epoch, moves)
                return
            except GyreError as exc:
                log.warning("MoveExecutions failed (attempt %d)", attempt + 1, extra={"error": repr(exc)})
                await backoff.sleep()

    def rescue(self, cell_id: str) -> None:
        """Moves the executions of a cell that left the cluster (lease lapsed) elsewhere."""
        if not self.running(cell_id):
            self._tasks[cell_id] = asyncio.create_task(self._rescue(cell_id), name=f"rescue.{cell_id}")

    async def _rescue(self, cell_id: str) -> None:
        try:
            n = len(self.fleet.routes.on_cell(cell_id))
            moved = await self.reroute(cell_id)
            if moved is None:
                self.telemetry.emit(
                    "rescue_failed",
                    f"{cell_id} is gone; no free slot for its {n} executions yet",
                    cell_id=cell_id,
                )
            else:
                self.telemetry.emit(
                    "rescued", f"{cell_id} is gone: rerouted its {moved} executions", cell_id=cell_id
                )
        except StaleEpoch as exc:
            self.lead.mark_deposed(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("rescue failed", extra={"cell_id": cell_id})
        finally:
            self._tasks.pop(cell_id, None)
            self.changes.wake()

    async def _wait_empty(self, cell_id: str) -> None:
        deadline = self.clock() + self.cfg.drain_timeout_s
        while self.clock() < deadline:
            try:
                if await self.peers.running_requests(self.fleet.target(cell_id)) == 0:
                    return
            except GyreError:
                pass
            await asyncio.sleep(0.1)
        self.telemetry.emit(
            "drain_timeout",
            f"{cell_id} still had requests after {self.cfg.drain_timeout_s:.0f} s; switching anyway",
            cell_id=cell_id,
        )

    async def _to_rollout(self, cell_id: str) -> None:
        state = self.fleet.cells.states.get(cell_id, CellState.STARTING)
        if state is CellState.DRAINING:
            await self._set_state(cell_id, CellState.ROLLOUT, "drain called off")
        elif state in (CellState.TRAINING, CellState.RETURNING):
            await self._set_state(cell_id, CellState.RETURNING, "returning to rollout")
            await self.publication.load(cell_id)
            await self._set_state(cell_id, CellState.ROLLOUT, "rollout")
        self.fleet.cells.overlay[cell_id] = CellState.ROLLOUT
        self.telemetry.emit(
            "cell_in_rollout",
            f"{cell_id} is back in rollout at policy v{self.fleet.version(cell_id)}",
            cell_id=cell_id,
        )
