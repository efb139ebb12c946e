"""Leader election with a fencing epoch.

aetcd has no election API, so it is built the standard way: a lease-bound leader key created
only if absent (``create_revision == 0``). The winner's epoch is the key's create revision:
unique and increasing across leaders. Every persisted write of the leader is a transaction
that also compares the leader key's create revision with its epoch, and every command it
sends carries the epoch for the receiver's :class:`~gyre.fencing.FenceGuard`. A paused
leader whose lease lapsed therefore cannot change anything, even before it notices.

Leadership belongs to one lease *session* (:attr:`LeaseKeeper.session`): when the process
lost its lease (an etcd outage past the renew deadline) and the keeper granted a new one, the
old leader key went with the old lease, so the election is over: :attr:`is_leader` is false,
every fenced write raises StaleEpoch, and the process campaigns again like any candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gyre.backoff import Backoff
from gyre.errors import StaleEpoch, Unavailable
from gyre.etcd.client import KV, Compare, Etcd, Op, create_revision_is
from gyre.etcd.lease import LeaseKeeper
from gyre.etcd.watch import PrefixMirror
from gyre.fencing import FenceGuard
from gyre.ids import Epoch

log = logging.getLogger(__name__)


class LeaderElection:
    """Campaigns for one leader key; holds the epoch once elected."""

    def __init__(self, etcd: Etcd, key: bytes, candidate: str, lease: LeaseKeeper) -> None:
        self._etcd = etcd
        self._key = key
        self._candidate = candidate.encode()
        self._lease = lease
        self._epoch: Epoch | None = None
        self._session = 0

    @property
    def epoch(self) -> Epoch:
        if self._epoch is None:
            raise StaleEpoch("not the leader")
        return self._epoch

    @property
    def is_leader(self) -> bool:
        """Leader by our own reckoning: elected in the lease's current session and the lease
        not past its renew deadline."""
        return self._epoch is not None and self._session == self._lease.session and self._lease.valid()

    def step_down(self) -> None:
        """Forgets the epoch (the lease it was won with is gone): campaign again to lead."""
        if self._epoch is not None:
            log.warning("stepping down", extra={"epoch": int(self._epoch)})
        self._epoch = None

    async def try_acquire(self) -> Epoch | None:
        """One attempt: becomes leader if no one is; returns the epoch or None."""
        session, lease_id = self._lease.session, self._lease.lease_id
        ok, revision = await self._etcd.create(self._key, self._candidate, lease=lease_id)
        if ok:
            self._session = session
            # The create happened in the transaction at `revision`: that is the key's
            # create revision, our fencing epoch.
            self._epoch = Epoch(revision)
            log.info("elected leader", extra={"epoch": revision})
            return self._epoch
        current = await self._etcd.get(self._key)
        if current is not None and current.value == self._candidate and current.lease == lease_id:
            self._session = session
            self._epoch = Epoch(current.create_revision)  # we already hold it (retry after a timeout)
            return self._epoch
        return None

    async def campaign(self, poll_s: float = 0.5) -> Epoch:
        """Waits until elected. Polls (a watch would only be a hint anyway); while etcd is
        unreachable or the lease is being replaced, keeps waiting."""
        poll = Backoff(poll_s, poll_s)
        while True:
            if not self._lease.lost.is_set():
                try:
                    epoch = await self.try_acquire()
                except (Unavailable, TimeoutError) as exc:
                    log.info("campaign: etcd unreachable; retrying", extra={"error": repr(exc)})
                else:
                    if epoch is not None:
                        return epoch
            await poll.sleep()

    async def current_epoch(self) -> int:
        """The epoch of whoever leads now (0 if nobody)."""
        kv = await self._etcd.get(self._key)
        return 0 if kv is None else kv.create_revision

    def fence(self) -> Compare:
        """The guard that makes a transaction succeed only while we still lead."""
        return create_revision_is(self._key, self.epoch)

    async def fenced_txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> tuple[bool, int]:
        """A transaction that also requires our leadership. Raises StaleEpoch if we were
        deposed; otherwise returns (the caller's compares held, revision)."""
        if self._epoch is not None and self._session != self._lease.session:
            self.step_down()
            raise StaleEpoch("the lease this leadership was won with is gone")
        if not self._lease.valid():
            raise StaleEpoch("leader lease past its renew deadline; not acting")
        fence = self.fence()
        ok, revision = await self._etcd.txn([fence, *compares], success, failure)
        if ok:
            return True, revision
        # Tell a lost race on the caller's compares from a lost leadership.
        if await self.current_epoch() != self._epoch:
            self._epoch = None
            raise StaleEpoch("deposed: the leader key changed")
        return False, revision

    async def resign(self) -> None:
        """Steps down (deletes the key only if it is still ours)."""
        if self._epoch is None:
            return
        await self._etcd.txn([self.fence()], [Op(self._key, None)])
        self._epoch = None


def verified_fence(etcd: Etcd, leader_key: bytes) -> tuple[FenceGuard, PrefixMirror]:
    """A receiver's fence whose floor comes only from etcd: it reads the leader key when a
    command brings a newer epoch, and the returned mirror (spawn its ``run()``) raises the
    floor whenever a new leader key appears."""

    async def leader_epoch() -> int:
        kv = await etcd.get(leader_key)
        return 0 if kv is None else kv.create_revision

    fence = FenceGuard(leader_epoch=leader_epoch)

    def on_change(items: dict[bytes, KV]) -> None:
        kv = items.get(leader_key)
        if kv is not None:
            fence.observe(kv.create_revision)

    return fence, PrefixMirror(etcd, leader_key, on_change=on_change)
