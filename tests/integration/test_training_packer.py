"""Training against the real packer service: the same turn records and finish reports fed
to two fresh packer processes give the same update whether one cell trains the batch
alone or a core and a satellite (joining while the data pauses) share it over gloo — the
packer's micro-steps, advantages and loss masks go through the real ClaimMicroSteps /
AckMicroSteps / KeepClaims API, and the core announces the version in etcd."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
import yaml

from apps.procs import ServiceProcess
from gyre.etcd import Etcd, Keys
from gyre.v1 import common_pb2 as cpb
from gyre.v1 import packer_pb2 as ppb
from gyre.v1 import packer_pb2_grpc as ppb_grpc
from services.cell_agent.snapshots import pull_snapshot
from services.packer.servicer import PackerServicer
from testkit.leader import leader_epoch
from testkit.tls import RoleStubs, channel
from testkit.training_rig import join_batch, start_cells, trainer_cells, trainer_config

pytestmark = pytest.mark.timeout(300)
GROUP_SIZE = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _records(group: int):
    """Deterministic turns and finishes of one group (distinct rewards: never zero-variance)."""
    rng = random.Random(group)
    turns, finishes = [], []
    for k in range(GROUP_SIZE):
        x, g = f"g{group}-x{k}", f"g{group}"
        for i in range(2):
            n_out = rng.randint(4, 10)
            turns.append(
                ppb.TurnRecord(
                    execution_id=x,
                    group_id=g,
                    turn_index=i,
                    prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(4, 12))],
                    output_token_ids=[rng.randrange(3, 500) for _ in range(n_out)],
                    output_logprobs=[-rng.uniform(5.0, 7.0) for _ in range(n_out)],
                    output_policy_versions=[0] * n_out,
                )
            )
        finishes.append(
            ppb.FinishReport(
                execution_id=x,
                group_id=g,
                group_size=GROUP_SIZE,
                status=cpb.EXECUTION_STATUS_COMPLETED,
                reward=float(k) + group,
                policy_version=0,
            )
        )
    return turns, finishes


async def _feed(stub, group: int) -> None:
    turns, finishes = _records(group)
    for t in turns:
        await stub.RecordTurn(t, timeout=10)
    for f in finishes:
        await stub.ReportFinish(f, timeout=10)


async def _join(epoch: int, target: str, batch: int, prefix: int, core: str) -> bool:
    async with channel(target, "scheduler") as ch:
        return await join_batch(ch, epoch, batch, 0, prefix, core, timeout_s=60)


async def _run(tmp, etcd_server, cluster: str, model_dir, cells: int) -> dict[str, torch.Tensor]:
    tmp.mkdir()
    cfg = trainer_config(
        {"name": cluster, "etcd_endpoints": [etcd_server.endpoint]},
        model_dir,
        cells,
        dtype="float64",
        lr=5e-3,
        claim_wait_s=0.3,
    )
    cfg["packer"] = {
        "wal_dir": str(tmp / "wal"),
        "wal_fsync": False,
        "batch_size": 2,
        "micro_step_token_budget": 48,
        "claim_ttl_s": 3.0,
        "reap_interval_s": 0.2,
        "ready_grace_s": 0.0,
        "log_level": "WARNING",
    }
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    packer = ServiceProcess("packer", path, log_path=tmp / "packer.log").start(timeout_s=60)
    cfg["trainer_cell"]["training"]["packer_target"] = packer.target
    path.write_text(yaml.safe_dump(cfg))
    procs = trainer_cells(path, cells, tmp)
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    epoch = await leader_epoch(etcd, Keys(cluster))
    try:
        targets = await start_cells(procs, 90)
        async with RoleStubs(packer.target, ppb_grpc.PackerStub, PackerServicer.ACCESS) as stub:
            await _feed(stub, 0)
            batch = (await stub.GetBatch(ppb.GetBatchRequest(batch_id=0), timeout=10)).batch_id
            assert await _join(epoch, targets[0], batch, 1, targets[0])
            for i in range(1, cells):
                assert await _join(epoch, targets[i], batch, i + 1, targets[0])
            # The data pauses: the second group arrives once the first one is trained.
            for _ in range(300):
                st = await stub.GetBatch(ppb.GetBatchRequest(batch_id=batch), timeout=10)
                if st.micro_steps and st.acked == st.micro_steps:
                    break
                await asyncio.sleep(0.05)
            await _feed(stub, 1)
            for _ in range(600):
                kv = await etcd.get(Keys(cluster).policy())
                if kv is not None:
                    break
                await asyncio.sleep(0.1)
            assert kv is not None and json.loads(kv.value)["version"] == 1
            st = await stub.GetBatch(ppb.GetBatchRequest(batch_id=batch), timeout=10)
            assert st.sealed and st.closed and st.acked == st.micro_steps
            # The core opened one attempt and committed it after its durable step.
            assert st.committed and st.attempt == 1
            assert st.counters.consumed == st.counters.produced - sum(st.counters.dropped.values())
        _, state = await pull_snapshot(targets[-1], 1)
        return state
    finally:
        for p in procs:
            await asyncio.to_thread(p.stop, 10)
        packer.stop()
        await etcd.close()


async def test_one_cell_and_two_cells_agree_on_the_real_packer(
    tmp_path, etcd_server, cluster_name, model_dir
):
    alone = await _run(tmp_path / "one", etcd_server, cluster_name + "a", model_dir, 1)
    shared = await _run(tmp_path / "two", etcd_server, cluster_name + "b", model_dir, 2)
    for name, w in alone.items():
        assert torch.allclose(shared[name], w, rtol=0, atol=1e-9), (name, (shared[name] - w).abs().max())
    # The satellite trained part of the batch (parsed from its own log).
    done = [
        json.loads(line)
        for line in (tmp_path / "two" / "c1.log").read_text().splitlines()
        if line.startswith("{") and '"batch done"' in line
    ]
    assert done and done[-1]["local_micro_steps"] >= 1 and done[-1]["prefix_size"] == 2
