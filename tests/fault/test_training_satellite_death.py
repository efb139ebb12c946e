"""A satellite killed mid-batch (SIGKILL) neither hangs the core nor leaves a partial
update: the core's reduce fails promptly, no optimizer step is taken and nothing is
published, the core keeps serving its weights (unchanged, version 0), and JoinBatch
commands get a clear UNAVAILABLE (the prefix groups are broken) instead of a hang.

Then, without an operator: the satellite is restarted (as its supervisor would), the prefix
groups re-form (a new generation), and the batch is attempted again by both cells with
every micro-step redelivered (the first attempt's acks were leases): one step, published,
committed at the packer."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
import yaml

from gyre.errors import NotFound
from gyre.etcd import Etcd, Keys
from services.cell_agent.snapshots import pull_snapshot
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.leader import leader_epoch
from testkit.tls import channel, tls
from testkit.training_rig import join_batch, start_cells, trainer_cell, trainer_cells, trainer_config

pytestmark = pytest.mark.timeout(180)


async def _join(epoch: int, target: str, batch: int, prefix: int, core: str) -> bool:
    async with channel(target, "scheduler") as ch:
        return await join_batch(ch, epoch, batch, 0, prefix, core, timeout_s=30)


async def test_satellite_killed_mid_batch(tmp_path, etcd_server, cluster_name):
    from apps.model.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    packer = await FakePacker().start(tls("packer"))
    cfg = trainer_config(
        {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        model_dir,
        2,
        dtype="float32",
        dist_timeout_s=60,
        packer_target=packer.target,
        claim_wait_s=0.2,
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    procs = trainer_cells(tmp_path / "c.yaml", 2, tmp_path)
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    epoch = await leader_epoch(etcd, Keys(cluster_name))
    try:
        core, sat = await start_cells(procs, 90)
        for _ in range(300):  # the core exposes version 0 once its trainer is up
            try:
                _, before = await pull_snapshot(core, 0)
                break
            except NotFound:
                await asyncio.sleep(0.1)
        packer.add_batch(1, 0, synthetic_batch(1, 6), released=1)
        assert await _join(epoch, core, 1, 1, core)
        await asyncio.to_thread(packer.wait_claimed, 1, 1, 60)
        assert await _join(epoch, sat, 1, 2, core)
        packer.release(1, 1, for_cell="c1")
        await asyncio.to_thread(packer.wait_claimed, 1, 2, 60)
        procs[1].kill()  # SIGKILL while it holds its share of the batch
        packer.release(1)
        start = time.monotonic()
        broken = None
        while time.monotonic() - start < 60:
            try:
                await _join(epoch, core, 2, 1, core)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE and "broken" in (err.details() or ""):
                    broken = time.monotonic() - start
                    break
            await asyncio.sleep(0.2)
        assert broken is not None, "the core never noticed the dead satellite"
        assert procs[0].alive()
        assert await etcd.get(Keys(cluster_name).policy()) is None  # no step announced
        version, after = await pull_snapshot(core, 0)
        assert version == 0
        assert all(torch.equal(after[n], t) for n, t in before.items())  # no partial update
        # The supervisor restarts the satellite; the groups re-form by themselves.
        procs.append(trainer_cell(tmp_path / "c.yaml", "c1", 1, tmp_path / "c1-restarted.log"))
        await asyncio.to_thread(procs[-1].start, 90)
        joined = False
        for _ in range(300):
            try:
                joined = await _join(epoch, core, 1, 1, core)
                break
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                await asyncio.sleep(0.3)
        assert joined, "the prefix groups never re-formed"
        for _ in range(100):
            try:
                if await _join(epoch, procs[-1].target, 1, 2, core):
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
        kv = None
        for _ in range(600):
            kv = await etcd.get(Keys(cluster_name).policy())
            if kv is not None:
                break
            await asyncio.sleep(0.1)
        assert kv is not None, "the batch never completed after the re-formation"
        for _ in range(100):
            if packer.status(1)[2]:
                break
            await asyncio.sleep(0.1)
        assert packer.status(1) == (2, 6, True)  # a second attempt; all six trained, committed
        version, _ = await pull_snapshot(core, 1)
        assert version == 1
    finally:
        for p in procs:
            await asyncio.to_thread(p.stop, 10)
        await packer.stop()
        await etcd.close()
