"""Fencing: every command from a scheduler leader carries its epoch; receivers check it.

etcd leases are not mutual exclusion: a paused leader can believe it still leads. The
receiver keeps the newest epoch it has seen and refuses anything older, so a deposed leader
cannot act even if it does not know yet that it was deposed. Persisted writes check the
epoch in the same etcd transaction as the write (see :mod:`gyre.etcd.election`).
"""

from __future__ import annotations

from gyre.errors import InvalidArgument, StaleEpoch
from gyre.ids import Epoch


class FenceGuard:
    """Tracks the highest epoch seen by one receiver; refuses older ones."""

    def __init__(self, initial: int = 0) -> None:
        self._highest = Epoch(initial)

    @property
    def highest(self) -> Epoch:
        return self._highest

    def check(self, epoch: int) -> Epoch:
        """Accepts ``epoch`` if it is at least the highest seen (and records it)."""
        if epoch <= 0:
            raise InvalidArgument("a fenced command needs fence.epoch > 0")
        if epoch < self._highest:
            raise StaleEpoch(f"stale fencing epoch {epoch} < {self._highest}")
        self._highest = Epoch(epoch)
        return self._highest

    def observe(self, epoch: int) -> None:
        """Raises the floor without a command (e.g. a new leader key seen in a watch)."""
        if epoch > self._highest:
            self._highest = Epoch(epoch)
