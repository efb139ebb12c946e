"""Group-relative (GRPO-style) advantages, and the staleness rule, as pure functions."""

from __future__ import annotations

import math
from collections.abc import Mapping


def group_advantages(
    rewards: Mapping[str, float], std_normalize: bool = True, eps: float = 1e-6
) -> dict[str, float]:
    """Advantage of each member: (reward - group mean), divided by (std + eps) if asked.

    The std is the population std (the group is the whole sample, as in GRPO). A group of
    one has advantage 0.
    """
    if not rewards:
        return {}
    values = list(rewards.values())
    mean = math.fsum(values) / len(values)
    std = reward_std(values)
    out: dict[str, float] = {}
    for key, r in rewards.items():
        a = r - mean
        out[key] = a / (std + eps) if std_normalize else a
    return out


def reward_std(values: list[float]) -> float:
    """Population standard deviation."""
    if len(values) < 2:
        return 0.0
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def is_stale(oldest_version: int, newest_version: int, max_staleness: int) -> bool:
    """True when a sample made by ``oldest_version`` is more than ``max_staleness`` versions
    behind ``newest_version``."""
    return newest_version - oldest_version > max_staleness
