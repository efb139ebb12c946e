"""Packer benchmark: claims per second and packing throughput (tokens/s) with 16 concurrent
claimers, in process and over real gRPC against a packer process.

Run: ``PYTHONPATH=. .venv/bin/python bench/packer_claims.py [--groups 64] [--claimers 16]``.
Writes ``bench/results/packer_claims.json``. Every figure comes with a baseline measured in
the same run on the same machine, and the ratio between them:

- packing (in process): turns + finish reports in, one at a time, packed micro-steps out,
  with the real fsync'd WAL, and without fsync, against the same work with no log at all
  (the ratios are the cost of durability: encoding, then fsync);
- claims (in process): claim + ack pairs/s by 16 asyncio claimers on the real WAL, over
  ``--rounds`` batches;
- claims (gRPC): claim + ack pairs/s by 16 claimers, one channel each, to a packer process
  (ClaimMicroSteps of ``--claim-batch`` micro-steps and one AckMicroSteps per claim, and the
  trainer's own client with its default ``claim_batch``), against plain GetBatch calls/s
  from the same 16 callers (the ratio is what a claim costs beyond a round trip); the
  packer process's and the claimers' CPU per pair; with ``--old-path`` (default) the
  batched mode also on the old claim path (a second packer process, ``pre_encode`` off),
  alternating with the default one round by round;
- ingest (gRPC): RecordTurn + ReportFinish tokens/s from 8 concurrent senders.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from apps.procs import ServiceProcess  # noqa: E402
from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.execution import ExecutionStatus  # noqa: E402
from gyre.identity import Role  # noqa: E402
from gyre.v1 import packer_pb2, packer_pb2_grpc  # noqa: E402
from services.cell_agent.training.config import TrainingSettings  # noqa: E402
from services.cell_agent.training.microstep import Outcome  # noqa: E402
from services.cell_agent.training.packer_client import PackerSource  # noqa: E402
from services.packer.config import PackerConfig  # noqa: E402
from services.packer.model import ClaimOutcome, Finish, Turn  # noqa: E402
from services.packer.packer import Packer  # noqa: E402
from services.packer.wal import EventLog, Wal  # noqa: E402
from testkit.pki import BenchPki  # noqa: E402


def workload(
    groups: int, group_size: int, turns: int, seed: int = 0, prefix: str = "g"
) -> list[tuple[list[Turn], list[Finish]]]:
    """Groups of executions with turns of 100..700 tokens (prompt 60..400, output 40..300)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        gid = f"{prefix}{g}"
        ts, fs = [], []
        for k in range(group_size):
            x = f"{gid}-x{k}"
            for i in range(turns):
                n_p, n_o = rng.randint(60, 400), rng.randint(40, 300)
                ts.append(
                    Turn.validated(
                        x,
                        gid,
                        i,
                        [rng.randrange(50_000) for _ in range(n_p)],
                        [rng.randrange(50_000) for _ in range(n_o)],
                        [-rng.random() for _ in range(n_o)],
                        [0] * n_o,
                        [],
                        1 << 20,
                    )
                )
            fs.append(Finish.validated(x, gid, group_size, ExecutionStatus.COMPLETED, float(k), 0, 1 << 16))
        out.append((ts, fs))
    return out


def _turn_record(t: Turn) -> packer_pb2.TurnRecord:
    """``t`` as the senders send it: no loss mask, temperature, key or chat state (the
    packer's defaults), so the bytes on the wire are only the turn's tokens."""
    return packer_pb2.TurnRecord(
        execution_id=t.execution_id,
        group_id=t.group_id,
        turn_index=t.turn_index,
        prompt_token_ids=t.prompt,
        output_token_ids=t.output,
        output_logprobs=t.logprobs,
        output_policy_versions=t.versions,
    )


class NullLog:
    """Logs nothing: the domain's own cost."""

    def append(self, event: dict[str, Any]) -> None:
        return None

    async def sync(self) -> None:
        return None


def _config(args: argparse.Namespace, **extra: Any) -> PackerConfig:
    return PackerConfig(
        batch_size=args.groups,
        micro_step_token_budget=args.budget,
        policy_from_etcd=False,
        ready_grace_s=0.0,
        emit_fill_fraction=0.75,
        **extra,
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
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "turns_per_s": sum(len(ts) for ts, _ in data) / elapsed,
        "micro_steps": status["micro_steps"],
        "mean_fill": tokens / (status["micro_steps"] * args.budget),
    }


