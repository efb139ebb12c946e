"""Prometheus exposition of the router's counters (``metrics_port``; off when 0), read from
RouterStats and the TurnRecorder at scrape time, in a private registry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from services.router.calls import RouterStats
from services.router.trajectory import TrajectoryStore
from services.router.turns import TurnRecorder

_COUNTERS = {
    "reroutes": "Continuations started (scheduler moves and engine failures).",
    "moves": "Attempts moved to a new route by the scheduler.",
    "engine_failures": "Engine attempts that failed (died, hung, refused).",
    "failed_calls": "Model calls that ended in an error.",
    "kv_handoffs": "Continuations that imported the source's KV blocks.",
    "kv_recomputes": "Continuations that recomputed the prefix.",
    "aborts_sent": "Engine.Abort calls sent.",
    "closed_calls": "Model calls ended because their execution closed under them (e.g. cancelled).",
}


class RouterCollector:
    """A prometheus_client collector over live objects (no double bookkeeping)."""

    def __init__(
        self,
        stats: RouterStats,
        turns: TurnRecorder,
        routes_len: Any,
        trajectories: TrajectoryStore | None = None,
    ) -> None:
        self._stats = stats
        self._turns = turns
        self._routes_len = routes_len
        self._trajectories = trajectories

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily(
            "gyre_router_inflight_calls", "Model calls in flight.", value=self._stats.inflight
        )
        yield GaugeMetricFamily("gyre_router_routes", "Routes in the route table.", value=self._routes_len())
        yield GaugeMetricFamily(
            "gyre_router_turns_pending",
            "Turn records not yet acknowledged by the packer.",
            value=self._turns.pending,
        )
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"gyre_router_{name}", doc, value=getattr(self._stats, name))
        yield CounterMetricFamily(
            "gyre_router_turn_records", "Turn records acknowledged by the packer.", value=self._turns.sent
        )
        yield CounterMetricFamily(
            "gyre_router_turn_records_dropped",
            "Turn records dropped (buffer full).",
            value=self._turns.dropped,
        )
        if self._trajectories is not None:
            t = self._trajectories
            yield CounterMetricFamily(
                "gyre_router_turns_continued",
                "Completed calls whose prompt continued their execution's tokens.",
                value=t.continued,
            )
            breaks = CounterMetricFamily(
                "gyre_router_segment_breaks",
                "Completed calls that started a new trajectory segment, by reason.",
                labels=["reason"],
            )
            for reason, n in sorted(t.breaks.items()):
                breaks.add_metric([reason], n)
            yield breaks
            yield CounterMetricFamily(
                "gyre_router_trajectories_resumed",
                "Executions this router continued from the packer's record of their turns.",
                value=t.resumed,
            )
            yield CounterMetricFamily(
                "gyre_router_trajectory_resumes_failed",
                "Packer GetTrajectory calls that failed (the call was rendered afresh).",
                value=t.resume_failed,
            )
            yield CounterMetricFamily(
                "gyre_router_calls_retried",
                "Completed calls that retried the call of the same idempotency key.",
                value=t.retried,
            )


def serve(host: str, port: int, collector: RouterCollector) -> None:
    """Starts the /metrics HTTP server (a daemon thread)."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
