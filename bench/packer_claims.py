"""Packer benchmark: claims per second and packing throughput (tokens/s) with 16 concurrent
claimers, in process and over real gRPC against a packer process.

Run: ``PYTHONPATH=. .venv/bin/python bench/packer_claims.py [--groups 64] [--claimers 16]``.
Writes ``bench/results/packer_claims.json``. Every figure comes with a baseline measured in
the same run on the same machine, and the ratio between them:

- packing (in process): turns + finish reports in, packed micro-steps out, with the real
  fsync'd WAL, against the same work logged to memory (the ratio is the cost of durability);
- claims (in process): claim + ack pairs/s by 16 asyncio claimers on the real WAL;
- claims (gRPC): claim + ack pairs/s by 16 claimers over 4 channels to a packer process,
  against plain GetBatch calls/s from the same 16 callers (the ratio is what a claim costs
  beyond a round trip);
- ingest (gRPC): RecordTurn + ReportFinish tokens/s from 8 concurrent senders.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.testing.procs import ServiceProcess  # noqa: E402
from gyre.v1 import common_pb2, packer_pb2, packer_pb2_grpc  # noqa: E402
from services.packer.config import PackerConfig  # noqa: E402
from services.packer.model import ClaimOutcome, ExecStatus, Finish, Turn  # noqa: E402
from services.packer.packer import Packer  # noqa: E402
from services.packer.wal import EventLog, MemoryLog, Wal  # noqa: E402


def workload(groups: int, group_size: int, turns: int, seed: int = 0) -> list[tuple[list[Turn], list[Finish]]]:
    """Groups of executions with turns of 100..700 tokens (prompt 60..400, output 40..300)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        gid = f"g{g}"
        ts, fs = [], []
        for k in range(group_size):
            x = f"{gid}-x{k}"
            for i in range(turns):
                n_p, n_o = rng.randint(60, 400), rng.randint(40, 300)
                ts.append(Turn.validated(
                    x, gid, i, [rng.randrange(50_000) for _ in range(n_p)],
                    [rng.randrange(50_000) for _ in range(n_o)], [-rng.random() for _ in range(n_o)],
                    [0] * n_o, [], 1 << 20,
                ))
            fs.append(Finish.validated(x, gid, group_size, ExecStatus.COMPLETED, float(k), 0, 1 << 16))
        out.append((ts, fs))
    return out


def _config(args: argparse.Namespace, **extra: Any) -> PackerConfig:
    return PackerConfig(
        batch_size=args.groups, micro_step_token_budget=args.budget, policy_from_etcd=False,
        ready_grace_s=0.0, emit_fill_fraction=0.75, **extra,
    )


async def bench_packing(args: argparse.Namespace, data: list, log: EventLog) -> dict[str, Any]:
    packer = Packer(_config(args), log)
    packer.recover([])
    await packer.claim("activate", 1, 0, 0)  # pins the version: groups are packed as they arrive
    tokens = sum(t.tokens for ts, _ in data for t in ts)
    start = time.perf_counter()
    for ts, fs in data:
        for t in ts:
            await packer.record_turn(t)
        for f in fs:
            await packer.report_finish(f)
    elapsed = time.perf_counter() - start
    status = packer.batch_status(1)
    assert status["sealed"], status
    return {
        "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
        "turns_per_s": sum(len(ts) for ts, _ in data) / elapsed, "micro_steps": status["micro_steps"],
        "mean_fill": tokens / (status["micro_steps"] * args.budget),
    }


async def bench_claims_in_process(args: argparse.Namespace, data: list, wal_dir: str) -> dict[str, Any]:
    wal = Wal(wal_dir, fsync=True)
    wal.open()
    packer = Packer(_config(args), wal)
    packer.recover([])
    await packer.claim("activate", 1, 0, 0)
    for ts, fs in data:
        for t in ts:
            await packer.record_turn(t)
        for f in fs:
            await packer.report_finish(f)
    # "activate" holds one claim; release it by acking so the rest are for the claimers.
    for ms in list(packer.state.micro_steps.values()):
        if ms.holder == "activate":
            await packer.ack("activate", 1, ms.id)
    claimed: list[str] = []

    async def claimer(i: int) -> None:
        cell = f"cell{i}"
        while True:
            r = await packer.claim(cell, 1, 0, 0.05)
            if r.outcome is ClaimOutcome.CLOSED:
                return
            if r.outcome is ClaimOutcome.CLAIMED:
                claimed.append(r.micro_step.micro_step_id)
                await packer.ack(cell, 1, r.micro_step.micro_step_id)

    start = time.perf_counter()
    await asyncio.gather(*(claimer(i) for i in range(args.claimers)))
    elapsed = time.perf_counter() - start
    assert len(claimed) == len(set(claimed)) and packer.batch_status(1)["done"]
    await wal.close()
    return {"claims": len(claimed), "seconds": elapsed, "claims_per_s": len(claimed) / elapsed,
            "wal_flushes": wal.flushes}


