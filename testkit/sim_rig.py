"""The simulator's test rig: a small scenario that uses every mechanism in seconds of wall
time, and a driver that checks the conservation invariants at every decision boundary."""

from __future__ import annotations

from pathlib import Path

from services.scheduler import policy as P
from sim.cluster import ExecState, Role
from sim.config import ClusterConfig, LogNormal, ScenarioConfig, SimConfig, TrainingConfig, load_config
from sim.driver import Driver

BASE = load_config(str(Path(__file__).resolve().parents[1] / "bench" / "cluster.yaml"))
"""The benchmark's configuration (``bench/cluster.yaml``)."""


def small_config(**cost) -> tuple[SimConfig, ScenarioConfig]:
    """Profile A with short episodes on 8 cells: seconds of wall time, every mechanism used."""
    a = BASE.profiles["A"].model_copy(
        update={
            "turns": LogNormal(median=6, sigma=0.5, lo=1, hi=20),
            "initial_prompt_tokens": 800,
        }
    )
    cfg = BASE.model_copy(
        update={
            "profiles": {"A": a},
            "cost": BASE.cost.model_copy(update=cost),
            "variants": {},
        }
    )
    sc = ScenarioConfig(
        name="small",
        profile="A",
        seed=3,
        cluster=ClusterConfig(cells=8, standalone_cells=1, slots_per_cell=6),
        training=TrainingConfig(batch_groups=8, overprovision=0.5, max_staleness=1, updates=3),
    )
    return cfg, sc


class CheckingDriver(Driver):
    """Checks the invariants at every decision boundary."""

    checks = 0

    def boundary(self) -> None:
        super().boundary()
        cl = self.cluster
        led = cl.ledger
        states = {s: 0 for s in ExecState}
        for ex in cl.executions:
            states[ex.state] += 1
        assert len(cl.executions) == led.dispatched
        assert states[ExecState.CLOSED] == led.finished
        assert states[ExecState.QUEUED] == led.dispatched - led.launched
        assert led.dispatched - led.finished >= 0
        routed = 0
        for c in cl.cells:
            assert len(c.execs) <= c.slots
            if c.execs:
                assert c.role in (Role.ROLLOUT,), f"{c.cid} is {c.role} with executions routed to it"
            routed += len(c.execs)
            for ex in c.execs.values():
                assert ex.cell is c and ex.state not in (ExecState.CLOSED, ExecState.QUEUED)
        homeless = len(cl.homeless)
        assert routed + homeless == led.launched - led.finished
        if self.spec.name in ("waterlevel", "gyre"):
            views = self.snapshot().cells
            assert P.is_prefix(views)
        # The cancel-early rule: no unassigned group the trainer can no longer use is kept.
        tr = cl.trainer
        lo = P.staleness.oldest_usable(tr.version, tr.needs == 0, tr.max_staleness)
        assert all(u >= lo for u in cl.live)
        assert all(g.version >= lo for g in tr.pool)
        for vl in cl.versions.values():
            assert vl.finished <= vl.launched <= vl.dispatched
            assert vl.ready + vl.consumed + vl.cancelled <= vl.groups
        CheckingDriver.checks += 1
