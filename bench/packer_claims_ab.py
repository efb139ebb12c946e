"""A quick A/B of the packer's claim path: a mode of ``bench/packer_claims.py`` against one
packer process, round by round, with the packer's and the claimers' CPU per pair.

Run: ``PYTHONPATH=. .venv/bin/python bench/packer_claims_ab.py [--modes batched,trainer] [--rounds 4]``.
For a before/after on this shared machine, run it alternately from this tree and from an
older one (``git archive <commit> | tar -x -C /tmp/old``, then this script with
``PYTHONPATH=/tmp/old``: it imports the benchmark and the packer from PYTHONPATH; a tree
whose benchmark drains with another signature, from before the claim protocols were
retired, is refused). Prints one line per mode: claim + ack pairs/s, CPU µs per pair in the
packer process and in this one (the 16 claimers), RPCs and claims. Nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import tempfile
from pathlib import Path

import bench.packer_claims as bench  # from PYTHONPATH: this tree, or an older one (below)
from gyre.etcd.server import EtcdServer
from testkit.pki import BenchPki

MODES = {
    "batched": False,  # ClaimMicroSteps of --claim-batch + one AckMicroSteps, raw stubs
    "trainer": True,  # the same through the trainer's client (PackerSource)
}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="batched", help=f"comma-separated, of {sorted(MODES)}")
    ap.add_argument("--rounds", type=int, default=4, help="batches drained per mode")
    ap.add_argument("--claim-batch", type=int, default=8)
    a = ap.parse_args()
    modes = a.modes.split(",")
    if "trainer" not in inspect.signature(bench._Target.drain).parameters:
        ap.error("this tree's benchmark drains with another signature")
    args = argparse.Namespace(
        groups=48, group_size=8, turns=2, budget=1024, claimers=16, baseline_s=2.0, rounds=a.rounds
    )
    with tempfile.TemporaryDirectory(prefix="gyre-bench-packer-ab-") as tmp:
        etcd = EtcdServer()
        etcd.start()
        target = bench._Target(args, Path(tmp), etcd, BenchPki(Path(tmp) / "certs"), pre_encode=True)
        try:
            for _ in range(a.rounds):
                for m in modes:
                    await target.ingest(args)
                    await target.drain(args, m, a.claim_batch, MODES[m])
            for name, m in target.modes.items():
                n = m["claims"]
                print(
                    f"{name}: {n / m['seconds']:.0f} pairs/s, packer {1e6 * m['packer_cpu_s'] / n:.0f} µs/pair, "
                    f"claimers {1e6 * m['claimers_cpu_s'] / n:.0f} µs/pair, {m['rpcs']} RPCs, {n} claims"
                )
        finally:
            await target.close()
            etcd.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
