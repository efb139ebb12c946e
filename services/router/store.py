"""The router's etcd adapter: mirrors the route prefix into the RouteTable (list + watch +
periodic relist via PrefixMirror) and reads one route directly when a move is announced."""

from __future__ import annotations

import logging

from gyre.errors import InvalidArgument
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
        self._table.replace_all(routes)

    async def refresh(self, execution_id: str) -> Route | None:
        """Reads one route from etcd (linearizable) and applies it if newer."""
        kv = await self._etcd.get(self._keys.route(execution_id))
        if kv is None:
            return self._table.get(execution_id)
        route = self._parse(kv)
        if route is not None:
            self._table.apply(route)
        return self._table.get(execution_id)
