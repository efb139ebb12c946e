"""Fencing: every command from a scheduler leader carries its epoch; receivers check it.

etcd leases are not mutual exclusion: a paused leader can believe it still leads. The
receiver keeps the newest epoch it has seen and refuses anything older, so a deposed leader
cannot act even if it does not know yet that it was deposed. Persisted writes check the
epoch in the same etcd transaction as the write (see :mod:`gyre.etcd.election`).

The floor rises only to epochs verified against etcd, never to one a command merely
carries: :meth:`FenceGuard.admit` reads the leader key when a command brings an epoch
above the floor and accepts it only if it is the current leader's, and a watch of the
leader key (:meth:`FenceGuard.observe`) raises it when a new leader is elected. So a forged
far-future epoch neither acts nor locks the real leader out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gyre.errors import InvalidArgument, StaleEpoch
from gyre.ids import Epoch

LeaderEpoch = Callable[[], Awaitable[int]]
"""Reads the current leader's epoch from etcd (0: no leader)."""


class UnverifiedEpoch(StaleEpoch):
    """A command's epoch is newer than the floor but is not the current leader's."""


class FenceGuard:
    """Tracks the highest verified epoch of one receiver; refuses older ones.

    ``leader_epoch`` reads the leader key from etcd; :meth:`admit` uses it. Without one
    (unit tests' fakes, no etcd), :meth:`check` trusts the epoch a command carries."""

    def __init__(self, initial: int = 0, leader_epoch: LeaderEpoch | None = None) -> None:
        self._highest = Epoch(initial)
        self._leader_epoch = leader_epoch

    @property
    def highest(self) -> Epoch:
        return self._highest

    def check(self, epoch: int) -> Epoch:
        """Accepts ``epoch`` if it is at least the highest seen (and records it). Trusts the
        command: only for receivers whose epochs are already verified (the packer's domain,
        after its servicer admitted the command) or fakes without etcd."""
        if epoch <= 0:
            raise InvalidArgument("a fenced command needs fence.epoch > 0")
        if epoch < self._highest:
            raise StaleEpoch(f"stale fencing epoch {epoch} < {self._highest}")
        self._highest = Epoch(epoch)
        return self._highest

    async def admit(self, epoch: int) -> Epoch:
        """Accepts ``epoch`` if it is the floor, or newer and etcd says it is the current
        leader's (then it becomes the floor). A stale epoch raises StaleEpoch, a newer one
        that is not the leader's UnverifiedEpoch; neither changes the floor."""
        if self._leader_epoch is None:
            return self.check(epoch)
        if epoch <= 0:
            raise InvalidArgument("a fenced command needs fence.epoch > 0")
        if epoch < self._highest:
            raise StaleEpoch(f"stale fencing epoch {epoch} < {self._highest}")
        if epoch == self._highest:
            return self._highest
        current = await self._read_leader()
        self.observe(current)
        if epoch == current:
            return self._highest
        if epoch < current:
            raise StaleEpoch(f"stale fencing epoch {epoch} < {current} (the current leader's)")
        raise UnverifiedEpoch(
            f"fencing epoch {epoch} is not the current leader's (etcd says {current or 'none'})"
        )

    async def _read_leader(self) -> int:
        """A fresh read per command (a shared one might predate the election that made the
        command's sender leader). Only mTLS-authorized schedulers get here."""
        assert self._leader_epoch is not None
        return await self._leader_epoch()

    def observe(self, epoch: int) -> None:
        """Raises the floor to an epoch read from etcd (a new leader key seen in a watch)."""
        if epoch > self._highest:
            self._highest = Epoch(epoch)
