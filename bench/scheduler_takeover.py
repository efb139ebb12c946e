"""What a scheduler takeover costs after 10k, 100k and 1M executions closed, and how much
etcd holds: with closed bursts archived (what the leader does) and, as the baseline in the
same run, with every record kept (the layout before archiving).

How the ledger is reached quickly: bursts of ``--burst`` closed executions (groups of 4)
are written straight to a private etcd as the leader writes them (one burst key, one
execution record of ~530 bytes each, in transactions of 120 operations), skipping the
harness round trips. In the archived layout each burst is then folded with the leader's
own transaction (``SchedulerStore.archive``: summary put + burst delete + range delete of
its records, fenced), as the control loop does once a burst is closed and its finish
reports settled; the newest two bursts stay live (the current one and one in its grace
period). The takeover is the real ``Scheduler.take_over`` (paged reads, ledger rebuild,
relay requeue of the live closed records) on that etcd.

Reported per size: takeover seconds, keys read, etcd ``dbSize`` as written (MVCC history
included) and after compaction + defragmentation (what auto-compaction and a defrag
reach: the live data), and, for the baseline, whether one un-paged range read of the
ledger (the takeover before this change) still fits gRPC's 4 MiB limit.

    PYTHONPATH=. .venv/bin/python bench/scheduler_takeover.py [--sizes 10000,100000,1000000]
        [--baseline-sizes 10000,100000] [--burst 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import aetcd.rpc

from gyre.execution import ExecutionStatus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre import config as config_mod
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper, Op
from gyre.etcd.server import EtcdServer
from services.scheduler.config import SchedulerConfig
from services.scheduler.ledger import ArchiveSummary, Burst, ExecutionRecord, Task
from services.scheduler.scheduler import Scheduler
from services.scheduler.store import MAX_TXN_OPS, SchedulerStore
from services.scheduler.tasks import GeneratedTasks
from testkit.recording_peers import RecordingPeers

GROUP = 4
LIVE_BURSTS = 2
CLUSTER = "bench"


def _burst(burst_id: int, executions: int) -> tuple[Burst, list[bytes]]:
    """A closed burst and its execution records, serialized."""
    burst = Burst(
        burst_id,
        burst_id - 1,
        burst_id,
        GROUP,
        tuple(Task(f"task-{burst_id}-{t}", '{"prompt": "p"}') for t in range(executions // GROUP)),
    )
    recs = []
    for seq in range(burst.quota):
        eid, gid, task = burst.member(seq)
        rec = ExecutionRecord(
            eid,
            burst_id,
            seq,
            gid,
            task.task_id,
            burst.policy_version,
            ExecutionStatus.COMPLETED,
            "ab" * 32,
            "harness-0042",
            1.7e9,
            1.7e9 + 90.0,
            0.5,
            "f" * 32,
            "cd" * 32,
        )
        recs.append(rec.to_json())
    return burst, recs


async def _write_burst(etcd: Etcd, keys: Keys, burst: Burst, recs: list[bytes]) -> None:
    ops = [Op(keys.burst(burst.burst_id), burst.to_json())]
    ops += [Op(keys.execution(burst.burst_id, burst.member(i)[0]), r) for i, r in enumerate(recs)]
    for i in range(0, len(ops), MAX_TXN_OPS):
        ok, _ = await etcd.txn([], ops[i : i + MAX_TXN_OPS])
        assert ok


async def _db(etcd: Etcd) -> tuple[int, int]:
    client = etcd.client
    got = await client.maintenancestub.Status(aetcd.rpc.StatusRequest(), timeout=60, metadata=client.metadata)
    return int(got.dbSize), int(got.dbSizeInUse)


async def _compact_defrag(etcd: Etcd) -> None:
    client = etcd.client
    rev, _ = await etcd.get_prefix(b"/nothing/")
    await client.kvstub.Compact(
        aetcd.rpc.CompactionRequest(revision=rev, physical=True), timeout=600, metadata=client.metadata
    )
    await client.maintenancestub.Defragment(
        aetcd.rpc.DefragmentRequest(), timeout=600, metadata=client.metadata
    )


async def _one(n: int, burst_size: int, archive: bool) -> dict[str, object]:
    bursts = max(LIVE_BURSTS + 1, -(-n // burst_size))  # at least n executions
    with EtcdServer() as server:
        etcd = Etcd([server.endpoint], timeout_s=120.0)
        await etcd.connect()
        keys = Keys(CLUSTER)
        lease = LeaseKeeper(etcd, 30)
        await lease.grant()
        keeper = asyncio.create_task(lease.run())
        election = LeaderElection(etcd, keys.leader(), '{"target": "bench"}', lease)
        epoch = await election.campaign()
        store = SchedulerStore(etcd, keys, election)
        summary = ArchiveSummary()
        started = time.perf_counter()
        for b in range(1, bursts + 1):
            burst, recs = _burst(b, burst_size)
            await _write_burst(etcd, keys, burst, recs)
            if archive and b - LIVE_BURSTS >= 1:  # the leader archives all but the newest two
                old, _ = _burst(b - LIVE_BURSTS, burst_size)
                summary = summary.add(old, {"COMPLETED": old.quota})
                rev = await store.archive(summary, summary.revision)
                summary = dataclasses.replace(summary, revision=rev)
        write_s = time.perf_counter() - started
        db_written, _ = await _db(etcd)
        one_request = "not tried"
        if not archive:
            try:
                t0 = time.perf_counter()
                _, kvs = await etcd.get_prefix(keys.executions())
                one_request = f"ok: {len(kvs)} records in {time.perf_counter() - t0:.2f} s"
            except Exception as exc:  # noqa: BLE001 -- the failure is the finding
                one_request = f"fails: {str(exc).splitlines()[0][:160]}"
        cfg = config_mod.load(
            SchedulerConfig, None, cluster_name=CLUSTER, policy="rollout_only", group_size=GROUP
        )
        s = Scheduler(config=cfg, store=store, peers=RecordingPeers(), tasks=GeneratedTasks())
        t0 = time.perf_counter()
        await s.take_over(int(epoch))
        takeover_s = time.perf_counter() - t0
        c = s.ledger.counts()
        assert c.finished == bursts * burst_size, (c, bursts * burst_size)
        live_records = len(s.ledger.records)
        await _compact_defrag(etcd)
        db_compacted, in_use = await _db(etcd)
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
        await etcd.close()
    out = {
        "executions_closed": bursts * burst_size,
        "bursts": bursts,
        "archived": archive,
        "takeover_s": round(takeover_s, 3),
        "records_read": live_records,
        "etcd_db_bytes_as_written": db_written,
        "etcd_db_bytes_compacted": db_compacted,
        "etcd_db_bytes_in_use": in_use,
        "write_s": round(write_s, 1),
    }
    if not archive:
        out["one_unpaged_read"] = one_request
    print(
        f"{'archived' if archive else 'kept    '} {bursts * burst_size:>9,} closed: takeover {takeover_s:7.3f} s "
        f"({live_records:,} records read), etcd {db_written / 2**20:7.1f} MiB written, "
        f"{db_compacted / 2**20:7.1f} MiB compacted"
        + (f"; one unpaged read {one_request}" if not archive else ""),
        flush=True,
    )
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--baseline-sizes", default="10000,100000")
    ap.add_argument("--burst", type=int, default=1024, help="executions per burst (groups of 4)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scheduler_takeover.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    base = [int(x) for x in args.baseline_sizes.split(",") if x]
    results: dict[str, object] = {
        "machine": platform.platform(),
        "burst_executions": args.burst,
        "live_bursts": LIVE_BURSTS,
        "archived": [],
        "baseline_kept": [],
    }
    for n in base:
        results["baseline_kept"].append(await _one(n, args.burst, archive=False))  # type: ignore[union-attr]
    for n in sizes:
        results["archived"].append(await _one(n, args.burst, archive=True))  # type: ignore[union-attr]
    ratios = {}
    for b in results["baseline_kept"]:  # type: ignore[union-attr]
        a = next((x for x in results["archived"] if x["executions_closed"] == b["executions_closed"]), None)  # type: ignore[union-attr]
        if a:
            ratios[str(b["executions_closed"])] = {
                "takeover_ratio_archived_vs_kept": round(a["takeover_s"] / b["takeover_s"], 4),
                "db_ratio_archived_vs_kept": round(
                    a["etcd_db_bytes_compacted"] / b["etcd_db_bytes_compacted"], 4
                ),
            }
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(
            f"{int(k):>9,} closed: takeover archived/kept {v['takeover_ratio_archived_vs_kept']:.3f}, "
            f"etcd (compacted) archived/kept {v['db_ratio_archived_vs_kept']:.3f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
