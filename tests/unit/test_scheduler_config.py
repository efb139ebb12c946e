"""A burst's size: batch groups plus the over-provision rounded up, the same rule the
simulator uses (so a scenario means the same thing in both)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from services.scheduler.config import SchedulerConfig
from services.scheduler.policy import GyreConfig


@pytest.mark.parametrize(
    ("batch", "op", "groups"), [(2, 0.25, 3), (4, 0.25, 5), (3, 0.0, 3), (256, 0.25, 320), (5, 0.1, 6)]
)
def test_over_provision_rounds_up(batch: int, op: float, groups: int):
    assert SchedulerConfig(batch_size=batch, over_provision=op).groups_per_burst() == groups


def test_matches_the_simulator_rule():
    for batch in range(1, 40):
        for op in (0.0, 0.1, 0.25, 0.3, 0.5, 1.0):
            sim_rule = max(batch, math.ceil(batch * (1 + op) - 1e-9))  # sim/driver.py
            assert SchedulerConfig(batch_size=batch, over_provision=op).groups_per_burst() == sim_rule


def test_gyre_settings_reach_the_policy_and_bad_ones_are_refused():
    """Every ``gyre_*`` setting of the scheduler's config is a GyreConfig field (the simulator
    reads the same settings), with the policy's defaults."""
    cfg = SchedulerConfig(gyre_saturated_share=0.8, gyre_hysteresis=0.5)
    gyre = cfg.gyre_config(drain_grace_s=2.0)
    assert (gyre.saturated_share, gyre.hysteresis) == (0.8, 0.5)
    assert SchedulerConfig().gyre_config(2.0) == GyreConfig()
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="gyre_saturated_share"):
            SchedulerConfig(gyre_saturated_share=bad)
