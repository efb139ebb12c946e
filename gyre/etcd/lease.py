"""The lease keeper: one lease per process, kept alive by a task; losing it is fatal.

aetcd does not keep leases alive by itself. :meth:`LeaseKeeper.run` refreshes every
``ttl/3`` seconds. If etcd says the lease is gone, or no refresh succeeds before the lease
would have expired, the process can no longer prove it is alive: ``run`` raises
:class:`~gyre.errors.FatalError`, the supervisor stops the process, and whatever the lease
held (registrations, claims, leadership) is released by etcd for others to take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aetcd.exceptions

from gyre.errors import FatalError, Unavailable
from gyre.etcd.client import Etcd

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Grants a lease and keeps it alive."""

    def __init__(self, etcd: Etcd, ttl_s: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._etcd = etcd
        self._ttl_s = ttl_s
        self._clock = clock
        self._lease_id: int | None = None
        self._valid_until = 0.0
        self.lost = asyncio.Event()

    @property
    def lease_id(self) -> int:
        if self._lease_id is None:
            raise RuntimeError("LeaseKeeper.grant() first")
        return self._lease_id

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    def valid(self) -> bool:
        """True while the lease is known to be alive by this process's clock.

        A leader must stop acting before this turns false: it is the renew deadline
        (granted TTL from the last successful refresh, minus a safety margin)."""
        return not self.lost.is_set() and self._clock() < self._valid_until

    async def grant(self) -> int:
        start = self._clock()
        self._lease_id = await self._etcd.grant(self._ttl_s)
        self._valid_until = start + self._ttl_s * 0.8
        return self._lease_id

    async def run(self) -> None:
        """Refreshes forever; raises FatalError when the lease is lost."""
        lease_id = self.lease_id
        interval = max(self._ttl_s / 3.0, 0.2)
        while True:
            await asyncio.sleep(interval)
            start = self._clock()
            try:
                ttl = await asyncio.wait_for(self._etcd.refresh(lease_id), timeout=interval)
            except (Unavailable, asyncio.TimeoutError) as exc:
                if self._clock() >= self._valid_until:
                    self.lost.set()
                    raise FatalError(f"lease {lease_id:x} expired while etcd was unreachable") from exc
                log.warning("lease refresh failed; retrying", extra={"error": repr(exc)})
                continue
            if ttl <= 0:
                self.lost.set()
                raise FatalError(f"lease {lease_id:x} is gone (etcd says TTL {ttl})")
            self._valid_until = start + ttl * 0.8

    async def revoke(self) -> None:
        """Gives the lease up (clean shutdown): its keys vanish at once."""
        if self._lease_id is not None:
            try:
                await self._etcd.revoke(self._lease_id)
            except (Unavailable, aetcd.exceptions.ClientError) as exc:
                # Already expired (a fatal lease loss), or etcd unreachable: either way etcd
                # drops the lease's keys by itself.
                log.info("lease revoke skipped: %r", exc)
