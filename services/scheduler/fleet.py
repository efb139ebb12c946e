"""The fleet: cells (registrations, lifecycle states, the scheduler's overlays), the routes
to their engines, the routers, the policy version each engine serves, and commands to cell
agents retried while the cell lives.

Inputs come from etcd watches (``on_cells``, ``on_cell_states``, ``on_routers``); routes are
the leader's own writes (see :mod:`executions` and :mod:`transitions`), mirrored here. The
tables themselves are pure (:mod:`placement`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from gyre.backoff import Backoff
from gyre.errors import FailedPrecondition, GyreError, StaleEpoch
from gyre.etcd.values import CellRecord, Route, endpoint_target
from services.scheduler.leadership import Leadership
from services.scheduler.placement import CellTable, RouteTable

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_REFUSALS = 15
"""FAILED_PRECONDITION answers (not a stale epoch) a command survives before it gives up."""


class CellGone(Exception):
    """The cell's registration vanished (its lease lapsed) mid-operation."""


class Fleet:
    """Cells, routes and routers as the leader sees them."""

    def __init__(self, lead: Leadership, router_target: str = "") -> None:
        self.lead = lead
        self.cells = CellTable()
        self.routes = RouteTable()
        self.router_targets: list[str] = []
        self.placement_lock = asyncio.Lock()
        """Held while picking a slot and reserving it (launches, reroutes)."""
        self.planned: tuple[str, ...] = ()
        """Cells the policy plans to move to training next (PlanMoves): placement avoids them."""
        self.spread = False
        """Placement fills the least loaded rollout cell first (else packs by index)."""
        self._router_target = router_target
        self._registrations: list[bytes] = []
        self._states: dict[str, bytes] = {}
        self._loaded: dict[str, int] = {}
        self._missing_since: dict[str, float] = {}
        self._reg_revisions: dict[str, int] = {}
        self._down_at: dict[str, int] = {}

    # Inputs from watches ------------------------------------------------------------------

    def on_cells(self, items: Mapping[bytes, Any]) -> None:
        self._registrations = [kv.value for kv in items.values()]
        self._reg_revisions = {
            kv.key.decode(errors="replace").rsplit("/", 1)[-1]: getattr(kv, "mod_revision", 0)
            for kv in items.values()
        }
        # A dead cell's mark holds while its old registration lingers; a new put (the cell
        # restarted and registered again) or its removal (the lease lapsed) clears it.
        for cid, rev in list(self._down_at.items()):
            if self._reg_revisions.get(cid) != rev:
                del self._down_at[cid]
                self.cells.down.discard(cid)
        self.cells.refresh(self._registrations, self._states)

    def mark_down(self, cell_id: str) -> None:
        """The cell's engine is dead (reported by a router, confirmed by a probe): no new
        work goes there, even before its registration lapses."""
        self._down_at[cell_id] = self._reg_revisions.get(cell_id, 0)
        self.cells.down.add(cell_id)

    def on_cell_states(self, items: Mapping[bytes, Any]) -> None:
        self._states = {kv.key.decode().rsplit("/", 1)[-1]: kv.value for kv in items.values()}
        self.cells.refresh(self._registrations, self._states)

    def on_routers(self, items: Mapping[bytes, Any]) -> None:
        targets = {endpoint_target(kv.value) for kv in items.values()}
        self.router_targets = sorted(targets - {""})

    def settle_overlays(self, moving: Callable[[str], bool]) -> None:
        """Drops overlays the agents have confirmed (and whose move is over)."""
        for cid, want in list(self.cells.overlay.items()):
            if self.cells.states.get(cid) is want and not moving(cid):
                del self.cells.overlay[cid]

    def all_router_targets(self) -> list[str]:
        targets = list(self.router_targets)
        if self._router_target and self._router_target not in targets:
            targets.append(self._router_target)
        return targets

    # Routes -------------------------------------------------------------------------------

    def reset_routes(
        self, routes: Iterable[Route], is_open: Callable[[str], bool], keep_pending: bool = False
    ) -> None:
        """Replaces the route table with ``routes`` of open executions; with ``keep_pending``,
        launches still in flight (mod_revision 0, not in etcd yet) keep their slots."""
        table = RouteTable()
        for r in routes:
            if is_open(r.execution_id):
                table.put(r)
        if keep_pending:
            for r in self.routes.routes.values():
                if r.mod_revision == 0 and r.execution_id not in table.routes:
                    table.put(r)
        self.routes = table

    def orphaned(self, now_s: float, grace_s: float) -> list[str]:
        """Cells that still hold routes but whose registration has been gone for ``grace_s``."""
        routed = self.routes.counts()
        for cid in list(self._missing_since):
            if cid not in routed or cid in self.cells.records:
                del self._missing_since[cid]
        out = []
        for cid in routed:
            if cid in self.cells.records:
                continue
            since = self._missing_since.setdefault(cid, now_s)
            if now_s - since >= grace_s:
                out.append(cid)
        return out

    # Engines ------------------------------------------------------------------------------

    def record(self, cell_id: str) -> CellRecord:
        rec = self.cells.get(cell_id)
        if rec is None:
            raise CellGone(cell_id)
        return rec

    def target(self, cell_id: str) -> str:
        """The cell agent's address; CellGone once its registration is gone."""
        return self.record(cell_id).target

    def version(self, cell_id: str) -> int:
        """The policy version the cell's engine serves (registration or our last load)."""
        rec = self.cells.get(cell_id)
        return max(rec.policy_version if rec else 0, self._loaded.get(cell_id, 0))

    def loaded(self, cell_id: str, version: int) -> None:
        self._loaded[cell_id] = max(self._loaded.get(cell_id, 0), version)

    async def call(self, cell_id: str, fn: Callable[[], Awaitable[T]], attempts: int = 0) -> T:
        """Calls ``fn`` (a command to the cell) until it succeeds; gives up when the cell is
        gone (CellGone), after ``attempts`` tries if set, after MAX_REFUSALS refusals, or when
        our epoch is refused by a newer leader's (StaleEpoch)."""
        backoff = Backoff(0.1, 2.0)
        n = refused = 0
        while True:
            if self.lead.deposed.is_set():
                raise StaleEpoch("deposed")
            if self.cells.get(cell_id) is None:
                raise CellGone(cell_id)
            try:
                return await fn()
            except FailedPrecondition as exc:
                await self.lead.check_refusal(exc)
                err: GyreError = exc
                refused += 1
            except GyreError as exc:
                err = exc
            n += 1
            # Unreachable cells are retried until they come back or their lease lapses; a
            # refusal (an illegal state for the command) is retried a bounded number of times:
            # the operation then fails, and the policy decides again on fresh state.
            if (attempts and n >= attempts) or refused >= MAX_REFUSALS:
                raise err
            log.warning("command to %s failed; retrying", cell_id, extra={"error": repr(err)})
            await backoff.sleep()
