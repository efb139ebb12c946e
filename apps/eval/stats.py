"""Bootstrap confidence intervals for evaluation means."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of ``values`` and its percentile-bootstrap interval at
    ``level`` (resampling the values with replacement ``n_boot`` times). Deterministic for a
    seed. Pass one value per task (a task's mean over its samples): samples of one task are
    correlated, tasks are the independent units."""
    if not 0 < level < 1:
        raise ValueError("level must be in (0, 1)")
    x = np.asarray(list(values), dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    mean = float(x.mean())
    if x.size == 1 or n_boot < 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    # The percentile interval of a skewed resampling can miss the mean by rounding: keep it
    # bracketed.
    return mean, min(float(lo), mean), max(float(hi), mean)
