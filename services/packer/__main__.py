"""``python -m services.packer --config cluster.yaml``: wires the packer into the runtime."""

from __future__ import annotations

import asyncio

from gyre.runtime import Runtime, Services, main
from gyre.v1 import packer_pb2_grpc
from services.packer.config import PackerConfig
from services.packer.packer import Packer
from services.packer.servicer import SERVICE_NAME, PackerServicer
from services.packer.store import PolicyMirror
from services.packer.wal import Wal


async def build(rt: Runtime) -> Services:
    cfg = rt.config
    assert isinstance(cfg, PackerConfig)
    wal = Wal(cfg.wal_dir, fsync=cfg.wal_fsync)
    events = await asyncio.to_thread(wal.open)
    packer = Packer(cfg, wal)
    packer.recover(events)
    await wal.sync()
    rt.supervisor.spawn("wal", wal.watch())
    rt.supervisor.spawn("reaper", packer.run_reaper())
    if cfg.policy_from_etcd:
        rt.supervisor.spawn("policy", PolicyMirror(rt.etcd, rt.keys, packer).run())

    async def _close_wal() -> None:
        await wal.close()

    rt.supervisor.on_flush(_close_wal)
    return [(PackerServicer(packer, cfg), packer_pb2_grpc.add_PackerServicer_to_server, SERVICE_NAME)]


if __name__ == "__main__":
    main("packer", PackerConfig, build)
