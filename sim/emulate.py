"""The seam for item 2 of the cluster benchmark: the same scenario on the real services
(etcd, scheduler, router, packer, cell agents with mock engines whose timing model is
``sim.cost``, time-scaled), to check that the simulator tells the truth.

Plan (not built yet, see ``run_emulated``): start a private etcd and every service as a
process (``gyre.testing.procs.ServiceProcess``) with 16+ cell agents on ``engine: mock``;
give the mock engine the simulator's decode/prefill/switch costs divided by ``time_scale``;
replay the scenario's trace through a harness driver (AcquireExecution, one router call per
turn with the episode's token counts, tool waits as sleeps, FinishExecution); read the
update times from the scheduler's event stream; run the simulator on the identical
scenario at the same cell count; report both times to N updates and their relative
difference against a stated tolerance.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from sim.config import ScenarioConfig, SimConfig

REQUIRED_MODULES = (
    "services.scheduler.__main__",
    "services.router.__main__",
    "services.packer.__main__",
    "services.cell_agent.__main__",
)


@dataclass(frozen=True)
class EmulationResult:
    """Agreement between the emulated cluster and the simulator on one scenario."""

    ran: bool
    reason: str
    emulated_time_to_n_s: float = float("nan")
    simulated_time_to_n_s: float = float("nan")
    relative_difference: float = float("nan")
    tolerance: float = 0.15


def missing_services() -> list[str]:
    """Service entry points that do not exist in this checkout."""
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def run_emulated(cfg: SimConfig, scenario: ScenarioConfig, *, cells: int = 16,
                 time_scale: float = 50.0) -> EmulationResult:
    """Runs ``scenario`` on the real services; skipped (``ran=False`` with the reason) until
    the emulation driver is written."""
    missing = missing_services()
    if missing:
        return EmulationResult(False, "services missing: " + ", ".join(missing))
    return EmulationResult(
        False,
        "not built in this round. The services exist, and the mock engine's MockTiming is the same "
        "roofline as sim.cost (mock_* fields of the cell agent config, mock_time_scale), but two parts "
        "are missing: (1) a harness replay driver that plays the scenario's trace (turn prompt/output "
        "token counts, tool waits scaled) through HarnessClient and the router; (2) a trainer whose step "
        "time follows sim.cost (the elastic cells run real torch steps of the tiny model, whose duration "
        f"has nothing to do with a 7B/H200 model). Planned: {cells} cells, time scale 1/{time_scale:g}, "
        "agreement on time to N updates within 15%.",
    )
