"""etcd upkeep on a real etcd with TLS and per-identity roles: a compacted database is
defragmented when its free part is worth it, only by root, and the launcher's upkeep
records it (issue 36: etcd stays bounded over a long run)."""

from __future__ import annotations

import asyncio

import pytest

from apps.etcd_upkeep import EtcdUpkeep
from gyre.etcd.maintenance import DefragRule, db_size, defragment_if_due
from gyre.etcd.server import EtcdServer
from testkit.tls import etcd_client, provision_etcd, tls

CLUSTER = "upkeep"


async def _fragment(endpoint: str) -> None:
    """About 16 MB of revisions on one key, then every old revision compacted away."""
    async with etcd_client(endpoint) as etcd:
        client = etcd.client
        value = b"x" * 64 * 1024
        for i in range(256):
            await client.put(b"/gyre/upkeep/blob", value[:-1] + bytes([i % 256]))
        revision = (await client.get(b"/gyre/upkeep/blob")).mod_revision
        await client.compact(revision, physical=True)
        # The freed pages count once the backend commits again (every 100 ms, on a write).
        for _ in range(50):
            await asyncio.sleep(0.1)
            await client.put(b"/gyre/upkeep/tick", b"")
            if (await db_size(etcd)).free_bytes > 8 * 1024 * 1024:
                return


def test_a_compacted_database_is_defragmented_when_due(secure_etcd: EtcdServer) -> None:
    async def run() -> None:
        await provision_etcd(secure_etcd.endpoint, CLUSTER, "scheduler")
        await _fragment(secure_etcd.endpoint)
        async with etcd_client(secure_etcd.endpoint) as etcd:
            before = await db_size(etcd)
            assert before.free_bytes > 8 * 1024 * 1024, before
            # Not due: nothing is done and the file keeps its size.
            assert await defragment_if_due(etcd, DefragRule(min_free_mb=10_000)) is None
            assert (await db_size(etcd)).file_bytes == before.file_bytes
            outcome = await defragment_if_due(etcd, DefragRule(min_free_mb=1, min_free_share=0.5))
            assert outcome is not None
            assert outcome.after.file_bytes < before.file_bytes / 2, outcome
            assert (await etcd.client.get(b"/gyre/upkeep/blob")) is not None  # data kept

    asyncio.run(run())


def test_defragmentation_needs_root(secure_etcd: EtcdServer) -> None:
    async def run() -> None:
        await provision_etcd(secure_etcd.endpoint, CLUSTER, "scheduler")
        await _fragment(secure_etcd.endpoint)
        async with etcd_client(secure_etcd.endpoint, "scheduler") as etcd:
            with pytest.raises(Exception, match="(?i)permission"):
                await defragment_if_due(etcd, DefragRule(min_free_mb=0, min_free_share=0))
        async with etcd_client(secure_etcd.endpoint) as etcd:
            size = await db_size(etcd)
            assert size.free_bytes > 8 * 1024 * 1024, "a refused defragmentation changed the file"

    asyncio.run(run())


def test_the_launchers_upkeep_records_each_defragmentation(secure_etcd: EtcdServer) -> None:
    asyncio.run(_fragment(secure_etcd.endpoint))
    events: list[tuple[str, str, dict[str, float]]] = []
    upkeep = EtcdUpkeep.from_config(
        {"defrag_min_free_mb": 1},
        secure_etcd.endpoint,
        tls("root"),
        lambda name, kind, **detail: events.append((name, kind, detail)),
    )
    assert upkeep.check() is not None
    assert upkeep.check() is None  # nothing left to free
    [(name, kind, detail)] = events
    assert (name, kind) == ("etcd", "defragmented")
    assert detail["db_mb_after"] < detail["db_mb_before"]


def test_the_private_etcd_snapshots_every_ten_thousand_entries(fresh_etcd: EtcdServer) -> None:
    """etcd holds every Raft entry since its last snapshot in memory; the launcher's etcd
    snapshots every 10,000 (``--snapshot-count``; etcd 3.4's default is 100,000, ~2.5 hours
    of Gyre's writes, over which a soak's etcd grew ~100 MB an hour). 10,500 writes leave a
    snapshot on disk."""
    from gyre.etcd import Etcd

    async def run() -> None:
        async with Etcd([fresh_etcd.endpoint]) as etcd:
            client = etcd.client
            for start in range(0, 10_500, 250):
                await asyncio.gather(
                    *(client.put(f"/snap/{i % 50}".encode(), b"x") for i in range(start, start + 250))
                )

    asyncio.run(run())
    snaps = list(fresh_etcd.data_dir.glob("data/member/snap/*.snap"))
    assert snaps, "no Raft snapshot after 10,500 writes"
