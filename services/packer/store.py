"""The packer's etcd adapter: mirrors the published policy version (keys.policy()) into the
packer, so that its staleness rule follows the cluster's newest policy; and ties the WAL to
the cluster's incarnation (a WAL left by an earlier cluster is archived, not replayed)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from gyre.etcd import Etcd, Keys, PrefixMirror
from gyre.etcd.client import KV
from gyre.etcd.values import policy_version
from services.packer.packer import Packer
from services.packer.wal import Event, Wal

log = logging.getLogger(__name__)


def policy_version_of(kv: KV | None) -> int | None:
    """The version in a policy record ({"version": int, ...}); None when unreadable."""
    if kv is None:
        return None
    version = policy_version(kv.value)
    if version is None:
        log.warning("unreadable policy record", extra={"key": kv.key.decode(errors="replace")})
    return version


class PolicyMirror:
    """Follows keys.policy() (list, watch, resync) and feeds new versions to the packer."""

    def __init__(self, etcd: Etcd, keys: Keys, packer: Packer, resync_s: float = 10.0) -> None:
        self._key = keys.policy()
        self._packer = packer
        self._mirror = PrefixMirror(etcd, self._key, resync_s=resync_s)

    async def run(self) -> None:
        task = asyncio.create_task(self._mirror.run(), name="packer.policy_mirror")
        try:
            while True:
                version = policy_version_of(self._mirror.items.get(self._key))
                if version is not None:
                    await self._packer.observe_policy(version)
                await self._mirror.changed(timeout_s=5.0)
                if task.done():
                    await task  # re-raises the mirror's failure
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class CellMirror:
    """Follows the cell registry (keys.cells(), lease-bound): when a cell that was registered
    disappears (its process died and its lease lapsed), its claims return to the pool after
    ``grace_s`` instead of after the claim TTL. Cells never seen registered are left to the TTL.

    An etcd outage longer than the lease TTL makes every registration vanish at once, and
    the live cells put them back (same value) as soon as their new lease session starts: a
    cell that comes back within ``grace_s`` with the registration it had keeps its claims (it
    is still training them). One that comes back with a different registration is a new
    process: its old claims are released."""

    def __init__(
        self,
        etcd: Etcd,
        keys: Keys,
        packer: Packer,
        resync_s: float = 10.0,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._prefix = keys.cells()
        self._packer = packer
        self._mirror = PrefixMirror(etcd, self._prefix, resync_s=resync_s)
        self._grace_s = grace_s
        self._clock = clock
        self.seen: dict[str, bytes] = {}
        self._missing: dict[str, float] = {}

    def _cells(self) -> dict[str, bytes]:
        n = len(self._prefix)
        return {key[n:].decode(errors="replace"): kv.value for key, kv in self._mirror.items.items()}

    async def reconcile(self) -> None:
        """Releases the claims of cells gone for ``grace_s`` (or back as another process)."""
        live = self._cells()
        now = self._clock()
        for cell, value in live.items():
            if cell in self._missing:
                del self._missing[cell]
                if self.seen.get(cell) != value:
                    await self._packer.release_cell(cell)  # a new process: the old one's claims are dead
        for cell in sorted(set(self.seen) - set(live)):
            since = self._missing.setdefault(cell, now)
            if now - since >= self._grace_s:
                del self._missing[cell]
                del self.seen[cell]
                await self._packer.release_cell(cell)
        self.seen.update(live)

    async def run(self) -> None:
        task = asyncio.create_task(self._mirror.run(), name="packer.cell_mirror")
        try:
            while True:
                if self._mirror.synced.is_set():
                    await self.reconcile()
                wait = min(5.0, self._grace_s / 2) if self._missing else 5.0
                await self._mirror.changed(timeout_s=max(wait, 0.05))
                if task.done():
                    await task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def incarnation_key(keys: Keys) -> bytes:
    """Where the id of the cluster's current packer WAL is kept (not lease-bound)."""
    return (keys.root + "packer/wal_id").encode()


async def open_incarnation(
    etcd: Etcd | None, keys: Keys, wal: Wal, events: Sequence[Event]
) -> Sequence[Event]:
    """The events to recover from: ``events`` when their header id is the one etcd holds;
    otherwise (a fresh etcd: an earlier cluster's WAL) the old log is archived and a new one
    starts with a new header. ``etcd`` None skips the check (keeps any existing log)."""
    wal_id = str(events[0].get("id")) if events and events[0].get("t") == "wal" else None
    if etcd is None:
        if events:
            return events
    else:
        kv = await etcd.get(incarnation_key(keys))
        current = kv.value.decode() if kv is not None else None
        if wal_id is not None and current == wal_id:
            return events
        if events:
            moved = await asyncio.to_thread(wal.archive)
            log.warning(
                "packer WAL belongs to another cluster incarnation; archived",
                extra={"archived": str(moved), "wal_id": wal_id, "etcd_wal_id": current},
            )
    header: Event = {"t": "wal", "id": uuid.uuid4().hex}
    wal.append(header)
    await wal.sync()  # durable before etcd names it
    if etcd is not None:
        await etcd.put(incarnation_key(keys), header["id"].encode())
    return [header]
