"""An unknown execution token never makes the router read etcd (anyone can send one): the
call waits, bounded, for the route to arrive through the watch, misses are rate-limited per
peer (429 / RESOURCE_EXHAUSTED), and expired tokens are refused at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from gyre.errors import RateLimited, Unauthenticated
from gyre.etcd import Keys
from services.router.routes import ExpiredToken, Route, RouteTable, token_sha256
from services.router.store import RouteStore


class CountingEtcd:
    def __init__(self) -> None:
        self.reads = 0

    async def get(self, key):
        self.reads += 1

    async def get_prefix(self, prefix):
        self.reads += 1
        return 0, []


def _route(eid: str, token: str, expires_s: float = 0.0) -> Route:
    return Route(
        eid,
        "c0",
        "127.0.0.1:1",
        token_sha256(token),
        "g",
        1,
        1,
        epoch=1,
        created_revision=1,
        expires_s=expires_s,
    )


async def _authorized_as_the_route_arrives(store: RouteStore, table: RouteTable, after_s: float) -> Route:
    """Execution e1's token, authorized while its route reaches ``table`` only ``after_s``
    later (as the watch delivers it)."""

    async def arrives_later() -> None:
        await asyncio.sleep(after_s)
        table.apply(_route("e1", "tok"))
        await store.mirror._notify()

    task = asyncio.create_task(arrives_later())
    route = await store.authorize("tok", "e1", peer="p")
    await task
    return route


async def test_unknown_tokens_wait_for_the_watch_and_never_read_etcd():
    etcd = CountingEtcd()
    table = RouteTable()
    store = RouteStore(
        etcd=etcd, keys=Keys("t"), table=table, miss_wait_s=2.0, miss_rate_per_s=100, miss_burst=100
    )
    route = await _authorized_as_the_route_arrives(store, table, 0.1)
    assert route.execution_id == "e1"
    start = time.monotonic()
    with pytest.raises(Unauthenticated):
        await RouteStore(etcd=etcd, keys=Keys("t"), table=RouteTable(), miss_wait_s=0.1).authorize(
            "forged", peer="p"
        )
    assert time.monotonic() - start < 1.0
    assert etcd.reads == 0


async def test_misses_are_rate_limited_per_peer():
    store = RouteStore(
        etcd=CountingEtcd(),
        keys=Keys("t"),
        table=RouteTable(),
        miss_wait_s=0.0,
        miss_rate_per_s=0.001,
        miss_burst=2,
    )
    for _ in range(2):
        with pytest.raises(Unauthenticated):
            await store.authorize("forged", peer="a")
    with pytest.raises(RateLimited):
        await store.authorize("forged", peer="a")
    with pytest.raises(Unauthenticated):  # another peer has its own budget
        await store.authorize("forged", peer="b")


async def test_an_expired_token_is_refused_without_waiting():
    table = RouteTable(wall=lambda: 1000.0)
    table.apply(_route("e1", "tok", expires_s=999.0))
    store = RouteStore(etcd=CountingEtcd(), keys=Keys("t"), table=table, miss_wait_s=5.0)
    start = time.monotonic()
    with pytest.raises(ExpiredToken):
        await store.authorize("tok", "e1")
    assert time.monotonic() - start < 1.0
    table2 = RouteTable(wall=lambda: 1000.0)
    table2.apply(_route("e1", "tok", expires_s=1001.0))
    assert table2.authorize("tok").execution_id == "e1"


async def test_the_default_wait_outlasts_a_watch_lagging_two_seconds():
    """A fresh execution's first call whose route reaches the router 2 s late (the watch lagged
    on a busy router in a vLLM demo) is served with the router's default settings, not
    refused: the default wait was 1 s and lost that episode."""
    from services.router.config import RouterConfig

    table = RouteTable()
    wait_s = RouterConfig.model_fields["unknown_token_wait_s"].default
    store = RouteStore(
        etcd=CountingEtcd(),
        keys=Keys("t"),
        table=table,
        miss_wait_s=wait_s,
        miss_rate_per_s=100,
        miss_burst=100,
    )
    route = await _authorized_as_the_route_arrives(store, table, 2.0)
    assert route.execution_id == "e1"
