"""Streaming elastic training on the tiny model, with real processes: gloo prefix groups,
gRPC snapshot pulls and a scripted in-process packer.

For k = 1, 2, 3 cells (core + k-1 satellites, one process each):
  * batch 1: the core trains alone on version 0 (warm-up; the satellites keep version 0);
  * batch 2 (join): the core opens the batch at version 1 and the satellites join at once:
    each pulls snapshot 1 from the core over gRPC while the core trains, then claims.
    Join time = JoinBatch → weights loaded (pull) and → first micro-step accumulated;
  * batch 3 (throughput): everyone holds version 2 (broadcast), all join at the start.
    Throughput = loss tokens / (core JoinBatch → policy version announced in etcd), the
    median of --repeats batches (the machine is shared: single runs are noisy).
Ratios are against k = 1 measured in the same run. Writes bench/results/training_elastic.json.

    PYTHONPATH=. .venv/bin/python bench/training_elastic.py [--micro-steps 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from apps.model.tiny import build_tiny_model  # noqa: E402
from gyre.etcd import Etcd, Keys  # noqa: E402
from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.identity import Role  # noqa: E402
from testkit.fake_packer import FakePacker, synthetic_batch  # noqa: E402
from testkit.pki import BenchPki  # noqa: E402
from testkit.training_rig import join_batch, start_cells, trainer_cells, trainer_config  # noqa: E402


async def _join(
    lead: tuple[BenchPki, int], target: str, batch: int, version: int, prefix: int, core: str
) -> bool:
    """JoinBatch as the scheduler would send it: its identity, its (etcd-verified) epoch."""
    pki, epoch = lead
    async with pki.channel(target, "scheduler", Role.SCHEDULER, Role.CELL_AGENT) as ch:
        return await join_batch(ch, epoch, batch, version, prefix, core, timeout_s=120)


async def _wait_policy(etcd: Etcd, key: bytes, version: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kv = await etcd.get(key)
        if kv is not None and json.loads(kv.value)["version"] >= version:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"policy version {version} not published in {timeout_s}s")


def _outcomes(log: Path) -> dict[int, dict]:
    out = {}
    for line in log.read_text().splitlines():
        if line.startswith("{") and ('"batch done"' in line or '"batch stepped"' in line):
            rec = json.loads(line)
            out[int(rec["batch_id"])] = rec
    return out


async def run_k(
    k: int, etcd: EtcdServer, model_dir: Path, work: Path, micro: int, dtype: str, repeats: int
) -> dict:
    cluster = f"bench{k}"
    pki = BenchPki(work / "certs")  # mTLS on every hop, as Gyre runs by default
    packer = await FakePacker().start(pki.tls("packer", Role.PACKER))
    cfg = trainer_config(
        {"name": cluster, "etcd_endpoints": [etcd.endpoint], "tls": {"dir": pki.tls_dir}},
        model_dir,
        k,
        dtype=dtype,
        lr=1e-4,
        packer_target=packer.target,
        claim_wait_s=0.5,
        snapshot_chunk_bytes=1 << 20,
    )
    path = work / f"k{k}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs = trainer_cells(path, k, work, log_prefix=f"k{k}-")
    client = Etcd([etcd.endpoint])
    await client.connect()
    key = Keys(cluster).policy()
    await client.create(Keys(cluster).leader(), b"bench")  # this script is the scheduler
    lead = (pki, (await client.get(Keys(cluster).leader())).create_revision)
    kw = dict(seqs_per_step=4, min_len=64, max_len=128, seed=11)
    try:
        targets = await start_cells(procs, 120)
        core = targets[0]
        # Batch 1: the core alone.
        packer.add_batch(1, 0, synthetic_batch(1, max(4, micro // 4), **kw))
        assert await _join(lead, core, 1, 0, 1, core)
        await _wait_policy(client, key, 1)
        # Batch 2: satellites join at once and pull version 2 while the core trains.
        steps2 = synthetic_batch(2, micro, **kw)
        packer.add_batch(2, 1, steps2)
        assert await _join(lead, core, 2, 1, 1, core)
        for i in range(1, k):
            assert await _join(lead, targets[i], 2, 1, i + 1, core)
        await _wait_policy(client, key, 2)
        # Batches 3..: everyone holds the version (broadcast); the median of `repeats`.
        times, rates = [], []
        for b in range(3, 3 + repeats):
            steps = synthetic_batch(b, micro, **kw)
            packer.add_batch(b, b - 1, steps)
            t0 = time.perf_counter()
            for i in range(k):
                assert await _join(lead, targets[i], b, b - 1, i + 1, core)
            await _wait_policy(client, key, b)
            times.append(time.perf_counter() - t0)
            rates.append(sum(s.num_tokens for s in steps) / times[-1])
        mid = sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]
        seconds, tokens = times[mid], rates[mid] * times[mid]
    finally:
        for p in procs:
            await asyncio.to_thread(p.stop, 10)
        await packer.stop()
        await client.close()
    outs = [_outcomes(work / f"k{k}-c{i}.log") for i in range(k)]
    joins = [
        {
            "cell": f"c{i}",
            "pull_s": o[2]["joined_s"],
            "first_micro_step_s": o[2]["first_micro_step_s"],
            "micro_steps_trained": o[2]["local_micro_steps"],
        }
        for i, o in enumerate(outs)
        if i > 0
    ]
    last = 2 + repeats
    share = [o[last]["local_micro_steps"] for o in outs]
    return {
        "cells": k,
        "batch_tokens": round(tokens),
        "batch_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_s_all": rates,
        "micro_steps_per_cell": share,
        "satellite_joins": joins,
        "core_step_tokens": outs[0][last]["total_tokens"],
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-steps", type=int, default=24)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cells", default="1,2,3")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-train-"))
    model_dir = build_tiny_model(work / "tiny", seed=0)
    n_params = sum(
        t.numel()
        for t in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(model_dir / "model.safetensors"))
        .values()
    )
    etcd = EtcdServer()
    etcd.start()
    try:
        runs = []
        for k in (int(x) for x in args.cells.split(",")):
            r = await run_k(k, etcd, model_dir, work, args.micro_steps, args.dtype, args.repeats)
            runs.append(r)
            print(json.dumps(r), flush=True)
    finally:
        etcd.cleanup()
    base = runs[0]["tokens_per_s"]
    for r in runs:
        r["throughput_ratio_vs_1"] = r["tokens_per_s"] / base
    result = {
        "bench": "training_elastic",
        "model": {"dir": "apps.model.tiny seed 0", "params": n_params, "dtype": args.dtype},
        "micro_steps_per_batch": args.micro_steps,
        "repeats": args.repeats,
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.cuda.is_available(),
        },
        "runs": runs,
        "logs": str(work),
    }
    out = ROOT / "bench" / "results" / "training_elastic.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
