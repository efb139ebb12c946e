"""Prometheus exposition of the dashboard: the scheduler's status as gauges, at /metrics.

A custom collector reads the timeline's latest status at scrape time (no copies to keep in
sync); each dashboard has its own registry, so several can live in one process (the demo).
The training diagnostics of the newest policy version (SchedulerStatus.training) are
``gyre_training_*`` gauges, present only while the status carries them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.dashboard.timeline import STATES, Timeline

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = {
    "waterlevel": "W = D - F: executions dispatched and not finished (current burst)",
    "capacity": "Rollout capacity: slots of standalone cells + elastic cells in rollout",
    "ready_groups": "Ready, unassigned groups, capped by what the batch still needs",
    "batch_size": "Groups per training batch",
    "policy_version": "Newest published policy version",
    "burst_id": "Current burst",
    "dispatched": "D: executions dispatched in the current burst",
    "launched": "L: executions launched in the current burst",
    "finished": "F: executions closed in the current burst",
    "running": "R = L - F",
    "queued": "Q = D - L",
    "epoch": "Fencing epoch of the scheduler leader that answered",
}
_COUNTERS = {
    "reroutes": "Executions rerouted so far",
    "bursts_completed": "Completed bursts",
    "transitions_to_training": "Cell transitions rollout -> training",
    "transitions_to_rollout": "Cell transitions training -> rollout",
}


_TRAINING = {
    "tokens": "Loss tokens of the training step that produced the newest policy version",
    "clip_fraction": "Share of loss tokens whose ratio the PPO clip cut off",
    "behaviour_weight_mean": "Mean behaviour weight pi_prox / pi_behaviour over the loss tokens",
    "behaviour_weight_max": "Largest behaviour weight pi_prox / pi_behaviour",
    "behaviour_weight_capped_share": "Share of loss tokens masked for a behaviour weight above the cap",
    "entropy": "Mean per-token entropy of the trained policy (nats)",
    "logprob_gap_lag0": "Mean |trainer - engine| log-prob of lag-0 tokens",
    "lag_mean": "Mean version lag of the loss tokens",
    "grad_norm": "Global gradient norm before clipping",
}


class StatusCollector(Collector):
    """Yields the latest status of ``timeline`` as ``gyre_status_*`` metrics."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline

    def collect(self) -> Iterator[Metric]:
        stats = self._timeline.stats
        polls = CounterMetricFamily("gyre_dashboard_polls", "GetStatus polls by result", labels=["result"])
        polls.add_metric(["ok"], stats.ok)
        polls.add_metric(["error"], stats.errors)
        polls.add_metric(["stale"], stats.stale)
        yield polls
        latest = self._timeline.latest
        if latest is None:
            return
        values = {**latest, **latest["ledger"]}
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"gyre_status_{name}", doc, value=values[name])
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"gyre_status_{name}", doc, value=values[name])
        state = GaugeMetricFamily(
            "gyre_status_cell_state", "1 for the state each cell is in", labels=["cell_id", "kind", "state"]
        )
        slots = GaugeMetricFamily(
            "gyre_status_cell_slots", "Rollout slots of each cell", labels=["cell_id", "kind"]
        )
        routed = GaugeMetricFamily(
            "gyre_status_cell_routed", "Executions routed to each cell", labels=["cell_id", "kind"]
        )
        for cell in latest["cells"]:
            kind = cell["kind"].lower()
            for s in STATES:
                state.add_metric([cell["cell_id"], kind, s.lower()], 1.0 if cell["state"] == s else 0.0)
            slots.add_metric([cell["cell_id"], kind], cell["slots"])
            routed.add_metric([cell["cell_id"], kind], cell["routed"])
        yield state
        yield slots
        yield routed
        yield from _training(latest["training"])


def _training(training: dict[str, Any] | None) -> Iterator[Metric]:
    """The ``gyre_training_*`` gauges (none while the status carries no diagnostics; a
    non-finite value, which the timeline keeps as None, is left out)."""
    if training is None:
        return
    yield GaugeMetricFamily(
        "gyre_training_policy_version",
        "Policy version the training diagnostics belong to",
        value=training["policy_version"],
    )
    for name, doc in _TRAINING.items():
        if training[name] is not None:
            yield GaugeMetricFamily(f"gyre_training_{name}", doc, value=training[name])
    hist = training["lag_hist"]
    lag = GaugeMetricFamily(
        "gyre_training_lag_tokens",
        "Loss tokens by version lag (the last bucket: that lag or more)",
        labels=["lag"],
    )
    for i, count in enumerate(hist):
        if count is not None:
            lag.add_metric([f"{i}+" if i == len(hist) - 1 else str(i)], count)
    yield lag


def make_registry(timeline: Timeline) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(timeline))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
