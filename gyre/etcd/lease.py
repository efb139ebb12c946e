"""The lease keeper: one lease per process, kept alive by a task, re-established as a new
session after an etcd outage.

aetcd does not keep leases alive by itself. :meth:`LeaseKeeper.run` refreshes every
``ttl/3`` seconds, and sooner again after a failed refresh. While a refresh succeeds before
the renew deadline (``0.8 * TTL`` after the last good one) nothing changes: a short etcd
pause is invisible. When etcd says the lease is gone, or no refresh succeeds before the
renew deadline, the process can no longer prove that it holds the lease: :attr:`lost` is set
(a leader must stop acting; :meth:`valid` is false), and the keeper grants a **new lease**
as soon as etcd answers again (a new *session*: :attr:`session` goes up by one), revokes
the old one if it is still there (so what it held, a leader key in particular, is free at
once), and runs the hooks registered with :meth:`on_new_session`: each service re-puts
its lease-bound keys (registrations) with the new lease there. Nothing ends the process:
an etcd outage of any length pauses what needs etcd and ends nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aetcd.exceptions

from gyre.backoff import Backoff
from gyre.errors import Unavailable
from gyre.etcd.client import Etcd

log = logging.getLogger(__name__)

SessionHook = Callable[[int], Awaitable[None]]
"""``hook(lease_id)``: re-puts what the process binds to its lease, with the new lease."""

_ETCD_DOWN = (Unavailable, asyncio.TimeoutError, aetcd.exceptions.ClientError)


class LeaseKeeper:
    """Grants a lease, keeps it alive, and replaces it by a new session when it is lost."""

    def __init__(
        self, etcd: Etcd, ttl_s: int, clock: Callable[[], float] = time.monotonic, max_backoff_s: float = 1.0
    ) -> None:
        self._etcd = etcd
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_backoff_s = max_backoff_s
        self._lease_id: int | None = None
        self._valid_until = 0.0
        self._hooks: list[SessionHook] = []
        self._hooks_task: asyncio.Task[None] | None = None
        self.session = 0
        """1 for the first lease; one more for every lease granted after a loss."""
        self.losses = 0
        self.lost = asyncio.Event()
        """Set while the process holds no lease it can prove alive."""
        self._renewed = asyncio.Event()

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

    def on_new_session(self, hook: SessionHook) -> None:
        """Runs ``hook(new_lease_id)`` after every lease granted to replace a lost one
        (retried while etcd is unreachable, until it succeeds or the lease is lost again)."""
        self._hooks.append(hook)

    async def wait_session(self, after: int) -> int:
        """Waits until a session newer than ``after`` holds a live lease; returns it."""
        while self.session <= after or self.lost.is_set():
            self._renewed.clear()
            await self._renewed.wait()
        return self.session

    async def grant(self) -> int:
        start = self._clock()
        self._lease_id = await self._etcd.grant(self._ttl_s)
        self._valid_until = start + self._ttl_s * 0.8
        self.session += 1
        return self._lease_id

    async def run(self) -> None:
        """Keeps the lease alive forever; a lost lease is replaced when etcd answers."""
        try:
            while True:
                await self._keep()
                self.lost.set()
                self.losses += 1
                if self._hooks_task is not None:
                    self._hooks_task.cancel()
                old = self.lease_id
                since = self._clock()
                log.warning("lease lost; waiting for etcd to grant a new one", extra={"lease": f"{old:x}"})
                await self._regrant()
                await self._revoke_quietly(old)
                self.lost.clear()
                self._renewed.set()
                log.warning(
                    "lease re-established as a new session",
                    extra={
                        "lease": f"{self.lease_id:x}",
                        "session": self.session,
                        "outage_s": round(self._clock() - since, 3),
                    },
                )
                self._hooks_task = asyncio.create_task(self._run_hooks(self.session), name="lease.hooks")
        finally:
            if self._hooks_task is not None:
                self._hooks_task.cancel()

    async def _keep(self) -> None:
        """Refreshes until the lease is lost (returns then)."""
        interval = max(self._ttl_s / 3.0, 0.2)
        retry = Backoff(min(interval, 0.5), min(interval, 0.5))
        wait = interval
        while True:
            await asyncio.sleep(wait)
            start = self._clock()
            try:
                ttl = await asyncio.wait_for(self._etcd.refresh(self.lease_id), timeout=interval)
            except _ETCD_DOWN as exc:
                if self._clock() >= self._valid_until:
                    log.warning("lease expired while etcd was unreachable", extra={"error": repr(exc)})
                    return
                log.info("lease refresh failed; retrying", extra={"error": repr(exc)})
                wait = retry.next()
                continue
            if ttl <= 0:
                log.warning("lease is gone (etcd says TTL %s)", ttl)
                return
            self._valid_until = start + ttl * 0.8
            wait = interval

    async def _regrant(self) -> None:
        backoff = Backoff(0.1, self._max_backoff_s)
        while True:
            try:
                await asyncio.wait_for(self.grant(), timeout=max(self._ttl_s / 3.0, 0.5))
                return
            except _ETCD_DOWN as exc:
                log.info("lease grant failed; retrying", extra={"error": repr(exc)})
            await backoff.sleep()

    async def _run_hooks(self, session: int) -> None:
        for hook in self._hooks:
            backoff = Backoff(0.1, self._max_backoff_s)
            while session == self.session and not self.lost.is_set():
                try:
                    await hook(self.lease_id)
                    break
                except _ETCD_DOWN as exc:
                    log.info("new-session hook failed; retrying", extra={"error": repr(exc)})
                except Exception:
                    log.exception("new-session hook failed; retrying")
                await backoff.sleep()

    async def _revoke_quietly(self, lease_id: int) -> None:
        """Revokes a lease we gave up on; usually etcd already dropped it."""
        try:
            await asyncio.wait_for(self._etcd.revoke(lease_id), timeout=max(self._ttl_s / 3.0, 0.5))
        except _ETCD_DOWN as exc:
            log.info("old lease revoke skipped: %r", exc)

    async def revoke(self) -> None:
        """Gives the lease up (clean shutdown): its keys vanish at once."""
        if self._lease_id is not None:
            try:
                await self._etcd.revoke(self._lease_id)
            except (Unavailable, aetcd.exceptions.ClientError) as exc:
                # Already expired, or etcd unreachable: either way etcd drops the lease's
                # keys by itself.
                log.info("lease revoke skipped: %r", exc)
