"""``python -m services.packer --config cluster.yaml``: wires the packer into the runtime."""

from __future__ import annotations

import asyncio
import logging

from gyre.backoff import Backoff
from gyre.etcd.election import verified_fence
from gyre.heap import release_free_heap
from gyre.history import History
from gyre.runtime import Runtime, Services, main
from services.packer.config import PackerConfig
from services.packer.history import HistoryLog
from services.packer.metrics import PackerMetrics
from services.packer.packer import Packer
from services.packer.servicer import SERVICE_NAME, PackerServicer, add_to_server
from services.packer.snapshot import compacted
from services.packer.store import CellMirror, PolicyMirror, open_incarnation
from services.packer.wal import Wal

log = logging.getLogger(__name__)


async def build(rt: Runtime) -> Services:
    cfg = rt.config
    assert isinstance(cfg, PackerConfig)
    wal = Wal(cfg.wal_dir, fsync=cfg.wal_fsync)
    logged = await asyncio.to_thread(wal.open)
    events = await open_incarnation(rt.etcd if cfg.wal_check_incarnation else None, rt.keys, wal, logged)
    del logged
    packer = Packer(
        cfg,
        HistoryLog(wal, History.of(cfg, svc="packer")) if cfg.history_file else wal,
        strict=cfg.check_every_change,
    )
    replayed = packer.recover(events)
    del events  # the log's lines: the replay is done with them
    await asyncio.to_thread(release_free_heap)  # what the replay freed goes back to the system
    await wal.sync()
    log.info("packer recovered", extra={"events": replayed, "counters": packer.counters()})
    rt.supervisor.spawn("wal", wal.watch())
    rt.supervisor.spawn("compactor", compactor(cfg, wal, packer))
    rt.supervisor.spawn("reaper", packer.run_reaper())
    if cfg.policy_from_etcd:
        rt.supervisor.spawn("policy", PolicyMirror(rt.etcd, rt.keys, packer).run())
    if cfg.release_on_cell_loss:
        rt.supervisor.spawn(
            "cells", CellMirror(rt.etcd, rt.keys, packer, grace_s=cfg.cell_loss_grace_s).run()
        )
    if cfg.metrics_port:
        metrics = PackerMetrics()
        metrics.serve(cfg.host, cfg.metrics_port)
        rt.supervisor.spawn("metrics", metrics.run(packer))

    async def _close_wal() -> None:
        await wal.close()

    rt.supervisor.on_flush(_close_wal)
    fence, leader = verified_fence(rt.etcd, rt.keys.leader())
    rt.supervisor.spawn("leader", leader.run())
    return [(PackerServicer(packer, cfg, fence), add_to_server, SERVICE_NAME)]


async def compactor(cfg: PackerConfig, wal: Wal, packer: Packer) -> None:
    """A supervised task: compacts the WAL to a snapshot once it has grown enough (a disk
    too full for the new log: the old one stays, and the next try waits longer)."""
    backoff = Backoff(max(cfg.wal_compact_check_s, 0.5), 30.0)
    while True:
        await asyncio.sleep(cfg.wal_compact_check_s)
        if wal.bytes_since_compact >= cfg.wal_compact_bytes:
            size = await wal.compact(lambda: compacted(packer.state))
            if size:
                log.info("packer WAL compacted", extra={"bytes": size})
                backoff.reset()
            else:
                await backoff.sleep()


if __name__ == "__main__":
    main("packer", PackerConfig, build)