async def bench_claims_in_process(args: argparse.Namespace, wal_dir: str) -> dict[str, Any]:
    """``rounds`` batches: each is fed whole (untimed), then drained by the claimers (timed)."""
    wal = Wal(wal_dir, fsync=True)
    wal.open()
    cfg = _config(args)
    packer = Packer(cfg, wal, strict=cfg.check_every_change)  # as the service runs it
    packer.recover([])
    claimed: list[str] = []
    elapsed = 0.0
    for rnd in range(args.rounds):
        batch = rnd + 1
        for ts, fs in workload(args.groups, args.group_size, args.turns, seed=rnd, prefix=f"r{rnd}g"):
            for t in ts:
                await packer.record_turn(t)
            for f in fs:
                await packer.report_finish(f)

        async def claimer(i: int, batch: int = batch) -> None:
            cell = f"cell{i}"
            while True:
                r = await packer.claim(cell, batch, 0, 0.05)
                if r.outcome is ClaimOutcome.CLOSED:
                    return
                if r.outcome is ClaimOutcome.CLAIMED:
                    claimed.append(r.micro_step.micro_step_id)
                    await packer.ack(cell, batch, r.micro_step.micro_step_id)

        start = time.perf_counter()
        await asyncio.gather(*(claimer(i) for i in range(args.claimers)))
        elapsed += time.perf_counter() - start
        assert packer.batch_status(batch)["done"]
    assert len(claimed) == len(set(claimed))
    await wal.close()
    return {
        "claims": len(claimed),
        "seconds": elapsed,
        "claims_per_s": len(claimed) / elapsed,
        "wal_flushes": wal.flushes,
        "rounds": args.rounds,
    }


async def _claimer(
    stub: Any, cell: str, batch: int, claim_n: int, claimed: list[str], calls: list[int]
) -> None:
    """Claims and acks until CLOSED: ClaimMicroSteps of up to ``claim_n`` and one
    AckMicroSteps of what it claimed. ``calls[0]`` counts the RPCs."""
    while True:
        r = await stub.ClaimMicroSteps(
            packer_pb2.ClaimMicroStepsRequest(
                cell_id=cell, batch_id=batch, wait_s=0.05, max_micro_steps=claim_n
            ),
            timeout=10,
        )
        ids = [m.micro_step_id for m in r.micro_steps]
        calls[0] += 1
        if r.outcome == packer_pb2.CLAIM_OUTCOME_CLOSED:
            return
        claimed.extend(ids)
        if ids:
            await stub.AckMicroSteps(
                packer_pb2.AckMicroStepsRequest(cell_id=cell, batch_id=batch, micro_step_ids=ids), timeout=10
            )
            calls[0] += 1


