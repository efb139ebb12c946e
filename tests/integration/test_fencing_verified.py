"""Fencing epochs are verified against etcd, never taken from a command: a forged
far-future epoch sent to the router's MoveExecutions is refused and does not raise its
fence floor, so the real leader's next command is still accepted (issue 14: before the fix,
epoch 2^62 was accepted and locked the real leader out). The same holds for the packer's
SealBatch; and a watch of the leader key raises the floor, so a deposed leader is refused
even before the new one sends anything."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gyre.etcd import Etcd, Keys
from gyre.v1 import common_pb2, router_pb2
from services.router.routes import RouteTable
from services.router.servicer import RouterServicer
from services.router.store import RouteStore

FORGED = 1 << 62


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class FakeContext:
    """Just what @rpc needs: abort() raises, like grpc.aio's."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None


class StubManager:
    def __init__(self) -> None:
        self.moves = 0

    async def move(self, execution_ids, from_cells):
        self.moves += 1
        return 0, 0


def _servicer(store: RouteStore, manager: StubManager) -> RouterServicer:
    return RouterServicer(
        manager=manager,
        store=store,
        turns=None,
        vocab_size=100,
        stop_token_ids=(0,),
        max_prompt_tokens=16,  # type: ignore[arg-type]
        max_tokens_limit=16,
        request_timeout_s=5.0,
        move_route_wait_s=0.1,
    )


def _move(epoch: int) -> router_pb2.MoveExecutionsRequest:
    return router_pb2.MoveExecutionsRequest(fence=common_pb2.Fence(epoch=epoch))


@pytest.fixture
async def etcd(etcd_server):
    client = Etcd([etcd_server.endpoint], timeout_s=5.0)
    await client.connect()
    yield client
    await client.close()


async def test_forged_far_future_epoch_neither_acts_nor_raises_the_routers_floor(etcd, cluster_name):
    keys = Keys(cluster_name)
    ok, epoch = await etcd.create(keys.leader(), b"the-real-leader")
    assert ok
    manager = StubManager()
    servicer = _servicer(RouteStore(etcd=etcd, keys=keys, table=RouteTable()), manager)

    with pytest.raises(Aborted) as err:
        await servicer.MoveExecutions(_move(FORGED), FakeContext())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert manager.moves == 0  # it did not act

    # The real leader is not locked out: its epoch is still accepted.
    await servicer.MoveExecutions(_move(epoch), FakeContext())
    assert manager.moves == 1
    assert int(servicer.fence.highest) == epoch


async def test_an_older_epoch_is_refused_once_a_newer_leader_is_verified(etcd, cluster_name):
    keys = Keys(cluster_name)
    _, first = await etcd.create(keys.leader(), b"first")
    manager = StubManager()
    servicer = _servicer(RouteStore(etcd=etcd, keys=keys, table=RouteTable()), manager)
    await servicer.MoveExecutions(_move(first), FakeContext())
    await etcd.delete(keys.leader())
    _, second = await etcd.create(keys.leader(), b"second")
    await servicer.MoveExecutions(_move(second), FakeContext())
    with pytest.raises(Aborted) as err:
        await servicer.MoveExecutions(_move(first), FakeContext())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert manager.moves == 2


async def test_the_leader_watch_raises_the_floor_without_a_command(etcd, cluster_name):
    keys = Keys(cluster_name)
    _, first = await etcd.create(keys.leader(), b"first")
    manager = StubManager()
    servicer = _servicer(RouteStore(etcd=etcd, keys=keys, table=RouteTable()), manager)
    await servicer.MoveExecutions(_move(first), FakeContext())
    watch = asyncio.create_task(servicer.leader_mirror.run())
    try:
        await etcd.delete(keys.leader())
        _, second = await etcd.create(keys.leader(), b"second")
        for _ in range(100):
            if servicer.fence.highest == second:
                break
            await asyncio.sleep(0.05)
        assert servicer.fence.highest == second
        with pytest.raises(Aborted):  # the deposed leader, before the new one said anything
            await servicer.MoveExecutions(_move(first), FakeContext())
        assert manager.moves == 1
    finally:
        watch.cancel()
