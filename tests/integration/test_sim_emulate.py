"""The emulated cluster runs end to end: real etcd, scheduler (the default policy, gyre),
router, packer and 4 elastic cell agents (mock engines, cost-model trainer) play a small
scaled scenario's trace until 2 policy updates are published, and both the emulated and the
simulated time to N are finite.
(Agreement within the tolerance is the benchmark's figure, not asserted here.)"""

from __future__ import annotations

import json
import math

import pytest

from sim.config import load_config
from sim.emulate import run_emulated, small_scenario

pytestmark = pytest.mark.timeout(240)


def test_gyre_moves_several_cells_to_training_at_once_on_the_live_services(tmp_path) -> None:
    """The emulated cluster reaches N updates, and several moves are in flight
    (``gyre_parallel_moves``) on the real services: a trainer slowed so that the rate target
    asks for 3 of the 4 cells at once; two moves start in one decision and overlap, and
    nothing is lost. (One run for both: each took a minute of the suite.)"""
    cfg = load_config("bench/cluster.yaml", ["policy.gyre_parallel_moves=1.0", "cost.train_flops_eff=0.004"])
    cfg, sc = small_scenario(
        cfg, cfg.scenario("A64"), cells=4, slots=8, batch_groups=4, updates=2, turns_median=3, turns_hi=6
    )
    res = run_emulated(cfg, sc, time_scale=10.0, run_dir=tmp_path, run_timeout_s=150.0, policy="gyre")
    assert res.ran, res.reason
    assert res.updates == 2 and len(res.emulated_update_times_s) == 2
    assert math.isfinite(res.emulated_time_to_n_s) and res.emulated_time_to_n_s > 0
    assert math.isfinite(res.simulated_time_to_n_s) and res.simulated_time_to_n_s > 0
    assert math.isfinite(res.relative_difference)
    assert res.emulated_update_times_s == sorted(res.emulated_update_times_s)
    assert res.replay["finished"] > 0 and res.replay["turns"] > 0
    assert res.replay["failed"] == 0 and not res.replay["errors"]
    events = [
        json.loads(line) for line in (tmp_path / "run" / "logs" / "scheduler.log").read_text().splitlines()
    ]
    moving: set[str] = set()
    most = 0
    for e in events:
        if e.get("event") == "cell_to_training":
            moving.add(e["cell_id"])
        elif e.get("event") in ("cell_in_training", "transition_called_off", "transition_failed"):
            moving.discard(e["cell_id"])
        most = max(most, len(moving))
    assert most >= 2, [e["message"] for e in events if e.get("event", "").startswith("cell_")]
