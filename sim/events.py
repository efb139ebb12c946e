"""The discrete-event core: a heap of timed callbacks with a deterministic tie order."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Runs callbacks in time order; ties run in scheduling order (so runs are deterministic).

    ``schedule(t, fn, *args)`` queues ``fn(*args)`` at time ``t`` (never before ``now``).
    Cancellation is by generation counters held by the callers (stale events return early),
    which keeps the heap free of deletions.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.processed = 0
        self._stopped = False

    def schedule(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        t = max(t, self.now)
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def stop(self) -> None:
        self._stopped = True

    def run(self, until: float) -> None:
        """Processes events until ``stop()``, an empty heap, or time ``until``."""
        heap = self._heap
        pop = heapq.heappop
        n = 0
        try:
            while heap and not self._stopped:
                item = pop(heap)
                t = item[0]
                if t > until:
                    heapq.heappush(heap, item)
                    self.now = until
                    return
                self.now = t
                n += 1
                item[2](*item[3])
        finally:
            self.processed += n

    def __len__(self) -> int:
        return len(self._heap)
