"""Decisions and happenings with their reasons (the WatchEvents stream), and the metrics.

:class:`EventLog` keeps the last ``kept`` events with increasing sequence numbers; readers
wait on it for events after the one they saw. :class:`Metrics` are Prometheus gauges and
counters for W, Q, R, capacity, supply and roles, served over HTTP when a port is set.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Event:
    """One event (mirrors gyre.v1.SchedulerEvent)."""

    seq: int
    time_s: float
    kind: str
    message: str
    cell_id: str = ""
    execution_id: str = ""
    waterlevel: int = 0
    capacity: int = 0
    ready_groups: int = 0


class EventLog:
    """A bounded, sequenced event log with waiters."""

    def __init__(self, kept: int = 10_000, clock: Callable[[], float] = time.time) -> None:
        self._events: collections.deque[Event] = collections.deque(maxlen=kept)
        self._seq = 0
        self._clock = clock
        self._cond = asyncio.Condition()
        self._last_hold = ""
        self._wakers: set[asyncio.Task[None]] = set()

    def emit(
        self,
        kind: str,
        message: str,
        *,
        cell_id: str = "",
        execution_id: str = "",
        waterlevel: int = 0,
        capacity: int = 0,
        ready_groups: int = 0,
    ) -> Event:
        if kind == "hold":
            # Holds repeat every control-loop tick: keep one per distinct reason.
            if message == self._last_hold:
                return self._events[-1] if self._events else Event(0, 0.0, kind, message)
            self._last_hold = message
        self._seq += 1
        ev = Event(
            self._seq, self._clock(), kind, message, cell_id, execution_id, waterlevel, capacity, ready_groups
        )
        self._events.append(ev)
        # Holds change with every close (their numbers move): kept in the stream, not the log.
        log.log(
            logging.DEBUG if kind == "hold" else logging.INFO,
            message,
            extra={"event": kind, "cell_id": cell_id, "execution_id": execution_id},
        )
        self._wake()
        return ev

    def _wake(self) -> None:
        async def _notify() -> None:
            async with self._cond:
                self._cond.notify_all()

        try:
            task = asyncio.get_running_loop().create_task(_notify())
        except RuntimeError:
            return  # no loop (pure tests): nobody can be waiting
        self._wakers.add(task)  # kept until done: the loop holds only a weak reference
        task.add_done_callback(self._wakers.discard)

    def after(self, seq: int) -> list[Event]:
        return [e for e in self._events if e.seq > seq]

    async def wait_after(self, seq: int, timeout_s: float) -> list[Event]:
        """Events after ``seq``; waits up to ``timeout_s`` for one if there are none yet."""
        got = self.after(seq)
        if got:
            return got
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self._seq > seq), timeout_s)
            except TimeoutError:
                return []
        return self.after(seq)


class Metrics:
    """Prometheus metrics of the scheduler (a private registry; served if a port is set)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()

        def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"gyre_scheduler_{name}", doc, labels, registry=self.registry)

        self.waterlevel = g("waterlevel", "W = D - F: dispatched executions not yet finished.")
        self.queued = g("queued", "Q = D - L.")
        self.running = g("running", "R = L - F.")
        self.dispatched = g("dispatched", "D, all bursts.")
        self.finished = g("finished", "F, all bursts.")
        self.capacity = g("capacity", "Rollout slots: standalone + elastic cells in rollout.")
        self.supply = g("supply_ready_groups", "Ready unassigned groups, capped by the batch's need.")
        self.supply_fraction = g("supply_fraction", "Ready groups / batch size.")
        self.roles = g("cells", "Cells by lifecycle state.", ("state",))
        self.leader = g("leader", "1 while this process leads.")
        self.policy_version = g("policy_version", "Newest published policy version.")
        self.events = Counter("gyre_scheduler_events", "Events by kind.", ("kind",), registry=self.registry)

    def serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)
