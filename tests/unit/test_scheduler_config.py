"""A burst's size: batch groups plus the over-provision rounded up, the same rule the
simulator uses (so a scenario means the same thing in both)."""

from __future__ import annotations

import math

import pytest

from services.scheduler.config import SchedulerConfig


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
