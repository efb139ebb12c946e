"""The trainer inside the real cell agent: two elastic cell-agent processes (mock engine,
tiny model) with training enabled rendezvous over gloo at start-up; after the fenced
ROLLOUT -> DRAINING -> TRAINING moves, JoinBatch on the core and then on the satellite
(which pulls the core's snapshot over gRPC mid-batch) produce the batch's one step, equal
to one cell's; the core announces version 1 in etcd; after RETURNING both cells LoadPolicy
version 1 from the core's WeightSnapshots (the same port) and serve it in ROLLOUT. The
cells' history (role changes, loads, micro-steps trained and acknowledged, the step)
checks clean."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
import yaml

from apps.checker import check_files
from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper
from gyre.ports import free_port
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2 as cpb
from services.cell_agent.snapshots import pull_snapshot
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import FakePacker, synthetic_batch
from testkit.tls import channel, tls

pytestmark = pytest.mark.timeout(240)
LR = 5e-3


async def _join(stub: pb_grpc.CellControlStub, request: pb.JoinBatchRequest) -> pb.JoinBatchResponse:
    """JoinBatch as the scheduler sends it: UNAVAILABLE (the trainer is still starting: the
    rendezvous of every elastic cell, slow on a loaded machine) is retried."""
    for _ in range(60):
        try:
            return await stub.JoinBatch(request, timeout=60)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(1.0)
    raise AssertionError("the trainer never became ready")


async def test_trainer_in_cell_agents(tmp_path, etcd_server, cluster_name):
    from apps.model.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    steps = synthetic_batch(1, 6, seed=8)
    ref = Trainer.from_dir(model_dir, 0, "float64")
    for s in steps:
        ref.accumulate(s, 0)
    CoreOptimizer(ref, OptimConfig(lr=LR)).step(1, ref.flat_grads(), ref.tokens)

    packer = await FakePacker().start(tls("packer"))
    cfg = {
        "cluster": {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        "cell_agent": {
            "kind": "elastic",
            "slots": 2,
            "engine": "mock",
            "model_dir": str(model_dir),
            "mock": {"fixed_decode_step_s": 0.002},
            "probe_interval_s": 1.0,
            "drain_wait_s": 1.0,
            "history_file": str(tmp_path / "cells.jsonl"),
            "training": {
                "dtype": "float64",
                "lr": LR,
                "world_size": 2,
                "dist_master": f"127.0.0.1:{free_port()}",
                "packer_target": packer.target,
                "claim_wait_s": 0.2,
            },
        },
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs = [
        ServiceProcess(
            "cell_agent",
            path,
            {"cell_id": f"e{i}", "index": i},
            env={"OMP_NUM_THREADS": "1"},
            log_path=tmp_path / f"e{i}.log",
            name=f"e{i}",
        )
        for i in range(2)
    ]
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    keys = Keys(cluster_name)
    lease = LeaseKeeper(etcd, ttl_s=30)
    await lease.grant()
    epoch = await LeaderElection(etcd, keys.leader(), "sched", lease).campaign()
    fence = cpb.Fence(epoch=epoch)
    try:
        for p in procs:
            await asyncio.to_thread(p.start, 90)
        core, sat = (p.target for p in procs)
        chans = [channel(t, "scheduler") for t in (core, sat)]
        ctl = [pb_grpc.CellControlStub(c) for c in chans]
        for c in ctl:
            for state in (cpb.CELL_STATE_DRAINING, cpb.CELL_STATE_TRAINING):
                await c.SetState(pb.SetStateRequest(fence=fence, target=state), timeout=30)

        packer.add_batch(1, 0, steps, released=1)
        r = await _join(
            ctl[0],
            pb.JoinBatchRequest(fence=fence, batch_id=1, policy_version=0, prefix_size=1, core_target=core),
        )
        assert r.joined
        await asyncio.to_thread(packer.wait_claimed, 1, 1, 60)
        r = await _join(
            ctl[1],
            pb.JoinBatchRequest(fence=fence, batch_id=1, policy_version=0, prefix_size=2, core_target=core),
        )
        assert r.joined
        packer.release(1, 1, for_cell="e1")
        packer.release(1)
        for _ in range(600):
            kv = await etcd.get(keys.policy())
            if kv is not None:
                break
            await asyncio.sleep(0.1)
        assert kv is not None, "no policy announced"
        record = json.loads(kv.value)
        training = record.pop("training")  # the batch's loss diagnostics, reduced by the core
        assert record == {"version": 1, "source_target": core, "batch_id": 1}
        assert sum(training["lag_hist"]) == training["tokens"] > 0
        assert set(packer.claimed_by(1).values()) == {"e0", "e1"}
        _, got = await pull_snapshot(core, 1)
        for name, w in ref.state_dict().items():
            assert torch.allclose(got[name], w, rtol=0, atol=1e-9), name

        for c in ctl:
            await c.SetState(pb.SetStateRequest(fence=fence, target=cpb.CELL_STATE_RETURNING), timeout=60)
            loaded = await c.LoadPolicy(
                pb.LoadPolicyRequest(fence=fence, version=1, source_target=core), timeout=60
            )
            assert loaded.policy_version == 1
            await c.SetState(pb.SetStateRequest(fence=fence, target=cpb.CELL_STATE_ROLLOUT), timeout=60)
        for i in range(2):
            reg = json.loads((await etcd.get(keys.cell(f"e{i}"))).value)
            assert reg["policy_version"] == 1
        for c in chans:
            await c.close()
        # Both cells' part of the history (one file): it checks clean and shows the run.
        verdict = check_files([tmp_path / "cells.jsonl"])
        assert verdict.ok, verdict.violations
        c = verdict.counts
        assert (c["cell_starts"], c["cell_loads"], c["optimizer_steps"]) == (2, 2, 1)
        assert c["cell_role_changes"] == 10 and c["micro_steps_trained"] == len(steps)
    finally:
        for p in procs:
            await asyncio.to_thread(p.stop, 10)
        await packer.stop()
        await lease.revoke()
        await etcd.close()
