"""A prefix mirror (the router's routes, the scheduler's cells) of more keys than one etcd
answer can carry: one range request for all of them passes gRPC's 4 MiB limit (the router
broke past ~10k live executions); the mirror lists them in pages at one revision, then
follows puts and deletes through its watch and relists the same."""

from __future__ import annotations

import asyncio

import pytest

from gyre.etcd import Etcd, Keys, Op, PrefixMirror

pytestmark = pytest.mark.timeout(120)
KEYS = 2500
VALUE = b"r" * 2048  # 2,500 x 2 KiB: 5 MB, past one answer's 4 MiB


async def test_a_mirror_larger_than_one_etcd_answer(etcd_server, cluster_name):
    etcd = Etcd([etcd_server.endpoint], timeout_s=20.0)
    await etcd.connect()
    prefix = Keys(cluster_name).routes()
    mirror = PrefixMirror(etcd, prefix, resync_s=3600.0, page=500)
    task = None
    try:
        names = [prefix + f"b1-e{i:05d}".encode() for i in range(KEYS)]
        for i in range(0, KEYS, 100):
            ok, _ = await etcd.txn([], [Op(k, VALUE) for k in names[i : i + 100]])
            assert ok
        with pytest.raises(Exception):  # noqa: B017 -- what failed before: one answer for all
            await etcd.get_prefix(prefix)
        task = asyncio.create_task(mirror.run())
        await asyncio.wait_for(mirror.synced.wait(), 60)
        assert set(mirror.items) == set(names)
        await etcd.put(prefix + b"b2-e0", b"new")
        await etcd.delete(names[0])
        await mirror.wait_for(lambda items: prefix + b"b2-e0" in items and names[0] not in items, 30)
        assert len(mirror.items) == KEYS
        await mirror.relist()  # the periodic reconcile: the same view, read in pages
        assert len(mirror.items) == KEYS and mirror.items[prefix + b"b2-e0"].value == b"new"
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await etcd.close()
