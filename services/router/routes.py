"""The execution -> engine route table and the execution-token check (pure; no etcd, no grpc).

A route is written by the scheduler leader under ``keys.route(execution_id)``; its epoch is
the etcd key's ``version`` (each fenced rewrite adds one). The table keeps the newest epoch
it has seen per execution and never goes back to an older one, so a late watch event or a
stale relist cannot undo a move. A harness is authorized by sha256(token) == the route's
``token_sha256``, until the route's ``expires_s`` (wall clock); closing the execution deletes
the route, which revokes the token. The table remembers the executions closed within the last
``CLOSED_REMEMBERED_S`` (at most ``CLOSED_REMEMBERED`` of them) by token digest, so their holder
hears FAILED_PRECONDITION ("closed", HTTP 409: the same answer a call in flight gets when its
execution closes) rather than UNAUTHENTICATED: a harness whose execution the scheduler
cancelled between two turns can tell that from a bad token. Past that, the token is unknown.
"""

from __future__ import annotations

import hmac
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from gyre.errors import FailedPrecondition, PermissionDenied, Unauthenticated
from gyre.etcd.values import Route, token_sha256


class ExpiredToken(Unauthenticated):
    """The token held its execution, but past its expiry."""


CLOSED_REMEMBERED = 65_536
"""How many closed executions the table remembers at most (token digest -> id; ~250 bytes each)."""

CLOSED_REMEMBERED_S = 3600.0
"""How long after its close an execution is remembered: an hour covers a harness's longest tool
step between two turns; the memory then holds an hour of closes (a 2-hour soak closes ~15,000 an
hour: ~4 MB) instead of growing to the count bound."""


def closed_error(execution_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"execution {execution_id} was closed by the scheduler (finished, timed out, or cancelled "
        "because its group can no longer be trained)"
    )


def _newer(new: Route, old: Route) -> bool:
    if new.created_revision != old.created_revision:
        return new.created_revision > old.created_revision
    return new.epoch > old.epoch


RouteListener = Callable[[Route], None]


class RouteTable:
    """Routes by execution id, plus an index token hash -> execution id."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._routes: dict[str, Route] = {}
        self._by_token: dict[str, str] = {}
        # token digest -> (execution id, wall time of the close), oldest close first
        self._closed: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._listeners: list[RouteListener] = []
        self._remove_listeners: list[Callable[[str], None]] = []

    def __len__(self) -> int:
        return len(self._routes)

    def get(self, execution_id: str) -> Route | None:
        return self._routes.get(execution_id)

    def add_listener(self, listener: RouteListener) -> None:
        """``listener(route)`` runs whenever an execution's route changes epoch."""
        self._listeners.append(listener)

    def add_remove_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(execution_id)`` runs when an execution's route is deleted."""
        self._remove_listeners.append(listener)

    def apply(self, route: Route) -> bool:
        """Takes ``route`` if it is newer than what the table holds; True when it changed."""
        old = self._routes.get(route.execution_id)
        if old is not None and not _newer(route, old):
            return False
        if old is not None and self._by_token.get(old.token_sha256) == old.execution_id:
            del self._by_token[old.token_sha256]
        self._routes[route.execution_id] = route
        self._by_token[route.token_sha256] = route.execution_id
        self._closed.pop(route.token_sha256, None)
        for listener in self._listeners:
            listener(route)
        return True

    def remove(self, execution_id: str) -> None:
        """The execution closed (its route key was deleted)."""
        old = self._routes.pop(execution_id, None)
        if old is None:
            return
        if self._by_token.get(old.token_sha256) == execution_id:
            del self._by_token[old.token_sha256]
        now = self._wall()
        self._closed.pop(old.token_sha256, None)
        self._closed[old.token_sha256] = (execution_id, now)
        self._forget_closed(now)
        for listener in self._remove_listeners:
            listener(execution_id)

    def _forget_closed(self, now: float) -> None:
        """Drops the closes older than ``CLOSED_REMEMBERED_S`` and those past the count bound."""
        while self._closed:
            _, (_, closed_at) = next(iter(self._closed.items()))
            if len(self._closed) <= CLOSED_REMEMBERED and closed_at >= now - CLOSED_REMEMBERED_S:
                return
            self._closed.popitem(last=False)

    def _closed_as(self, digest: str) -> str | None:
        """The execution ``digest``'s token held, if it closed within ``CLOSED_REMEMBERED_S``."""
        entry = self._closed.get(digest)
        if entry is None or entry[1] < self._wall() - CLOSED_REMEMBERED_S:
            return None
        return entry[0]

    def replace_all(self, routes: Iterable[Route], as_of_revision: int | None = None) -> None:
        """A full view of etcd at ``as_of_revision``: applies newer routes and drops
        executions that are gone. A route created after that revision (read directly from
        etcd, ahead of the watch) is not in the view yet and is kept, not dropped."""
        fresh = {r.execution_id: r for r in routes}
        for execution_id, held in list(self._routes.items()):
            if execution_id in fresh:
                continue
            if as_of_revision is not None and held.created_revision > as_of_revision:
                continue
            self.remove(execution_id)
        for route in fresh.values():
            self.apply(route)

    def authorize(self, token: str, execution_id: str | None = None) -> Route:
        """The route ``token`` may use.

        With ``execution_id``: UNAUTHENTICATED when that execution has no route or the token
        names no execution; PERMISSION_DENIED when the token belongs to another execution.
        Without: the token's own execution, or UNAUTHENTICATED. Either way FAILED_PRECONDITION
        when the token held an execution that has closed (and is still remembered).
        """
        if not token:
            raise Unauthenticated("missing execution token")
        digest = token_sha256(token)
        if execution_id is None:
            owner = self._by_token.get(digest)
            if owner is None or owner not in self._routes:
                closed_as = self._closed_as(digest)
                if closed_as is not None:
                    raise closed_error(closed_as)
                raise Unauthenticated("unknown execution token")
            return self._unexpired(self._routes[owner])
        route = self._routes.get(execution_id)
        if route is None:
            if self._closed_as(digest) == execution_id:
                raise closed_error(execution_id)
            raise Unauthenticated(f"no live execution {execution_id!r}")
        if hmac.compare_digest(route.token_sha256, digest):
            return self._unexpired(route)
        if digest in self._by_token:
            raise PermissionDenied(f"this token does not hold execution {execution_id!r}")
        raise Unauthenticated("unknown execution token")

    def _unexpired(self, route: Route) -> Route:
        if route.expires_s and self._wall() > route.expires_s:
            raise ExpiredToken(f"the token of {route.execution_id} expired")
        return route
