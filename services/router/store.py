"""The router's etcd adapter: mirrors the route prefix into the RouteTable (list + watch +
periodic relist via PrefixMirror), reads one route directly when the scheduler announces a
move, and lets an unknown token wait briefly for its route to arrive through the watch
(never through an etcd read: unknown tokens come from anyone)."""

from __future__ import annotations

import asyncio
import logging

from gyre.errors import InvalidArgument, RateLimited, Unauthenticated
from gyre.etcd import KV, Etcd, Keys, PrefixMirror
from gyre.ratelimit import KeyedLimiter
from services.router.routes import ExpiredToken, Route, RouteTable

log = logging.getLogger(__name__)


class RouteStore:
    """Keeps a RouteTable equal to etcd's routes; malformed route values are skipped."""

    def __init__(
        self,
        *,
        etcd: Etcd,
        keys: Keys,
        table: RouteTable,
        resync_s: float = 10.0,
        miss_wait_s: float = 5.0,
        miss_rate_per_s: float = 20.0,
        miss_burst: int = 40,
        max_waiters: int = 256,
    ) -> None:
        self.etcd = self._etcd = etcd
        self.keys = self._keys = keys
        self._table = table
        self._parsed: dict[bytes, tuple[int, Route | None]] = {}
        self.mirror = PrefixMirror(etcd, keys.routes(), resync_s=resync_s, on_change=self._on_change)
        self._miss_wait_s = miss_wait_s
        self._misses = KeyedLimiter(miss_rate_per_s, miss_burst)
        self._max_waiters = max_waiters
        self._waiting = 0
        self.misses = 0

    async def run(self) -> None:
        await self.mirror.run()

    def _parse(self, kv: KV) -> Route | None:
        cached = self._parsed.get(kv.key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        try:
            route: Route | None = Route.from_json(kv.value, kv.version, created_revision=kv.create_revision)
        except InvalidArgument as exc:
            log.error(
                "skipping malformed route", extra={"key": kv.key.decode(errors="replace"), "error": str(exc)}
            )
            route = None
        self._parsed[kv.key] = (kv.mod_revision, route)
        return route

    def _on_change(self, items: dict[bytes, KV]) -> None:
        for key in list(self._parsed):
            if key not in items:
                del self._parsed[key]
        routes = [r for r in (self._parse(kv) for kv in items.values()) if r is not None]
        self._table.replace_all(routes, as_of_revision=self.mirror.revision)

    async def refresh(self, execution_id: str) -> Route | None:
        """Reads one route from etcd (linearizable) and applies it if newer."""
        kv = await self._etcd.get(self._keys.route(execution_id))
        if kv is None:
            return self._table.get(execution_id)
        route = self._parse(kv)
        if route is not None:
            self._table.apply(route)
        return self._table.get(execution_id)

    async def authorize(self, token: str, execution_id: str | None = None, peer: str = "") -> Route:
        """RouteTable.authorize, but a miss waits (bounded) for the route to arrive.

        The scheduler writes a route and then hands the execution to a harness, which may
        call the router before the watch delivers the route. A miss therefore waits up to
        ``miss_wait_s`` for the mirror to change, answering from memory: an unknown token
        never causes an etcd read (anyone can send one). Misses are rate-limited per
        ``peer`` (RESOURCE_EXHAUSTED past the limit) and only ``max_waiters`` wait at once
        (the rest are refused at once)."""
        try:
            return self._table.authorize(token, execution_id)
        except ExpiredToken:
            raise
        except Unauthenticated:
            pass
        retry = self._misses.take(peer)
        if retry > 0:
            raise RateLimited(f"too many unknown execution tokens; retry in {retry:.2f} s")
        self.misses += 1
        if self._waiting >= self._max_waiters:
            return self._table.authorize(token, execution_id)
        self._waiting += 1
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + self._miss_wait_s
            while True:
                try:
                    return self._table.authorize(token, execution_id)
                except ExpiredToken:
                    raise
                except Unauthenticated:
                    left = until - loop.time()
                    if left <= 0:
                        raise
                await self.mirror.changed(min(left, 0.25))
        finally:
            self._waiting -= 1
