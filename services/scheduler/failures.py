"""Engine failures reported by routers: a dead engine is noticed in about a second.

Without reports a SIGKILLed cell is noticed only when its lease lapses (``lease_ttl_s``)
plus ``orphan_grace_s``. A router sees the failure first (the stream breaks, the connection
is refused) and reports it with ``SchedulerControl.ReportEngineFailure``. The leader does
not take a report on trust (a broken stream can be the network): it probes the cell agent
(``GetLoad`` within ``engine_probe_timeout_s``; one probe per cell at a time). A cell that
does not answer, or whose registration is already gone, is marked down (FAILED to placement
and the policy, until it registers again) and its live executions are rerouted at once; the
routers holding their calls continue them at the destinations.
"""

from __future__ import annotations

import asyncio
import logging

from gyre.errors import DeadlineExceeded, GyreError, InvalidArgument, Unavailable
from services.scheduler.parts import Part, Shared
from services.scheduler.transitions import TransitionRunner

log = logging.getLogger(__name__)


class EngineFailures(Part):
    """Probes reported engines; marks the dead ones down and reroutes their executions."""

    def __init__(self, *, shared: Shared, transitions: TransitionRunner) -> None:
        super().__init__(shared=shared)
        self.transitions = transitions
        self.probe_timeout_s = self.cfg.engine_probe_timeout_s
        self._probes: dict[str, asyncio.Task[bool]] = {}
        self.reports = 0

    async def report(self, cell_id: str, target: str, reason: str) -> tuple[bool, int]:
        """(dead, executions on the cell). Only the leader acts (UNAVAILABLE elsewhere)."""
        if not 1 <= len(cell_id) <= 128:
            raise InvalidArgument("cell_id must hold 1..128 characters")
        if len(target) > 256:
            raise InvalidArgument("target must hold at most 256 characters")
        self.lead.require()
        self.reports += 1
        executions = len(self.fleet.routes.on_cell(cell_id))
        rec = self.fleet.cells.get(cell_id)
        if rec is not None and target and rec.target != target:
            return False, executions  # about an older address of the cell: nothing to do
        dead = rec is None or cell_id in self.fleet.cells.down or await self._probe(cell_id, rec.target)
        if not dead:
            return False, executions
        if cell_id not in self.fleet.cells.down:
            self.fleet.mark_down(cell_id)
            self.telemetry.emit(
                "engine_dead",
                f"{cell_id}: engine failure reported ({reason[:512]}) and the "
                f"cell does not answer: rerouting its {executions} executions now",
                cell_id=cell_id,
            )
        if executions:
            self.transitions.rescue(cell_id)
        return True, executions

    async def _probe(self, cell_id: str, target: str) -> bool:
        """True when the cell agent does not answer within the probe timeout."""
        task = self._probes.get(cell_id)
        if task is None:
            task = asyncio.create_task(self._probe_once(target), name=f"probe.{cell_id}")
            self._probes[cell_id] = task
            task.add_done_callback(lambda _t: self._probes.pop(cell_id, None))
        return await asyncio.shield(task)

    async def _probe_once(self, target: str) -> bool:
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await self.peers.running_requests(target)
        except (TimeoutError, Unavailable, DeadlineExceeded) as exc:
            log.info("engine probe failed", extra={"target": target, "error": repr(exc)})
            return True
        except GyreError as exc:  # it answered (with an error): alive, not proven dead
            log.info("engine probe answered with an error", extra={"target": target, "error": repr(exc)})
        return False
