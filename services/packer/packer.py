"""The packer's controller: validates requests against the state, decides (readiness,
advantages, staleness, batch assignment, packing, claims, expiry), and commits each decision
as an event: applied in memory, appended to the WAL, made durable before the caller hears.

Every public operation runs its checks and its commits without awaiting in between, so
concurrent callers on the one event loop see each other's effects atomically (no two claims
can take the same micro-step). A refused request raises before its first commit and so
changes nothing. After every change the conservation invariant is rechecked; a violation
is a bug and stops the process (FatalError).

The controller is split by concern, as the scheduler is; each part gets the parts it needs
through its constructor, and :class:`Packer` composes them behind the one interface the
servicer, ``__main__`` and the tests use:

* :mod:`.journal` - the state, the WAL, replay, committing events, what follows every change;
* :mod:`.intake` - turns, finish reports, readiness, advantages, staleness of ready groups;
* :mod:`.packing` - micro-steps built from a batch's segments, the sequences claims hand out;
* :mod:`.claims` - the claim table: claims, acknowledgements, lease renewal, expiry;
* :mod:`.batches` - which batch a request names, the pump, sealing, attempts and commits;
* :mod:`.supply` - what the scheduler and the metrics read: the supply signal, the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

from gyre.errors import FatalError
from gyre.fencing import FenceGuard
from services.packer.batches import Batches
from services.packer.claims import Claims
from services.packer.config import PackerConfig
from services.packer.intake import LATE_TURN, Intake
from services.packer.journal import Journal
from services.packer.model import ClaimResult, Finish, MicroStepView, Turn, WireCache
from services.packer.packing import Packing
from services.packer.records import Batch, Event
from services.packer.state import PackerState
from services.packer.supply import SupplySignal
from services.packer.wal import EventLog

__all__ = ["LATE_TURN", "Packer"]


class Packer:
    """The trajectory buffer, packing buffer and claim table of one packer process."""

    def __init__(
        self,
        config: PackerConfig,
        log_: EventLog,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = True,
    ) -> None:
        self.cfg = config
        self.clock = clock
        self.state = PackerState()
        self.journal = Journal(state=self.state, log=log_, strict=strict, forward=self._forward)
        self.packing = Packing(cfg=config, journal=self.journal)
        self.intake = Intake(cfg=config, clock=clock, journal=self.journal, packing=self.packing)
        self.batches = Batches(cfg=config, journal=self.journal, intake=self.intake, packing=self.packing)
        self.claims = Claims(
            cfg=config, clock=clock, journal=self.journal, batches=self.batches, packing=self.packing
        )
        self.signal = SupplySignal(state=self.state, intake=self.intake, clock=clock)

    def _forward(self) -> None:
        """What moves work forward after every change (the journal calls it)."""
        self.batches.pump()

    # The parts' state, under the names callers know ------------------------------------------

    @property
    def log(self) -> EventLog:
        return self.journal.log

    @log.setter
    def log(self, log_: EventLog) -> None:
        self.journal.log = log_

    @property
    def strict(self) -> bool:
        return self.journal.strict

    @property
    def changes(self) -> int:
        return self.journal.changes

    @property
    def fatal(self) -> BaseException | None:
        return self.journal.fatal

    @property
    def skipped(self) -> list[int]:
        return self.journal.skipped

    @property
    def wire(self) -> WireCache:
        return self.packing.wire

    @property
    def fence(self) -> FenceGuard:
        return self.batches.fence

    @property
    def late_turns(self) -> int:
        return self.intake.late_turns

    @property
    def turns_replaced(self) -> int:
        return self.intake.turns_replaced

    # Start-up and periodic work ----------------------------------------------------------

    def recover(self, events: Iterable[Event]) -> int:
        """Replays the WAL (:meth:`Journal.replay`); held claims get a fresh TTL (their cells
        may still be training), complete groups a fresh grace period, and after a restart
        no group becomes ready for ``restart_grace_s``. Returns the events applied."""
        n = self.journal.replay(events)
        now = self.clock()
        self.claims.recovered(now)
        self.intake.recovered(now, self.journal.restarted)
        self.batches.open_first()
        self.journal.after()
        return n

    async def reap(self) -> int:
        """Periodic work: returns expired claims to the pool (how many) and makes groups
        whose grace period has passed ready."""
        n = self.claims.reap_expired()
        if n or self.intake.in_grace:
            self.journal.after()
            await self.journal.sync()
        self.packing.forget_gone()  # executions trained or dropped: their bytes go
        return n

    async def run_reaper(self) -> None:
        """A supervised task: expiry of claims, the invariants' recount when they are not
        checked after every change (``strict``), and the fatal-error watch."""
        while True:
            await asyncio.sleep(self.cfg.reap_interval_s)
            if not self.strict and self.fatal is None:
                with contextlib.suppress(FatalError):
                    self.journal.check()  # keeps the violation in ``fatal``
            if self.fatal is not None:
                raise FatalError(f"packer invariant broken: {self.fatal}")
            await self.reap()

    # Intake ------------------------------------------------------------------------------

    async def record_turn(self, turn: Turn) -> bool:
        return await self.intake.record_turn(turn)

    async def report_finish(self, finish: Finish) -> bool:
        return await self.intake.report_finish(finish)

    async def observe_policy(self, version: int) -> None:
        await self.intake.observe_policy(version)

    def trajectory(self, execution_id: str, call_key: str = "") -> tuple[Turn | None, int]:
        return self.intake.trajectory(execution_id, call_key)

    # Claims ------------------------------------------------------------------------------

    async def claim(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str = ""
    ) -> ClaimResult:
        return await self.claims.claim(cell_id, batch_id, version, wait_s, claim_id)

    async def claim_many(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str, max_n: int
    ) -> tuple[ClaimResult, list[MicroStepView]]:
        return await self.claims.claim_many(cell_id, batch_id, version, wait_s, claim_id, max_n)

    async def ack(self, cell_id: str, batch_id: int, micro_step_id: str) -> bool:
        return await self.claims.ack(cell_id, batch_id, micro_step_id)

    async def ack_many(self, cell_id: str, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        return await self.claims.ack_many(cell_id, batch_id, micro_step_ids)

    async def keep(self, cell_id: str) -> int:
        return await self.claims.keep(cell_id)

    async def release_cell(self, cell_id: str) -> int:
        return await self.claims.release_cell(cell_id)

    # Batches -----------------------------------------------------------------------------

    async def open_batch(self, cell_id: str, batch_id: int) -> Batch:
        return await self.batches.open_batch(cell_id, batch_id)

    async def commit(self, cell_id: str, batch_id: int) -> tuple[Batch, bool]:
        return await self.batches.commit(cell_id, batch_id)

    async def seal(self, batch_id: int, epoch: int) -> Batch:
        return await self.batches.seal(batch_id, epoch)

    def batch_status(self, batch_id: int) -> dict[str, Any]:
        return {**self.batches.status(batch_id), "counters": self.counters()}

    # Supply ------------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        return self.signal.counters()

    def supply(self) -> dict[str, Any]:
        return self.signal.supply()

    async def wait_changed(self, timeout_s: float | None) -> None:
        """Returns at the next change, or after ``timeout_s``."""
        await self.journal.wait_changed(timeout_s)
