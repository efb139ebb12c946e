"""Group commit of the scheduler's guarded writes: concurrent units share one fenced
transaction and one revision; a unit whose guard fails is retried alone so only it hears
the failure; a lost leadership reaches every unit of the group; units on the same key never
share a transaction; a group stays under etcd's operation limit."""

from __future__ import annotations

import asyncio

import pytest

from gyre.errors import StaleEpoch
from gyre.etcd import Op
from gyre.etcd.client import create_revision_is
from services.scheduler.group_commit import GroupCommit


class Etcd:
    """A tiny guarded store: create-revision guards only, a revision per transaction."""

    def __init__(self) -> None:
        self.kv: dict[bytes, int] = {}
        self.rev = 1
        self.txns: list[int] = []  # operations per transaction
        self.deposed = False

    async def txn(self, compares, ops):
        await asyncio.sleep(0.001)
        if self.deposed:
            raise StaleEpoch("deposed")
        self.txns.append(len(ops))
        if any(self.kv.get(c.key, 0) != c.value for c in compares):
            return False, self.rev
        self.rev += 1
        for op in ops:
            self.kv.setdefault(op.key, self.rev)
        return True, self.rev


def unit(name: str):
    key = name.encode()
    return [create_revision_is(key, 0)], [Op(key, b"v"), Op(b"route/" + key, b"r")]


async def test_concurrent_units_share_a_transaction_and_a_revision():
    etcd = Etcd()
    gc = GroupCommit(etcd.txn, max_ops=120)
    results = await asyncio.gather(*(gc.write(*unit(f"e{i}")) for i in range(40)))
    assert all(ok for ok, _ in results)
    assert len(etcd.txns) < 40 and gc.transactions == len(etcd.txns)
    assert max(etcd.txns) <= 120
    assert len({rev for _, rev in results}) == len(etcd.txns)


async def test_a_lost_guard_is_retried_alone():
    etcd = Etcd()
    gc = GroupCommit(etcd.txn)
    await gc.write(*unit("taken"))
    results = await asyncio.gather(*(gc.write(*unit(n)) for n in ("a", "taken", "b", "c")))
    assert [ok for ok, _ in results] == [True, False, True, True]
    assert set(etcd.kv) >= {b"a", b"b", b"c"}


async def test_same_key_units_never_share_a_transaction():
    etcd = Etcd()
    gc = GroupCommit(etcd.txn)
    results = await asyncio.gather(gc.write(*unit("x")), gc.write(*unit("x")), gc.write(*unit("y")))
    assert sorted(ok for ok, _ in results) == [False, True, True]


async def test_ops_limit_splits_groups():
    etcd = Etcd()
    gc = GroupCommit(etcd.txn, max_ops=6)
    await asyncio.gather(*(gc.write(*unit(f"e{i}")) for i in range(10)))
    assert max(etcd.txns) <= 6 and len(etcd.kv) == 20


async def test_lost_leadership_reaches_every_unit():
    etcd = Etcd()
    etcd.deposed = True
    gc = GroupCommit(etcd.txn)
    results = await asyncio.gather(*(gc.write(*unit(f"e{i}")) for i in range(5)), return_exceptions=True)
    assert all(isinstance(r, StaleEpoch) for r in results)
    etcd.deposed = False
    assert (await gc.write(*unit("later")))[0]  # the next write goes out normally


async def test_a_cancelled_caller_does_not_strand_the_others():
    etcd = Etcd()
    gc = GroupCommit(etcd.txn)
    first = asyncio.create_task(gc.write(*unit("a")))
    others = [asyncio.create_task(gc.write(*unit(n))) for n in ("b", "c")]
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert all(ok for ok, _ in await asyncio.gather(*others))