async def _source_claimer(
    source: PackerSource, batch: int, claim_n: int, claimed: list[str], calls: list[int]
) -> None:
    """The training controller's path: ``PackerSource.claim_many`` of ``claim_n`` (the
    trainer's ``claim_batch``) and one ``ack_many`` per claimed group, until CLOSED."""
    while True:
        claims = await source.claim_many(batch, 0, 0.05, claim_n, uuid.uuid4().hex)
        calls[0] += 1
        if claims[0].outcome is Outcome.CLOSED:
            return
        ids = [c.micro_step.micro_step_id for c in claims if c.micro_step is not None]
        claimed.extend(ids)
        if ids:
            await source.ack_many(batch, ids)
            calls[0] += 1


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Target:
    """One packer process and the channels to it: 4 routers, 4 schedulers and one cell per
    claimer (each caller presents its role; a cell claims only for itself)."""

    def __init__(self, args: argparse.Namespace, workdir: Path, etcd: EtcdServer, pki: Any, pre_encode: bool):
        import yaml

        self.pre_encode = pre_encode
        name = "grpc-pre" if pre_encode else "grpc-old"
        cfg_path = workdir / f"{name}.yaml"
        cfg_path.write_text(
            yaml.safe_dump(
                {
                    "cluster": {
                        "name": f"bench-{name}",
                        "etcd_endpoints": [etcd.endpoint],
                        "tls": {"dir": pki.tls_dir},
                    },
                    "packer": {
                        "wal_dir": str(workdir / f"wal-{name}"),
                        "batch_size": args.groups,
                        "micro_step_token_budget": args.budget,
                        "ready_grace_s": 0.0,
                        "log_level": "WARNING",
                        "pre_encode": pre_encode,
                    },
                }
            )
        )
        self.proc = ServiceProcess("packer", cfg_path, log_path=workdir / f"{name}.log", name=name).start()
        target = self.proc.target
        routers = [pki.channel(target, "router", Role.ROUTER, Role.PACKER) for _ in range(4)]
        schedulers = [pki.channel(target, "scheduler", Role.SCHEDULER, Role.PACKER) for _ in range(4)]
        cells = [pki.channel(target, f"cell{i}", Role.CELL_AGENT, Role.PACKER) for i in range(args.claimers)]
        self.channels = routers + schedulers + cells
        self.turn_stubs = [packer_pb2_grpc.PackerStub(c) for c in routers]
        self.finish_stubs = [packer_pb2_grpc.PackerStub(c) for c in schedulers]
        self.stubs = [packer_pb2_grpc.PackerStub(c) for c in cells]
        self.sources = [PackerSource("", f"cell{i}", channel=c) for i, c in enumerate(cells)]
        self.batch = 0
        self.base_per_s = 0.0
        self.ingest_s = self.ingest_cpu = 0.0
        self.claimed: list[str] = []
        self.micro_steps = self.total_tokens = 0
        self.modes: dict[str, dict[str, Any]] = {}

    def cpu(self) -> float:
        return _cpu_s(self.proc.pid)

    async def baseline(self, args: argparse.Namespace) -> dict[str, float]:
        """Plain GetBatch round trips from the same number of callers."""
        n = 0
        stop = time.perf_counter() + args.baseline_s

        async def pinger(i: int) -> None:
            nonlocal n
            while time.perf_counter() < stop:
                await self.stubs[i].GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=10)
                n += 1

        start, cpu0 = time.perf_counter(), self.cpu()
        await asyncio.gather(*(pinger(i) for i in range(args.claimers)))
        elapsed, cpu = time.perf_counter() - start, self.cpu() - cpu0
        self.base_per_s = n / elapsed
        return {"baseline_getbatch_per_s": n / elapsed, "baseline_packer_cpu_us_per_call": 1e6 * cpu / n}

    async def ingest(self, args: argparse.Namespace) -> None:
        """One batch of the workload in, from 8 concurrent senders."""
        self.batch += 1
        queue = workload(args.groups, args.group_size, args.turns, seed=self.batch, prefix=f"r{self.batch}g")

        async def sender(i: int) -> None:
            while queue:
                ts, fs = queue.pop()
                for t in ts:
                    await self.turn_stubs[i % 4].RecordTurn(_turn_record(t), timeout=10)
                for f in fs:
                    await self.finish_stubs[i % 4].ReportFinish(f.to_proto(), timeout=10)

        start, cpu0 = time.perf_counter(), self.cpu()
        await asyncio.gather(*(sender(i) for i in range(8)))
        self.ingest_s += time.perf_counter() - start
        self.ingest_cpu += self.cpu() - cpu0

    async def drain(self, args: argparse.Namespace, name: str, claim_n: int, trainer: bool = False) -> None:
        """The claimers drain the batch just ingested (timed): one round of mode ``name``
        (``trainer``: through the trainer's client, ``PackerSource``, else raw stubs)."""
        m = self.modes.setdefault(
            name,
            {"claim_micro_steps_per_call": claim_n, "trainer_client": trainer, "claims": 0, "seconds": 0.0}
            | {"rpcs": 0, "packer_cpu_s": 0.0, "claimers_cpu_s": 0.0},
        )
        got: list[str] = []
        calls = [0]
        if trainer:
            runs = [
                _source_claimer(self.sources[i], self.batch, claim_n, got, calls)
                for i in range(args.claimers)
            ]
        else:
            runs = [
                _claimer(self.stubs[i], f"cell{i}", self.batch, claim_n, got, calls)
                for i in range(args.claimers)
            ]
        cpu0, own0, start = self.cpu(), time.process_time(), time.perf_counter()
        await asyncio.gather(*runs)
        m["seconds"] += time.perf_counter() - start
        m["packer_cpu_s"] += self.cpu() - cpu0
        m["claimers_cpu_s"] += time.process_time() - own0
        status = await self.stubs[0].GetBatch(packer_pb2.GetBatchRequest(batch_id=self.batch), timeout=10)
        assert status.done, status
        self.micro_steps += status.micro_steps
        self.total_tokens += status.total_tokens
        m["claims"] += len(got)
        m["rpcs"] += calls[0]
        self.claimed += got

    def results(self, args: argparse.Namespace, tokens_per_batch: int) -> dict[str, Any]:
        assert len(self.claimed) == len(set(self.claimed)) == self.micro_steps
        modes = {}
        for name, m in self.modes.items():
            rate = m["claims"] / m["seconds"]
            modes[name] = {
                **{k: v for k, v in m.items() if not k.endswith("_cpu_s")},
                "claims_per_s": rate,
                "rpcs_per_pair": m["rpcs"] / m["claims"],
                "claim_vs_roundtrip": rate / self.base_per_s,
                # CPU per claim + ack pair: the packer process's, and this process's (the
                # claimers, all 16 in one process); clock ticks of 10 ms, over the whole mode.
                "packer_cpu_us_per_pair": 1e6 * m["packer_cpu_s"] / m["claims"],
                "claimers_cpu_us_per_pair": 1e6 * m["claimers_cpu_s"] / m["claims"],
            }
        return {
            "pre_encode": self.pre_encode,
            "modes": modes,
            "ingest_tokens_per_s": tokens_per_batch * self.batch / self.ingest_s,
            "ingest_seconds": self.ingest_s,
            "ingest_packer_cpu_us_per_1k_tokens": 1e9 * self.ingest_cpu / (tokens_per_batch * self.batch),
            "micro_steps": self.micro_steps,
            "total_loss_tokens": self.total_tokens,
            "rounds": args.rounds,
        }

    async def close(self) -> None:
        for c in self.channels:
            await c.close()
        self.proc.stop()


