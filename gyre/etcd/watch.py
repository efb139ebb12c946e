"""Watches as hints: a local mirror of a key prefix that lists at a revision, watches from
the next, resyncs after an etcd restart or compaction, and reconciles periodically.

A list is paged (``page`` keys per range request, all at one revision), so a prefix of any
size mirrors. etcd watches are not linearizable and have had bugs under partitions and
compaction, so the mirror never trusts a watch alone: any watch error (etcd restarted,
revision compacted) leads to a fresh list, and every ``resync_s`` the mirror relists
anyway. Consumers are level-triggered: they read :attr:`PrefixMirror.items` and are woken
through :meth:`PrefixMirror.changed`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aetcd.exceptions

from gyre.backoff import Backoff
from gyre.errors import Unavailable
from gyre.etcd.client import KV, Etcd

log = logging.getLogger(__name__)

WATCH_CANCEL_TIMEOUT_S = 2.0
"""How long ending a watch may take. aetcd's ``cancel`` (and its watch creation) wait for
the client's shared watcher lock, which a watch stream broken by an etcd restart or a
compaction can hold for good: unbounded, a cancelled mirror (a ``wait_for`` timing out, a
task cancelled at shutdown) never finished (CI: test_watch_relists_after_compaction hung
300 s)."""


class PrefixMirror:
    """Keeps ``items`` (key -> KV) equal to etcd's view of ``prefix``."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: bytes,
        resync_s: float = 10.0,
        on_change: Callable[[dict[bytes, KV]], None] | None = None,
        page: int = 1000,
    ) -> None:
        self._etcd = etcd
        self._prefix = prefix
        self._page = page
        self._resync_s = resync_s
        self._on_change = on_change
        self.items: dict[bytes, KV] = {}
        self.revision = 0
        self.resyncs = 0
        self._changed = asyncio.Condition()
        self.synced = asyncio.Event()

    async def changed(self, timeout_s: float | None = None) -> None:
        """Waits for the next change (or the timeout)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass

    async def wait_for(self, predicate: Callable[[dict[bytes, KV]], bool], timeout_s: float) -> None:
        """Waits until ``predicate(items)`` holds; raises TimeoutError after ``timeout_s``."""

        async def _wait() -> None:
            while not predicate(self.items):
                await self.changed(0.5)

        await asyncio.wait_for(_wait(), timeout_s)

    async def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change(self.items)
        async with self._changed:
            self._changed.notify_all()

    async def relist(self) -> None:
        """Lists the prefix at one revision, ``page`` keys per request: one answer for all
        of it would pass gRPC's message limit past ~10k routes (the router's mirror)."""
        revision, kvs = await self._etcd.get_prefix_paged(self._prefix, self._page)
        fresh = {kv.key: kv for kv in kvs}
        different = fresh != self.items
        self.items = fresh
        self.revision = revision
        self.resyncs += 1
        self.synced.set()
        if different:
            await self._notify()

    async def run(self) -> None:
        """Mirrors forever; survives etcd restarts (backs off and relists)."""
        backoff = Backoff(0.1, 2.0)
        task = asyncio.current_task()
        while True:
            try:
                await self.relist()
                backoff.reset()
                await self._watch_until_resync()
            except asyncio.CancelledError:
                raise
            except (TimeoutError, Unavailable, aetcd.exceptions.ClientError) as exc:
                log.info(
                    "watch interrupted; relisting",
                    extra={"prefix": self._prefix.decode(), "error": repr(exc)},
                )
                await backoff.sleep()
            # aetcd can swallow our cancellation (Watcher._terminate_stream awaits its
            # request handler under ``except CancelledError: pass``): the watch then just
            # ends, and this loop would relist and watch forever while whoever cancelled it
            # (a service shutting down, a wait_for) waits forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError

    async def _watch_until_resync(self) -> None:
        # Bounded like the rest (see WATCH_CANCEL_TIMEOUT_S): a creation that never answers is
        # a TimeoutError, after which run() relists and watches again.
        async with asyncio.timeout(self._resync_s):
            watch = await self._etcd.client.watch_prefix(self._prefix, start_revision=self.revision + 1)
        try:
            async with asyncio.timeout(self._resync_s):
                async for event in watch:
                    kv = KV.from_raw(event.kv)
                    if event.kind == "DELETE":
                        self.items.pop(kv.key, None)
                    else:
                        self.items[kv.key] = kv
                    self.revision = max(self.revision, kv.mod_revision)
                    await self._notify()
        except TimeoutError:
            pass  # periodic reconcile: fall through to a relist
        finally:
            try:
                async with asyncio.timeout(WATCH_CANCEL_TIMEOUT_S):
                    await watch.cancel()
            except Exception:  # gone after an etcd restart, or stuck (TimeoutError): left behind
                log.debug("watch cancel failed", exc_info=True)
