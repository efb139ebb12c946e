"""The cell agent's Prometheus metrics (a private registry, served when ``metrics_port`` is
set): lifecycle state, load, policy version, tokens served, role changes and probe latency."""

from __future__ import annotations

import asyncio
from typing import Any

from services.cell_agent.cell import Cell
from services.cell_agent.lifecycle import CellState


class CellMetrics:
    """Gauges mirroring one :class:`Cell`, refreshed by :meth:`run`."""

    def __init__(self, cell_id: str) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()

        def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(f"gyre_cell_{name}", doc, ("cell_id", *labels), registry=self.registry)

        self._cell_id = cell_id
        self.state = g("state", "1 for the cell's current lifecycle state, 0 for the others.", ("state",))
        self.running = g("running_requests", "Requests the engine holds.")
        self.accepting = g("accepting", "1 while the cell takes new requests.")
        self.sleeping = g("engine_sleeping", "1 while rollout resources are released.")
        self.policy_version = g("policy_version", "Policy version the engine serves.")
        self.epoch = g("fence_epoch", "Highest scheduler fencing epoch committed.")
        self.tokens = g("tokens_generated", "Tokens streamed to callers since start.")
        self.transitions = g("role_transitions", "Lifecycle transitions since start.")
        self.probe_s = g("probe_seconds", "Duration of the last health probe.")

    def update(self, cell: Cell) -> None:
        c = self._cell_id
        s = cell.status()
        for state in CellState:
            self.state.labels(c, state.name).set(1 if state is s.state else 0)
        self.running.labels(c).set(s.running_requests)
        self.accepting.labels(c).set(1 if s.accepting else 0)
        self.sleeping.labels(c).set(1 if s.sleeping else 0)
        self.policy_version.labels(c).set(s.policy_version)
        self.epoch.labels(c).set(s.epoch)
        self.tokens.labels(c).set(cell.tokens_generated)
        self.transitions.labels(c).set(len(cell.lifecycle.history))
        self.probe_s.labels(c).set(cell.last_probe_s)

    def serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)

    async def run(self, cell: Cell, period_s: float = 1.0) -> None:
        """A supervised task: refreshes the gauges every ``period_s``."""
        while True:
            self.update(cell)
            await asyncio.sleep(period_s)
