"""What the scheduler tells the world and itself: events with the gauges of the moment,
Prometheus gauges, and the change signal that wakes the control loop and waiting acquires.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from services.scheduler.events import EventLog, Metrics
from services.scheduler.policy import CellState, CellView, LedgerCounts, Supply, capacity


@dataclasses.dataclass(frozen=True)
class Reading:
    """The numbers events and gauges report."""

    ledger: LedgerCounts
    cells: tuple[CellView, ...]
    supply: Supply
    leading: bool
    policy_version: int

    def gauges(self) -> dict[str, int]:
        """The gauges every event carries."""
        return {
            "waterlevel": self.ledger.waterlevel,
            "capacity": capacity(self.cells),
            "ready_groups": self.supply.ready_groups,
        }


class Changes:
    """Level-triggered wake-ups: anything that may let a waiter progress calls ``wake``."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        """Notifies waiters soon (callable from synchronous code)."""
        try:
            task = asyncio.get_running_loop().create_task(self.notify())
        except RuntimeError:
            return  # no loop: nobody can be waiting
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def wait(self, timeout_s: float) -> None:
        """Returns at the next notification or after ``timeout_s``."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait(), timeout_s)
            except TimeoutError:
                pass


class Telemetry:
    """Emits events (with the current gauges unless given) and updates the metrics."""

    def __init__(self, events: EventLog, metrics: Metrics | None, reading: Callable[[], Reading]) -> None:
        self.events = events
        self.metrics = metrics
        self._reading = reading

    def emit(self, kind: str, message: str, **kw: Any) -> None:
        if "waterlevel" not in kw:
            kw.update(self._reading().gauges())
        self.events.emit(kind, message, **kw)
        if self.metrics is not None and kind != "hold":
            self.metrics.events.labels(kind).inc()

    def gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        r = self._reading()
        c = r.ledger
        m.waterlevel.set(c.waterlevel)
        m.queued.set(c.queued)
        m.running.set(c.running)
        m.dispatched.set(c.dispatched)
        m.finished.set(c.finished)
        m.capacity.set(capacity(r.cells))
        m.supply.set(r.supply.ready_groups)
        m.supply_fraction.set(r.supply.fraction)
        m.leader.set(1 if r.leading else 0)
        m.policy_version.set(r.policy_version)
        for st in CellState:
            m.roles.labels(st.value).set(sum(1 for v in r.cells if v.state is st))
