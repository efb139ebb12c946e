"""The router's etcd adapter: mirrors the route prefix into the RouteTable (list + watch +
periodic relist via PrefixMirror), reads one route directly when a move is announced, and
catches up with etcd before refusing a token (read-your-writes for harnesses)."""

from __future__ import annotations

import logging

from gyre.errors import GyreError, InvalidArgument, Unauthenticated
from gyre.etcd import KV, Etcd, Keys, PrefixMirror
from services.router.routes import Route, RouteTable

log = logging.getLogger(__name__)


class RouteStore:
    """Keeps a RouteTable equal to etcd's routes; malformed route values are skipped."""

    def __init__(self, etcd: Etcd, keys: Keys, table: RouteTable, resync_s: float = 10.0) -> None:
        self._etcd = etcd
        self._keys = keys
        self._table = table
        self._parsed: dict[bytes, tuple[int, Route | None]] = {}
        self.mirror = PrefixMirror(etcd, keys.routes(), resync_s=resync_s, on_change=self._on_change)
        self.catch_ups = 0

    async def run(self) -> None:
        await self.mirror.run()

    def _parse(self, kv: KV) -> Route | None:
        cached = self._parsed.get(kv.key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        try:
            route: Route | None = Route.from_json(kv.value, kv.version, kv.create_revision)
        except InvalidArgument as exc:
            log.error("skipping malformed route", extra={"key": kv.key.decode(errors="replace"), "error": str(exc)})
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

    async def authorize(self, token: str, execution_id: str | None = None) -> Route:
        """RouteTable.authorize, but a miss first catches up with etcd.

        The scheduler writes a route and then hands the execution to a harness, which may
        call the router before the watch delivers the route. So before answering 401 the
        router reads etcd itself: the one route when the execution id is known, otherwise a
        full list (coalesced: concurrent misses share one read, at most one per 50 ms)."""
        try:
            return self._table.authorize(token, execution_id)
        except Unauthenticated:
            await self.catch_up(execution_id)
            return self._table.authorize(token, execution_id)

    async def catch_up(self, execution_id: str | None = None) -> None:
        try:
            if execution_id is not None:
                await self.refresh(execution_id)
                return
            # A fresh read every time: a shared read that started (or finished) before this
            # request arrived may predate its route. Only unknown tokens get here.
            await self._apply_all()
        except GyreError as exc:  # etcd unreachable: answer from the table as it is
            log.warning("route catch-up failed", extra={"error": str(exc)})

    async def _apply_all(self) -> None:
        """Applies every route in etcd that is newer than the table's (never removes: the
        mirror owns removals)."""
        self.catch_ups += 1
        _, kvs = await self._etcd.get_prefix(self._keys.routes())
        for kv in kvs:
            route = self._parse(kv)
            if route is not None:
                self._table.apply(route)
