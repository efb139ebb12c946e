"""What the scheduler's ledger costs on a real etcd: execution lifecycles per second.

One lifecycle = AcquireExecution's launch (a fenced txn creating the execution record and
its route) + FinishExecution's close (a fenced txn rewriting the record and deleting the
route), run through the real Scheduler object (ledger, placement, locks) on a private etcd,
in process (no gRPC), with C concurrent harnesses (C = 1, 32 and 64).

Baseline, measured in the same run against the same etcd: the same two transactions issued
directly (create-guarded put of record + route, then mod-guarded put + delete), without the
leader fence and without any scheduler logic. ratio = scheduler / baseline.

Also: the waterlevel policy's decide() on a 64-cell snapshot (microseconds per call).

    PYTHONPATH=. .venv/bin/python bench/scheduler_ledger.py [--executions 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre import config as config_mod  # noqa: E402
from gyre.etcd import Etcd, Keys, LeaderElection, LeaseKeeper, Op  # noqa: E402
from gyre.etcd.client import create_revision_is, mod_revision_is  # noqa: E402
from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.etcd.values import CellRecord  # noqa: E402
from gyre.execution import ExecutionStatus  # noqa: E402
from services.scheduler.config import SchedulerConfig  # noqa: E402
from services.scheduler.policy import (  # noqa: E402
    BurstView,
    CellKind,
    CellState,
    CellView,
    LedgerCounts,
    Snapshot,
    SupplyTracker,
    WaterlevelPolicy,
)
from services.scheduler.scheduler import Scheduler  # noqa: E402
from services.scheduler.store import SchedulerStore  # noqa: E402
from services.scheduler.tasks import GeneratedTasks  # noqa: E402
from testkit.recording_peers import RecordingPeers  # noqa: E402


class _KV:
    def __init__(self, key: bytes, value: bytes) -> None:
        self.key, self.value = key, value


async def _scheduler_run(etcd: Etcd, cluster: str, n: int, conc: int) -> tuple[float, int, float]:
    """Lifecycles/s through the real Scheduler, the launch + close transactions it sent
    (group commit: fewer than 2 per lifecycle when writes were in flight together), and this
    process's CPU per lifecycle in µs (the scheduler's code and the in-process harnesses'
    loop; etcd runs in its own process)."""
    keys = Keys(cluster)
    lease = LeaseKeeper(etcd, 10)
    await lease.grant()
    keeper = asyncio.create_task(lease.run())
    election = LeaderElection(etcd, keys.leader(), "bench", lease)
    epoch = await election.campaign()
    cfg = config_mod.load(
        SchedulerConfig,
        None,
        cluster_name=cluster,
        policy="rollout_only",
        batch_size=n // 2,
        group_size=2,
        over_provision=0.0,
        max_bursts=1,
    )
    store = SchedulerStore(etcd, keys, election)
    s = Scheduler(config=cfg, store=store, peers=RecordingPeers(), tasks=GeneratedTasks())
    cell = CellRecord("sa", CellKind.STANDALONE, -1, n, "sa:1")
    s.on_cells({b"c": _KV(b"c", cell.to_json())})
    s.on_cell_states({b"s/sa": _KV(b"s/sa", b'{"state": "ROLLOUT"}')})
    await s.take_over(int(epoch))
    await s.reconcile_once()
    done = 0

    async def harness(i: int) -> None:
        nonlocal done
        while True:  # each harness is a principal of its own (the gate rates each one)
            got, _, _ = await s.acquire(f"bench{i}", 0)
            if got is None:
                return
            await s.finish(got.record.execution_id, got.token, ExecutionStatus.COMPLETED, 1.0, "k")
            done += 1

    txns = store.group.transactions
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(harness(i) for i in range(conc)))
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    txns = store.group.transactions - txns
    assert done == n and s.ledger.counts().finished == n, (done, s.ledger.counts())
    keeper.cancel()
    await asyncio.gather(keeper, return_exceptions=True)
    await lease.revoke()
    return n / elapsed, txns, cpu / n * 1e6


async def _baseline_run(etcd: Etcd, cluster: str, n: int, conc: int) -> float:
    keys = Keys(cluster)
    queue = list(range(n))

    async def harness() -> None:
        while queue:
            i = queue.pop()
            rec, route = keys.execution(1, f"e{i}"), keys.route(f"e{i}")
            ok, rev = await etcd.txn(
                [create_revision_is(rec, 0)], [Op(rec, b'{"state":"RUNNING"}'), Op(route, b"{}")]
            )
            assert ok
            ok, _ = await etcd.txn(
                [mod_revision_is(rec, rev)], [Op(rec, b'{"state":"COMPLETED"}'), Op(route, None)]
            )
            assert ok

    start = time.perf_counter()
    await asyncio.gather(*(harness() for _ in range(conc)))
    return n / (time.perf_counter() - start)


def _decide_us(cells: int = 64, calls: int = 2000) -> float:
    views = tuple(
        CellView(f"cell-{i}", CellKind.ELASTIC, i, CellState.TRAINING if i < 8 else CellState.ROLLOUT, 8)
        for i in range(cells)
    )
    supply = SupplyTracker(0.5).observe(0.0, 40, 64, 64, 1)
    snap = Snapshot(
        10.0, LedgerCounts(4096, 3800, 3700), views, supply, BurstView(3, 4096, 2, 3), 2, 4096, None
    )
    policy = WaterlevelPolicy()
    start = time.perf_counter()
    for _ in range(calls):
        policy.decide(snap)
    return (time.perf_counter() - start) / calls * 1e6


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The output contract other tools read: execution closes/s with 64 harnesses (every
    lifecycle ends in exactly one fenced close, so closes/s = lifecycles/s) and its baseline."""
    c64 = results["concurrency"].get("64")
    return {
        "closes_per_s_64": c64["scheduler_lifecycles_per_s"] if c64 else None,
        "baseline_txn_lifecycles_per_s_64": c64["baseline_lifecycles_per_s"] if c64 else None,
        "ratio_64": c64["ratio"] if c64 else None,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=600, help="lifecycles with one harness")
    ap.add_argument(
        "--executions-concurrent",
        type=int,
        default=4000,
        help="lifecycles with 32 and 64 harnesses (at ~2,500/s, 600 took a quarter second: noise)",
    )
    args = ap.parse_args()
    results: dict[str, Any] = {
        "executions": args.executions,
        "executions_concurrent": args.executions_concurrent,
        "machine": platform.platform(),
        "concurrency": {},
    }
    with EtcdServer() as server:
        etcd = Etcd([server.endpoint], timeout_s=10.0)
        await etcd.connect()
        for conc in (1, 32, 64):
            n = args.executions if conc == 1 else args.executions_concurrent
            base = await _baseline_run(etcd, f"base{conc}", n, conc)
            sched, txns, cpu_us = await _scheduler_run(etcd, f"sched{conc}", n, conc)
            results["concurrency"][str(conc)] = {
                "executions": n,
                "scheduler_lifecycles_per_s": round(sched, 1),
                "baseline_lifecycles_per_s": round(base, 1),
                "ratio": round(sched / base, 3),
                "ledger_txns_per_lifecycle": round(txns / n, 3),
                "process_cpu_us_per_lifecycle": round(cpu_us, 1),
            }
            print(
                f"C={conc:3d}: scheduler {sched:8.1f}/s  raw etcd txns {base:8.1f}/s  ratio {sched / base:.2f}  "
                f"txns/lifecycle {txns / n:.2f}  process CPU {cpu_us:.0f} us/lifecycle"
            )
        await etcd.close()
    us = _decide_us()
    results["waterlevel_decide_us_64_cells"] = round(us, 1)
    results["summary"] = summarize(results)
    print(f"waterlevel decide() on 64 cells: {us:.1f} us")
    out = ROOT / "bench" / "results" / "scheduler_ledger.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
