"""Leadership: the fencing epoch, deposition, where the leader is, and the store every
write goes through.

A scheduler process acts only while it leads (``epoch`` > 0, not deposed). Every write is a
fenced store call awaited through :meth:`Leadership.fenced`: a write refused for a stale
epoch marks the process deposed (it then steps down: a standby again, campaigning).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from gyre.errors import FailedPrecondition, StaleEpoch, Unavailable
from gyre.etcd.values import endpoint_target
from services.scheduler.store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")


class Leadership:
    """This process's standing: epoch, deposed flag, the leader's address, the store."""

    def __init__(self, store: Store | None = None) -> None:
        self._store = store
        self.epoch = 0
        self.deposed = asyncio.Event()
        self.leader_target = ""

    @property
    def store(self) -> Store:
        """The store (bound once the election exists: ``__main__`` builds it after start)."""
        if self._store is None:
            raise Unavailable("the scheduler store is not bound yet")
        return self._store

    def bind(self, store: Store) -> None:
        self._store = store

    @property
    def leading(self) -> bool:
        return self.epoch > 0 and not self.deposed.is_set()

    def require(self) -> None:
        """Raises unless this process leads: StaleEpoch once deposed, Unavailable (naming
        the leader when known) on a standby."""
        if self.deposed.is_set():
            raise StaleEpoch("this scheduler was deposed")
        if self.epoch <= 0:
            where = f"; the leader is at {self.leader_target}" if self.leader_target else ""
            raise Unavailable(f"not the scheduler leader{where}")

    def mark_deposed(self, exc: BaseException) -> None:
        if not self.deposed.is_set():
            log.error("deposed: %s", exc)
            self.deposed.set()

    async def fenced(self, aw: Awaitable[T]) -> T:
        """Awaits a store write; a stale epoch marks us deposed and propagates."""
        try:
            return await aw
        except StaleEpoch as exc:
            self.mark_deposed(exc)
            raise

    async def check_refusal(self, exc: FailedPrecondition) -> None:
        """A peer refused a fenced command: if a newer leader exists, we are deposed
        (raises StaleEpoch); otherwise the refusal was about something else (returns)."""
        if await self.store.election.current_epoch() != self.epoch:
            self.mark_deposed(exc)
            raise StaleEpoch(str(exc)) from exc

    def on_leader(self, items: Mapping[bytes, Any]) -> None:
        """The leader key changed: remember where the leader is; a newer leader's key while
        we lead means ours lapsed."""
        for kv in items.values():
            self.leader_target = endpoint_target(kv.value)
            if self.epoch > 0 and getattr(kv, "create_revision", 0) > self.epoch:
                # A newer leader's key (ours lapsed): stop before the next write finds out.
                # (An older revision is only a lagging watch: ignored.)
                self.mark_deposed(StaleEpoch(f"the leader key now has epoch {kv.create_revision}"))
        if not items:
            self.leader_target = ""
