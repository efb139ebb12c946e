"""The NCCL path of streaming elastic training (skipped without CUDA): prefix groups over
NCCL reduce to the core and broadcast from it; a core step on the GPU matches the CPU
float64 step and its snapshot travels intact; with two GPUs, two cell processes on NCCL
(core + one satellite joining mid-batch) give the update one cell takes alone. Figures
(join and batch times) are printed as JSON lines and, when $OUT is set, written there."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import pytest
import torch
import torch.multiprocessing as mp

from gyre.ports import free_port
from services.cell_agent import snapshots
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.dist import PrefixGroups
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import synthetic_batch
from testkit.leader import leader_epoch
from testkit.tls import add_port, channel, tls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")


def _record(name: str, figures: dict) -> None:
    line = json.dumps({"test": name, **figures})
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "training_nccl.jsonl"), "a") as f:
            f.write(line + "\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


async def test_gpu_core_step_matches_cpu_and_snapshot_travels(model_dir):
    steps = synthetic_batch(1, 4, seed=4, min_len=32, max_len=64)
    results = {}
    for device, dtype in (("cpu", "float64"), ("cuda:0", "float32")):
        t = Trainer.from_dir(model_dir, 1, dtype, device)
        start = time.perf_counter()
        for s in steps:
            t.accumulate(s, 1)
        CoreOptimizer(t, OptimConfig(lr=1e-3)).step(1, t.flat_grads(), t.tokens)
        if device != "cpu":
            torch.cuda.synchronize()
        results[device] = (t, time.perf_counter() - start)
    gpu, cpu = results["cuda:0"][0], results["cpu"][0]
    diff = (gpu.flat_params().double().cpu() - cpu.flat_params()).abs().max().item()
    assert diff < 1e-4, diff
    store = snapshots.SnapshotStore()
    store.publish(2, gpu.state_dict())
    server = grpc.aio.server()
    snapshots.WeightSnapshotsServicer(store).register(server)
    port = add_port(server, "127.0.0.1:0", "cell-0")  # a cell serves snapshots (mTLS)
    await server.start()
    try:
        start = time.perf_counter()
        version, state = await snapshots.pull_snapshot(f"127.0.0.1:{port}", 2)
        pull_s = time.perf_counter() - start
    finally:
        await server.stop(0)
    assert version == 2
    for name, w in gpu.state_dict().items():
        assert torch.equal(state[name], w.cpu()), name
    _record(
        "core_step_gpu",
        {
            "gpu_batch_s": results["cuda:0"][1],
            "cpu64_batch_s": results["cpu"][1],
            "max_abs_diff_vs_cpu64": diff,
            "pull_s": pull_s,
        },
    )


def _nccl_rank(rank: int, world: int, port: int, q) -> None:
    torch.cuda.set_device(rank)
    groups = PrefixGroups(
        rank=rank,
        world_size=world,
        master=f"127.0.0.1:{port}",
        backend="nccl",
        device=torch.device(f"cuda:{rank}"),
        timeout_s=60,
    )
    groups.setup()
    try:
        t = torch.full((1 << 20,), float(rank + 1), device=f"cuda:{rank}")
        torch.cuda.synchronize()
        start = time.perf_counter()
        groups.reduce_to_core(world, t)
        torch.cuda.synchronize()
        reduce_s = time.perf_counter() - start
        if rank == 0:
            ok_reduce = bool((t == sum(range(1, world + 1))).all())
            t.fill_(42.0)
        groups.broadcast_from_core(world, t)
        torch.cuda.synchronize()
        q.put((rank, bool((t == 42.0).all()), ok_reduce if rank == 0 else True, reduce_s))
    finally:
        groups.close()


@two_gpus
def test_nccl_prefix_groups_reduce_and_broadcast():
    world = min(torch.cuda.device_count(), 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in range(world)]
    for p in procs:
        p.join(60)
    assert all(b and r for _, b, r, _ in got), got
    _record("nccl_reduce_4MiB", {"world": world, "reduce_s": max(x[3] for x in got)})


@two_gpus
async def test_two_gpu_cells_equal_one_cell(etcd_server, cluster_name, model_dir, tmp_path):
    import yaml

    from gyre.etcd import Etcd, Keys
    from gyre.v1 import cell_agent_pb2 as pb
    from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
    from gyre.v1 import common_pb2 as cpb
    from testkit.fake_packer import FakePacker
    from testkit.training_rig import start_cells, trainer_cells, trainer_config

    steps = synthetic_batch(2, 16, seed=6, seqs_per_step=8, min_len=128, max_len=256)
    ref = Trainer.from_dir(model_dir, 0, "float64", "cpu")
    for s in steps:
        ref.accumulate(s, 0)
    CoreOptimizer(ref, OptimConfig(lr=1e-3)).step(1, ref.flat_grads(), ref.tokens)
    want = ref.state_dict()

    packer = await FakePacker().start(tls("packer"))
    cfg = trainer_config(
        {"name": cluster_name, "etcd_endpoints": [etcd_server.endpoint]},
        model_dir,
        2,
        dtype="float32",
        lr=1e-3,
        device="auto",
        dist_backend="auto",
        packer_target=packer.target,
        claim_wait_s=0.2,
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    procs = trainer_cells(tmp_path / "c.yaml", 2, tmp_path, prefix="g", single_threaded=False)
    etcd = Etcd([etcd_server.endpoint])
    await etcd.connect()
    epoch = await leader_epoch(etcd, Keys(cluster_name))  # fenced commands need a real leader

    async def join(target, prefix, core):
        async with channel(target, "scheduler") as ch:
            return (
                await pb_grpc.CellControlStub(ch).JoinBatch(
                    pb.JoinBatchRequest(
                        fence=cpb.Fence(epoch=epoch),
                        batch_id=1,
                        policy_version=0,
                        prefix_size=prefix,
                        core_target=core,
                    ),
                    timeout=120,
                )
            ).joined

    try:
        core, sat = await start_cells(procs, 180)
        packer.add_batch(1, 0, steps, released=3)
        start = time.perf_counter()
        assert await join(core, 1, core)
        await asyncio.to_thread(packer.wait_claimed, 1, 2, 120)
        assert await join(sat, 2, core)
        packer.release(1, 1, for_cell="g1")
        packer.release(1)
        key = Keys(cluster_name).policy()
        while (kv := await etcd.get(key)) is None:
            await asyncio.sleep(0.01)
        batch_s = time.perf_counter() - start
        assert json.loads(kv.value)["version"] == 1
        _, got = await snapshots.pull_snapshot(sat, 1)
        diff = max((got[n].double() - w).abs().max().item() for n, w in want.items())
        assert diff < 1e-4, diff
        assert len(set(packer.claimed_by(1).values())) == 2
        _record("two_gpu_cells", {"batch_s": batch_s, "max_abs_diff_vs_cpu64": diff})
    finally:
        for p in procs:
            await asyncio.to_thread(p.stop, 10)
        await packer.stop()
        await etcd.close()
