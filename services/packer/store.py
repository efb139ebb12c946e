"""The packer's etcd adapter: mirrors the published policy version (keys.policy()) into the
packer, so that its staleness rule follows the cluster's newest policy; and ties the WAL to
the cluster's incarnation (a WAL left by an earlier cluster is archived, not replayed)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

from gyre.etcd import Etcd, Keys, PrefixMirror
from gyre.etcd.client import KV
from services.packer.packer import Packer
from services.packer.wal import Event, Wal

log = logging.getLogger(__name__)


def policy_version_of(kv: KV | None) -> int | None:
    """The version in a policy record ({"version": int, ...}); None when unreadable."""
    if kv is None:
        return None
    try:
        version = json.loads(kv.value)["version"]
    except (ValueError, KeyError, TypeError):
        log.warning("unreadable policy record", extra={"key": kv.key.decode(errors="replace")})
        return None
    return version if isinstance(version, int) and version >= 0 else None


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
    disappears (its process died and its lease lapsed), its claims return to the pool at
    once instead of after the claim TTL. Cells never seen registered are left to the TTL."""

    def __init__(self, etcd: Etcd, keys: Keys, packer: Packer, resync_s: float = 10.0) -> None:
        self._prefix = keys.cells()
        self._packer = packer
        self._mirror = PrefixMirror(etcd, self._prefix, resync_s=resync_s)
        self.seen: set[str] = set()

    def _cells(self) -> set[str]:
        n = len(self._prefix)
        return {key[n:].decode(errors="replace") for key in self._mirror.items}

    async def run(self) -> None:
        task = asyncio.create_task(self._mirror.run(), name="packer.cell_mirror")
        try:
            while True:
                if self._mirror.synced.is_set():
                    live = self._cells()
                    for cell in sorted(self.seen - live):
                        await self._packer.release_cell(cell)
                    self.seen = live
                await self._mirror.changed(timeout_s=5.0)
                if task.done():
                    await task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

def incarnation_key(keys: Keys) -> bytes:
    """Where the id of the cluster's current packer WAL is kept (not lease-bound)."""
    return (keys.root + "packer/wal_id").encode()


async def open_incarnation(etcd: Etcd | None, keys: Keys, wal: Wal, events: list[Event]) -> list[Event]:
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
            log.warning("packer WAL belongs to another cluster incarnation; archived",
                        extra={"archived": str(moved), "wal_id": wal_id, "etcd_wal_id": current})
    header: Event = {"t": "wal", "id": uuid.uuid4().hex}
    wal.append(header)
    await wal.sync()  # durable before etcd names it
    if etcd is not None:
        await etcd.put(incarnation_key(keys), header["id"].encode())
    return [header]
