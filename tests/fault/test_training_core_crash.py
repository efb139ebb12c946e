"""Exactly one optimizer step per batch across a core crash: a core process killed between
its optimizer step and the step's record (checkpoint), or between the record and the
policy announcement, restarts from its checkpoint, finishes the batch's one step (replaying
the write-ahead record) and announces it; the redelivered JoinBatch/step for that batch is
a no-op, and the weights equal one clean step.

No training data is lost: a core killed after every micro-step of its batch was
acknowledged but before the reduce and step (``training.before_reduce``), or after the step
but before the packer heard of it (``training.before_commit``), restarts, and the batch
completes with the same weights as without the crash: the micro-steps were leases of the
batch's attempt, the new attempt gets them back (OpenBatch), and only the commit after the
durable step makes them final."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
import yaml

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from services.cell_agent.snapshots import pull_snapshot
from services.cell_agent.training.checkpoint import Checkpointer
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.leader import leader_epoch
from testkit.tls import channel, tls
from testkit.training_rig import join_batch

pytestmark = pytest.mark.timeout(240)
LR = 5e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def _join(epoch: int, target: str, batch: int, version: int) -> bool:
    """JoinBatch as the scheduler sends it: retried while the trainer is still starting."""
    async with channel(target, "scheduler") as ch:
        for attempt in range(60):
            try:
                return await join_batch(ch, epoch, batch, version, 1, target)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or attempt == 59:
                    raise
                await asyncio.sleep(1.0)
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "point",
    ["training.after_step", "training.after_checkpoint", "training.before_reduce", "training.before_commit"],
)
async def test_core_crash_around_the_record_gives_one_step(
    etcd_server, cluster_name, model_dir, tmp_path, point
):
    steps = synthetic_batch(1, 3, seed=9)
    ref = Trainer.from_dir(model_dir, 0, "float64")  # the initial policy is version 0
    for s in steps:
        ref.accumulate(s, 0)
    CoreOptimizer(ref, OptimConfig(lr=LR)).step(1, ref.flat_grads(), ref.tokens)
    want = ref.state_dict()

    packer = FakePacker()
    packer.add_batch(1, 0, steps)
    await packer.start(tls("packer"))
    ckpt_dir = tmp_path / "ckpt"
    cfg = {
        "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        "trainer_cell": {
            "training": {
                "model_dir": str(model_dir),
                "dtype": "float64",
                "lr": LR,
                "world_size": 1,
                "dist_master": "127.0.0.1:0",
                "packer_target": packer.target,
                "claim_wait_s": 0.2,
                "checkpoint_dir": str(ckpt_dir),
            }
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    epoch = await leader_epoch(etcd, Keys(cluster_name))
    key = Keys(cluster_name).policy()

    def proc(failpoint: str) -> ServiceProcess:
        return ServiceProcess(
            "cell_agent.training.worker",
            tmp_path / "c.yaml",
            {"cell_id": "core", "index": 0},
            env={"OMP_NUM_THREADS": "1", "GYRE_FAILPOINTS": failpoint},
            log_path=tmp_path / "core.log",
        )

    crashing = proc(point)
    restarted = None
    try:
        await asyncio.to_thread(crashing.start, 90)
        assert await _join(epoch, crashing.target, 1, 0)
        assert await asyncio.to_thread(crashing.wait, 60) == 17  # died at the failpoint
        assert await etcd.get(key) is None  # nothing announced
        restarted = proc("")
        await asyncio.to_thread(restarted.start, 90)
        for _ in range(300):
            kv = await etcd.get(key)
            if kv is not None:
                break
            await asyncio.sleep(0.1)
        if point == "training.before_reduce":
            # Nothing was durable: the scheduler joins the restarted core to the batch again,
            # and its new attempt gets back every micro-step the dead one had acknowledged.
            assert packer.status(1)[1:] == (3, False)  # acked, never committed
            await asyncio.sleep(0.5)
            assert await etcd.get(key) is None
            assert await _join(epoch, restarted.target, 1, 0)
            for _ in range(300):
                kv = await etcd.get(key)
                if kv is not None:
                    break
                await asyncio.sleep(0.1)
        assert kv is not None, "the restarted core never announced the step"
        policy = json.loads(kv.value)
        assert (policy["version"], policy["batch_id"]) == (1, 1)
        # A redelivered command for the batch: a no-op (already committed, or joined already).
        assert await _join(epoch, restarted.target, 1, 0) == (point == "training.before_reduce")
        for _ in range(100):
            if packer.status(1)[2]:
                break
            await asyncio.sleep(0.1)
        attempts, acked, committed = packer.status(1)
        assert committed and acked == 3  # the packer heard of the step: the data is trained for good
        assert attempts == (2 if point == "training.before_reduce" else 1)
        version, got = await pull_snapshot(restarted.target, 1)
        assert version == 1
        for name, w in want.items():
            assert torch.allclose(got[name], w, rtol=0, atol=1e-12), name
        rec = Checkpointer(ckpt_dir).latest()
        assert (rec.version, rec.batch_id, rec.steps) == (1, 1, 1)
        assert {float(s["step"]) for s in rec.optimizer["state"].values()} == {1.0}
        assert not Checkpointer(ckpt_dir).pending()
    finally:
        for p in (crashing, restarted):
            if p is not None:
                await asyncio.to_thread(p.stop, 10)
        await packer.stop()
        await etcd.close()
