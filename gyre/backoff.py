"""Capped exponential back-off with jitter: the one helper every retry loop uses.

Without jitter, every client that lost the same peer at the same moment retries at the same
moments (0.1, 0.2, 0.4 ... s after it) and hits the peer in lockstep when it comes back
(the thundering herd of AWS's "Exponential Backoff And Jitter"). Each delay here is drawn
from ``[ceiling / 2, ceiling]`` ("equal jitter"), ``ceiling`` doubling from ``base_s`` up
to ``cap_s``: the mean still grows exponentially, the retries of many clients spread over
half of each interval, and no delay collapses to ~0 (which full jitter allows) so a dead
peer is never spun on.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable


class Backoff:
    """Delays for one retry loop: ``next()`` after each failure, ``reset()`` after a success."""

    def __init__(
        self,
        base_s: float = 0.1,
        cap_s: float = 2.0,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self.base_s = base_s
        self.cap_s = cap_s
        self._ceiling = base_s
        self._rng = rng or random.Random()
        self._sleep = sleep

    @property
    def ceiling_s(self) -> float:
        """The largest delay the next ``next()`` may return."""
        return self._ceiling

    def next(self) -> float:
        """The delay before the next attempt (seconds); the ceiling then doubles (capped)."""
        ceiling = self._ceiling
        self._ceiling = min(ceiling * 2, self.cap_s)
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        """After a success: the next failure waits ``base_s`` at most again."""
        self._ceiling = self.base_s

    async def sleep(self) -> float:
        """Sleeps ``next()`` seconds; returns how long."""
        delay = self.next()
        await self._sleep(delay)
        return delay
