"""Token buckets per key (a harness, a peer address): ``rate`` per second, bursts of ``burst``.

Pure (an injectable clock, no I/O). Memory is bounded: past ``max_keys`` keys the ones idle
longest (full buckets, which carry no state worth keeping) are dropped first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class KeyedLimiter:
    """One token bucket per key; :meth:`take` spends a token or says how long to wait."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_keys: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate_per_s < 0 or burst < 1:
            raise ValueError("rate_per_s must be >= 0 and burst >= 1")
        self.rate = rate_per_s
        self.burst = float(burst)
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str) -> float:
        """Spends one token of ``key``: 0.0 when allowed, else the seconds until one is
        available (nothing spent). A rate of 0 means no limit."""
        if self.rate <= 0:
            return 0.0
        now = self._clock()
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens - 1.0, now)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)  # least recently used
        return 0.0
