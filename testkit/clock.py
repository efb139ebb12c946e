"""A clock that moves only when told: lease, TTL and heartbeat expiry without sleeping."""

from __future__ import annotations


class ManualClock:
    """Returns ``now`` until told otherwise (``advance``, or ``now += s``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