async def bench_grpc(args: argparse.Namespace, data: list, workdir: str) -> dict[str, Any]:
    """The gRPC figures against a packer process of its own (as in a cluster, the claimers
    are other processes; here all 16 share this one). With ``--old-path`` a second packer
    process runs the old claim path (``pre_encode`` off: protos built per claim), and the
    batched mode alternates between the two, round by round, so both see the same load."""
    etcd = EtcdServer()
    etcd.start()
    pki = BenchPki(Path(workdir) / "certs")  # mTLS on every call, as Gyre runs by default
    targets: list[_Target] = []
    try:
        new = _Target(args, Path(workdir), etcd, pki, pre_encode=True)
        targets.append(new)
        old = _Target(args, Path(workdir), etcd, pki, pre_encode=False) if args.old_path else None
        if old is not None:
            targets.append(old)
        base = await new.baseline(args)
        old_base = await old.baseline(args) if old is not None else {}
        tokens = sum(t.tokens for ts, _ in data for t in ts)  # the same per round (same sizes)
        trainer_n = TrainingSettings().claim_batch
        batched = f"claim_{args.claim_batch}_ack_batched"
        trainer_mode = f"trainer_client_claim_{trainer_n}"
        modes: dict[str, tuple[int, bool]] = {
            batched: (args.claim_batch, False),
            trainer_mode: (trainer_n, True),  # PackerSource, as the trainer
        }
        for name, (claim_n, trainer) in modes.items():
            for rnd in range(args.rounds):
                both = [new, old] if old is not None and name == batched else [new]
                for t in both if rnd % 2 == 0 else both[::-1]:
                    await t.ingest(args)
                    await t.drain(args, name, claim_n, trainer)
        out = new.results(args, tokens) | base
        batched_row, trainer_row = out["modes"][batched], out["modes"][trainer_mode]
        out |= {
            "batched_claims_per_s": batched_row["claims_per_s"],
            "batched_vs_roundtrip": batched_row["claim_vs_roundtrip"],
            "trainer_claim_batch": trainer_n,
            "trainer_claims_per_s": trainer_row["claims_per_s"],
            "trainer_vs_roundtrip": trainer_row["claim_vs_roundtrip"],
        }
        if old is not None:
            out["old_path"] = old.results(args, tokens) | old_base
        return out
    finally:
        for t in targets:
            await t.close()
        etcd.cleanup()