async def bench_grpc(args: argparse.Namespace, data: list, workdir: str) -> dict[str, Any]:
    etcd = EtcdServer()
    etcd.start()
    cfg_path = Path(workdir) / "cluster.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump({
        "cluster": {"name": "bench", "etcd_endpoints": [etcd.endpoint]},
        "packer": {"wal_dir": str(Path(workdir) / "wal-grpc"), "batch_size": args.groups,
                   "micro_step_token_budget": args.budget, "ready_grace_s": 0.0, "log_level": "WARNING"},
    }))
    proc = ServiceProcess("packer", cfg_path, log_path=Path(workdir) / "packer.log").start()
    channels = [grpc.aio.insecure_channel(proc.target) for _ in range(4)]
    stubs = [packer_pb2_grpc.PackerStub(c) for c in channels]
    try:
        # Baseline: plain round trips from the same number of callers.
        n_base = 0
        stop = time.perf_counter() + args.baseline_s

        async def pinger(i: int) -> None:
            nonlocal n_base
            while time.perf_counter() < stop:
                await stubs[i % 4].GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=10)
                n_base += 1

        start = time.perf_counter()
        await asyncio.gather(*(pinger(i) for i in range(args.claimers)))
        base_elapsed = time.perf_counter() - start

        r = await stubs[0].ClaimMicroStep(packer_pb2.ClaimMicroStepRequest(cell_id="activate", batch_id=1), timeout=10)
        assert r.outcome == packer_pb2.CLAIM_OUTCOME_WAIT
        # Ingest: 8 concurrent senders.
        queue = list(data)
        tokens = sum(t.tokens for ts, _ in data for t in ts)

        async def sender(i: int) -> None:
            while queue:
                ts, fs = queue.pop()
                for t in ts:
                    await stubs[i % 4].RecordTurn(packer_pb2.TurnRecord(
                        execution_id=t.execution_id, group_id=t.group_id, turn_index=t.turn_index,
                        prompt_token_ids=t.prompt, output_token_ids=t.output, output_logprobs=t.logprobs,
                        output_policy_versions=t.versions), timeout=10)
                for f in fs:
                    await stubs[i % 4].ReportFinish(packer_pb2.FinishReport(
                        execution_id=f.execution_id, group_id=f.group_id, group_size=f.group_size,
                        status=common_pb2.EXECUTION_STATUS_COMPLETED, reward=f.reward), timeout=10)

        start = time.perf_counter()
        await asyncio.gather(*(sender(i) for i in range(8)))
        ingest_elapsed = time.perf_counter() - start
        claimed: list[str] = []

        async def claimer(i: int) -> None:
            stub, cell = stubs[i % 4], f"cell{i}"
            while True:
                r = await stub.ClaimMicroStep(packer_pb2.ClaimMicroStepRequest(
                    cell_id=cell, batch_id=1, wait_s=0.05), timeout=10)
                if r.outcome == packer_pb2.CLAIM_OUTCOME_CLOSED:
                    return
                if r.outcome == packer_pb2.CLAIM_OUTCOME_CLAIMED:
                    claimed.append(r.micro_step.micro_step_id)
                    await stub.AckMicroStep(packer_pb2.AckMicroStepRequest(
                        cell_id=cell, batch_id=1, micro_step_id=r.micro_step.micro_step_id), timeout=10)

        start = time.perf_counter()
        await asyncio.gather(*(claimer(i) for i in range(args.claimers)))
        claim_elapsed = time.perf_counter() - start
        status = await stubs[0].GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=10)
        assert len(claimed) == len(set(claimed)) == status.micro_steps and status.done, status
        return {
            "baseline_getbatch_per_s": n_base / base_elapsed,
            "claims": len(claimed), "claims_per_s": len(claimed) / claim_elapsed,
            "claim_vs_roundtrip": (len(claimed) / claim_elapsed) / (n_base / base_elapsed),
            "ingest_tokens_per_s": tokens / ingest_elapsed, "ingest_seconds": ingest_elapsed,
            "micro_steps": status.micro_steps, "total_loss_tokens": status.total_tokens,
        }
    finally:
        for c in channels:
            await c.close()
        proc.stop()
        etcd.cleanup()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=48, help="groups per batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1024, help="micro-step token budget")
    ap.add_argument("--claimers", type=int, default=16)
    ap.add_argument("--baseline-s", type=float, default=2.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "packer_claims.json"))
    args = ap.parse_args()
    data = workload(args.groups, args.group_size, args.turns)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-packer-") as tmp:
        wal_dir = os.path.join(tmp, "wal-pack")
        mem = await bench_packing(args, data, MemoryLog())
        wal = Wal(wal_dir, fsync=True)
        wal.open()
        durable = await bench_packing(args, data, wal)
        await wal.close()
        claims = await bench_claims_in_process(args, data, os.path.join(tmp, "wal-claims"))
        over_grpc = await bench_grpc(args, data, tmp)
    result = {
        "benchmark": "packer_claims",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "params": vars(args) | {"out": None},
        "packing_in_process": {"wal_fsync": durable, "memory_log_baseline": mem,
                               "ratio_vs_baseline": durable["tokens_per_s"] / mem["tokens_per_s"]},
        "claims_in_process": claims,
        "grpc": over_grpc,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({
        "packing_tokens_per_s (fsync WAL)": round(durable["tokens_per_s"]),
        "packing_tokens_per_s (memory baseline)": round(mem["tokens_per_s"]),
        "claims_per_s in process (16 claimers)": round(claims["claims_per_s"]),
        "claims_per_s gRPC (16 claimers)": round(over_grpc["claims_per_s"]),
        "GetBatch/s gRPC baseline (16 callers)": round(over_grpc["baseline_getbatch_per_s"]),
        "ingest tokens/s gRPC (8 senders)": round(over_grpc["ingest_tokens_per_s"]),
    }, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
