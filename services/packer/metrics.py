"""The packer's Prometheus metrics (a private registry, served when ``metrics_port`` is set):
the conservation counters, supply and claims, refreshed on every change."""

from __future__ import annotations

from typing import Any

from services.packer.packer import Packer


class PackerMetrics:
    """Gauges mirroring :meth:`Packer.counters` and :meth:`Packer.supply`."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()

        def g(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return Gauge(f"gyre_packer_{name}", doc, labels, registry=self.registry)

        self.turns = g(
            "turns",
            "Turns by where they are: produced, consumed, pending, ready, assigned, packed.",
            ("where",),
        )
        self.dropped = g("turns_dropped", "Turns dropped, by reason.", ("reason",))
        self.late_turns = g("late_turns", "Turns refused because their group was already ready.")
        self.turns_replaced = g(
            "turns_replaced", "Turns of retried model calls that replaced their first try's turn."
        )
        self.claims_expired = g("claims_expired", "Claims returned to the pool after their TTL.")
        self.policy_version = g("policy_version", "Newest policy version known.")
        self.ready_groups = g("supply_ready_groups", "Ready unassigned groups, capped by the batch's need.")
        self.batch_needs = g("batch_needs", "Groups the batch being filled still needs.")
        self.batch_id = g("batch_filling", "The batch being filled.")
        self.unclaimed = g("unclaimed_micro_steps", "Micro-steps free to claim.")

    def update(self, packer: Packer) -> None:
        c, s = packer.counters(), packer.supply()
        for where in ("produced", "consumed", "pending", "ready", "assigned", "packed"):
            self.turns.labels(where).set(c[where])
        for reason, n in c["dropped"].items():
            self.dropped.labels(reason).set(n)
        self.late_turns.set(c["late_turns"])
        self.turns_replaced.set(c["turns_replaced"])
        self.claims_expired.set(c["claims_expired"])
        self.policy_version.set(c["policy_version"])
        self.ready_groups.set(s["ready_groups"])
        self.batch_needs.set(s["batch_needs"])
        self.batch_id.set(s["batch_id"])
        self.unclaimed.set(s["unclaimed_micro_steps"])

    def serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=self.registry)

    async def run(self, packer: Packer) -> None:
        """A supervised task: refreshes the gauges on every change (at most every second)."""
        while True:
            self.update(packer)
            await packer.wait_changed(1.0)
