"""How fast a SIGKILLed cell's live executions are rerouted: from the kill to the first token
at the destination, as the harness sees it (its gRPC stream through the router never breaks).

Real scheduler, router and cell agents (mock engines, 10 ms per token) as processes on a
private etcd, mutual TLS on every hop, the default lease TTL (10 s). Each trial acquires an
execution, streams 300 tokens through the router, SIGKILLs the serving cell agent after 40
tokens, reads the stream to its end and records the gap from the kill to the next token; a
fresh cell agent then replaces the dead one. The router reports the engine failure to the
scheduler, which probes the cell and reroutes its executions at once. The baseline, measured
in the same run, is the same trial with the reports off: the executions move only when the
cell's lease lapses (TTL + the orphan grace).

    PYTHONPATH=. .venv/bin/python bench/engine_reroute.py [--trials 30] [--baseline-trials 3]

Saves ``bench/results/engine_reroute.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.etcd.server import EtcdServer
from testkit.reroute_rig import RerouteRig, Trial


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


async def run(tmp: Path, report: bool, trials: int) -> list[Trial]:
    etcd = EtcdServer()
    etcd.start()
    rig = RerouteRig(tmp, etcd.endpoint, tmp / "pki", f"reroute{int(report)}", report=report)
    try:
        await rig.start(cells=2)
        out = []
        for i in range(trials):
            trial = await rig.trial(max_tokens=300, kill_after=40)
            print(
                f"{'reported' if report else 'lease-only'} trial {i + 1}/{trials}: gap {trial.gap_s:.3f} s, "
                f"{trial.tokens} tokens, {trial.source} -> {trial.destination}"
                + (f", error {trial.error}" if trial.error else ""),
                flush=True,
            )
            out.append(trial)
        return out
    finally:
        await rig.stop()
        etcd.cleanup()


def summary(trials: list[Trial]) -> dict[str, object]:
    gaps = [t.gap_s for t in trials if not t.error]
    return {
        "trials": len(trials),
        "errors": sum(1 for t in trials if t.error),
        "incomplete": sum(1 for t in trials if t.tokens != 300),
        "gap_s": {
            "p50": percentile(gaps, 50),
            "p99": percentile(gaps, 99),
            "max": max(gaps),
            "min": min(gaps),
        }
        if gaps
        else {},
        "samples_s": [round(g, 4) for g in gaps],
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--baseline-trials", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_reroute.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-reroute-") as d:
        t0 = time.monotonic()
        reported = await run(Path(d) / "reported", True, args.trials)
        baseline = await run(Path(d) / "baseline", False, args.baseline_trials)
        wall = time.monotonic() - t0
    result = {
        "what": "SIGKILL of the cell agent serving a live 300-token stream (after 40 tokens): seconds from "
        "the kill to the first token at the destination, as the harness receives it",
        "setup": "scheduler, router, 2 cell agents (mock engine, 10 ms/token) as processes, private etcd, "
        "mutual TLS, lease TTL 10 s, orphan grace 3 s; a fresh cell replaces each killed one",
        "reported": summary(reported),
        "baseline_lease_only": summary(baseline),
        "trials_detail": [dataclasses.asdict(t) for t in reported],
        "wall_s": round(wall, 1),
        "host": {"python": platform.python_version(), "machine": platform.machine()},
    }
    rep, base = result["reported"], result["baseline_lease_only"]
    if rep.get("gap_s") and base.get("gap_s"):
        result["speedup_p50"] = round(base["gap_s"]["p50"] / rep["gap_s"]["p50"], 1)  # type: ignore[index]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("trials_detail",)}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