MODE = re.compile(r"claim_\d+_ack_batched|trainer_client_claim_\d+")
"""The modes this benchmark runs. Saved runs also hold rows of modes it ran before their
protocols were retired (issue 35): one micro-step per call (``one_by_one``), acks one by
one (``claim_N_ack_each``) and the claim stream (``stream_*``)."""


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The output contract other tools read: claim + ack pairs/s over gRPC with the run's claimers
    (``claim_ack_per_s_16`` when there are 16 of them, as by default) in the best mode of the
    run (``best_mode`` names it), and its baseline; ``batched_unary_per_s`` is the batched mode
    (ClaimMicroSteps of ``claim_batch`` + one AckMicroSteps), ``trainer_client_per_s`` the
    trainer's own client (``PackerSource.claim_many`` / ``ack_many`` with the trainer's
    default ``claim_batch``); with ``--old-path``, the batched mode on the old claim path.
    Rows of retired modes in a saved run are left out."""
    grpc_ = result["grpc"]
    rates = {k: m["claims_per_s"] for k, m in grpc_["modes"].items() if MODE.fullmatch(k)}
    best_mode = max(rates, key=lambda k: rates[k])
    best = rates[best_mode]
    batched = grpc_["batched_claims_per_s"]
    old: dict[str, Any] = {}
    if grpc_.get("old_path"):  # the batched mode on the old claim path, alternating with the new
        o = grpc_["old_path"]
        mode = next(iter(o["modes"].values()))
        new_mode = grpc_["modes"][f"claim_{result['params']['claim_batch']}_ack_batched"]
        old = {
            "old_path_per_s": round(mode["claims_per_s"], 1),
            "old_path_baseline_roundtrip_per_s": round(o["baseline_getbatch_per_s"], 1),
            "pre_encode_gain": round(batched / mode["claims_per_s"], 2),
            "packer_cpu_us_per_pair": round(new_mode["packer_cpu_us_per_pair"]),
            "old_path_packer_cpu_us_per_pair": round(mode["packer_cpu_us_per_pair"]),
        }
    return {
        "claim_ack_per_s_16": round(best, 1) if result["params"]["claimers"] == 16 else None,
        "best_mode": best_mode,
        "claimers": result["params"]["claimers"],
        "baseline_roundtrip_per_s": round(grpc_["baseline_getbatch_per_s"], 1),
        "ratio_vs_roundtrip": round(best / grpc_["baseline_getbatch_per_s"], 3),
        "batched_unary_per_s": round(batched, 1),
        "trainer_client_per_s": round(grpc_["trainer_claims_per_s"], 1),
        **old,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=48, help="groups per batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--budget", type=int, default=1024, help="micro-step token budget")
    ap.add_argument("--claimers", type=int, default=16)
    ap.add_argument("--baseline-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=4, help="batches drained per claim mode")
    ap.add_argument("--claim-batch", type=int, default=8, help="micro-steps per ClaimMicroSteps call")
    ap.add_argument(
        "--old-path",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the batched mode on the old claim path (packer pre_encode off)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "packer_claims.json"))
    args = ap.parse_args()
    data = workload(args.groups, args.group_size, args.turns)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-packer-") as tmp:
        null = await bench_packing(args, data, NullLog())
        packing = {}
        for fsync in (False, True):
            wal = Wal(os.path.join(tmp, f"wal-pack-{fsync}"), fsync=fsync)
            wal.open()
            packing[fsync] = await bench_packing(args, data, wal)
            await wal.close()
        durable = packing[True]
        claims = await bench_claims_in_process(args, os.path.join(tmp, "wal-claims"))
        over_grpc = await bench_grpc(args, data, tmp)
    result = {
        "benchmark": "packer_claims",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "params": vars(args) | {"out": None},
        "packing_in_process": {
            "wal_fsync": durable,
            "wal_no_fsync": packing[False],
            "null_log_baseline": null,
            "ratio_fsync_vs_baseline": durable["tokens_per_s"] / null["tokens_per_s"],
            "ratio_no_fsync_vs_baseline": packing[False]["tokens_per_s"] / null["tokens_per_s"],
        },
        "claims_in_process": claims,
        "grpc": over_grpc,
    }
    result["summary"] = summarize(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "packing_tokens_per_s (fsync WAL)": round(durable["tokens_per_s"]),
                "packing_tokens_per_s (WAL, no fsync)": round(packing[False]["tokens_per_s"]),
                "packing_tokens_per_s (no log: baseline)": round(null["tokens_per_s"]),
                "claims_per_s in process (16 claimers)": round(claims["claims_per_s"]),
                "claims_per_s gRPC, batched (16 claimers)": round(over_grpc["batched_claims_per_s"]),
                **{f"claims_per_s gRPC {k}": round(v["claims_per_s"]) for k, v in over_grpc["modes"].items()},
                "GetBatch/s gRPC baseline (16 callers)": round(over_grpc["baseline_getbatch_per_s"]),
                "ingest tokens/s gRPC (8 senders)": round(over_grpc["ingest_tokens_per_s"]),
                "summary": result["summary"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
