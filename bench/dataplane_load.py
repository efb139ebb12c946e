"""The whole data plane under load: many concurrent agent executions through several routers
to mock-engine cell agents, every completed turn recorded at the packer.

Processes, as in production and with mutual TLS on every gRPC hop: a private etcd, a packer
(fsync'd WAL), ``--routers`` routers, ``--cells`` standalone cell agents (mock engine: one
decode step of ``--step-ms`` for all its running requests, one chunk per request per step),
and this client playing the harnesses and the scheduler (it writes each execution's route
in etcd, as the scheduler does, and reports each finished execution to the packer).

Each of ``--executions`` executions (all concurrent) makes ``--turns`` calls of
``--max-tokens`` tokens, each call's prompt continuing the last (prompt + output + a few new
tokens, as an agent's next turn); even executions stream (SSE), odd ones do not. Execution
``i`` uses router ``i % routers`` and cell ``i % cells``. Two phases in the same run:

- *direct* (the baseline): the same calls straight to the cell agents' ``Engine.Generate``
  (no router, nothing recorded);
- *routed*: through the routers' OpenAI API, turns recorded at the packer, finishes reported;
- *routed, one stream*: another set of as many executions, every call answered once over
  ``Router.GenerateStream``, one stream per router shared by the executions that use it (a
  harness process's calls multiplexed, ``gyre.client.router_stream``), turns recorded,
  finishes reported.

Reported: throughput (tokens/s), p50/p99 call completion and first-token time of each phase
and what the routers added (streamed and non-streamed calls apart), CPU time per relayed
token of each service, and that nothing was lost (every call complete, the packer holds
exactly one record per turn).

    PYTHONPATH=. .venv/bin/python bench/dataplane_load.py [--executions 1024] [--quick]

Writes bench/results/dataplane_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apps.procs import ServiceProcess
from gyre.client.router_stream import RouterStream
from gyre.etcd import Etcd, Keys
from gyre.etcd.server import EtcdServer
from gyre.identity import Role
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, common_pb2, packer_pb2, packer_pb2_grpc, router_pb2
from testkit.pki import BenchPki
from testkit.router_rig import build_tokenizer_dir, put_route, start_router

GROUP_SIZE = 8
PROMPT_TOKENS = 32
NEXT_TOKENS = 8  # new tokens each following turn adds (a tool result, a user message)


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children."""
    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
    except psutil.NoSuchProcess:
        pass
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def dist(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(xs, 0.5) * 1e3,
        "p99_ms": pct(xs, 0.99) * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3 if xs else 0.0,
    }


class Calls:
    """Per-call samples of one phase: (streamed, first-token s, completion s, tokens)."""

    def __init__(self) -> None:
        self.rows: list[tuple[bool, float, float, int]] = []
        self.errors: list[str] = []

    def add(self, stream: bool, ttft: float, total: float, tokens: int) -> None:
        self.rows.append((stream, ttft, total, tokens))

    def stats(self, stream: bool) -> dict[str, Any]:
        rows = [r for r in self.rows if r[0] == stream]
        return {"calls": len(rows), "ttft": dist([r[1] for r in rows]), "call": dist([r[2] for r in rows])}

    @property
    def tokens(self) -> int:
        return sum(r[3] for r in self.rows)


def prompt_of(i: int) -> list[int]:
    return [10 + (i * 7 + k) % 400 for k in range(PROMPT_TOKENS)]


async def direct_execution(i: int, ctx: dict[str, Any], calls: Calls) -> None:
    stub = ctx["engine_stubs"][i % len(ctx["engine_stubs"])]
    ex = ctx["execs"][i][0]
    prompt = prompt_of(i)
    for turn in range(ctx["turns"]):
        start = time.perf_counter()
        ttft, out = 0.0, list[int]()
        try:
            call = stub.Generate(
                cell_agent_pb2.EngineGenerateRequest(
                    request_id=f"d-{i}-{turn}",
                    execution_id=ex,
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(max_tokens=ctx["max_tokens"]),
                ),
                timeout=600,
            )
            async for chunk in call:
                if not out and chunk.token_ids:
                    ttft = time.perf_counter() - start
                out.extend(chunk.token_ids)
        except Exception as exc:  # noqa: BLE001 (counted, reported)
            calls.errors.append(f"direct {ex} turn {turn}: {exc!r}"[:300])
            return
        calls.add(i % 2 == 0, ttft, time.perf_counter() - start, len(out))
        prompt = prompt + out + [5 + turn] * NEXT_TOKENS


async def routed_execution(i: int, ctx: dict[str, Any], calls: Calls) -> None:
    url = ctx["urls"][i % len(ctx["urls"])]
    ex, tok = ctx["execs"][i]
    stream = i % 2 == 0
    prompt = prompt_of(i)
    session: aiohttp.ClientSession = ctx["session"]
    for turn in range(ctx["turns"]):
        body = {"prompt": prompt, "max_tokens": ctx["max_tokens"], "stream": stream, "return_token_ids": True}
        start = time.perf_counter()
        ttft, out = 0.0, list[int]()
        try:
            async with session.post(
                f"{url}/completions", json=body, headers={"Authorization": f"Bearer {tok}"}
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                if stream:
                    async for raw in r.content:
                        if not raw.startswith(b"data: {"):
                            continue
                        event = json.loads(raw[6:])
                        if "error" in event:
                            raise RuntimeError(str(event["error"]))
                        ids = event["choices"][0].get("token_ids", [])
                        if ids and not out:
                            ttft = time.perf_counter() - start
                        out.extend(ids)
                else:
                    data = await r.json()
                    out = list(data["choices"][0]["token_ids"])
                    ttft = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 (counted, reported)
            calls.errors.append(f"routed {ex} turn {turn}: {exc!r}"[:300])
            return
        calls.add(stream, ttft, time.perf_counter() - start, len(out))
        prompt = prompt + out + [5 + turn] * NEXT_TOKENS
    await report_finish(ctx, ex, f"g{i // GROUP_SIZE}", i)


async def stream_execution(i: int, ctx: dict[str, Any], calls: Calls) -> None:
    """An execution whose calls go on its router's shared GenerateStream, answered once."""
    router: RouterStream = ctx["router_streams"][i % len(ctx["router_streams"])]
    ex, tok = ctx["stream_execs"][i]
    prompt = prompt_of(i)
    for turn in range(ctx["turns"]):
        start = time.perf_counter()
        request = router_pb2.GenerateRequest(
            execution_id=ex,
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=ctx["max_tokens"]),
        )
        try:
            out = [t for r in await router.generate(tok, request) for t in r.chunk.token_ids]
        except Exception as exc:  # noqa: BLE001 (counted, reported)
            calls.errors.append(f"stream {ex} turn {turn}: {exc!r}"[:300])
            return
        took = time.perf_counter() - start
        calls.add(False, took, took, len(out))
        prompt = prompt + out + [5 + turn] * NEXT_TOKENS
    await report_finish(ctx, ex, f"gs{i // GROUP_SIZE}", i)


async def report_finish(ctx: dict[str, Any], ex: str, group: str, i: int) -> None:
    """The scheduler's finish report of an execution whose calls all returned."""
    await ctx["finish_stub"].ReportFinish(
        packer_pb2.FinishReport(
            execution_id=ex,
            group_id=group,
            group_size=GROUP_SIZE,
            status=common_pb2.EXECUTION_STATUS_COMPLETED,
            reward=float(i % 3),
            policy_version=1,
        ),
        timeout=60,
    )


PHASES = {"direct": direct_execution, "routed": routed_execution, "routed_stream": stream_execution}


async def phase(name: str, ctx: dict[str, Any], pids: dict[str, list[int]]) -> dict[str, Any]:
    run = PHASES[name]
    calls = Calls()
    before = {svc: sum(cpu_s(p) for p in ps) for svc, ps in pids.items()}
    client0 = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(run(i, ctx, calls) for i in range(ctx["executions"])))
    elapsed = time.perf_counter() - start
    cpu = {svc: sum(cpu_s(p) for p in ps) - before[svc] for svc, ps in pids.items()}
    cpu["client"] = time.process_time() - client0  # the harnesses (and, routed, the finish reports)
    tokens = calls.tokens
    return {
        "seconds": elapsed,
        "calls": len(calls.rows),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "streamed": calls.stats(True),
        "non_streamed": calls.stats(False),
        "errors": len(calls.errors),
        "error_samples": calls.errors[:5],
        "cpu_s": cpu,
        "cpu_us_per_token": {svc: c / max(tokens, 1) * 1e6 for svc, c in cpu.items()},
    }


async def recorded_turns(stub: Any, want: int, wait_s: float = 120.0) -> int:
    """Turn records the packer accepted, once it reached ``want`` or ``wait_s`` passed."""
    got = 0
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=0), timeout=30)
        got = int(status.counters.produced)
        if got >= want:
            break
        await asyncio.sleep(0.5)
    return got


def write_cluster(
    path: Path, args: argparse.Namespace, etcd: str, pki: BenchPki, tok_dir: Path, tmp: Path
) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "cluster": {
                    "name": "load" + secrets.token_hex(3),
                    "etcd_endpoints": [etcd],
                    "tls": {"dir": pki.tls_dir},
                },
                "packer": {
                    "wal_dir": str(tmp / "wal"),
                    "batch_size": 1 << 16,  # nothing is claimed here: turns only accumulate
                    "micro_step_token_budget": 1 << 14,
                    # A group is ready this long after its last finish report: the routers
                    # record turns asynchronously, and on 2 loaded cores they lag by seconds.
                    "ready_grace_s": 10.0,
                    "policy_from_etcd": False,
                    "log_level": "WARNING",
                },
                "router": {
                    "model_dir": str(tok_dir),
                    "http_port": 0,
                    "log_level": "WARNING",
                    "unknown_token_wait_s": 30.0,
                    "request_timeout_s": 600.0,
                    "max_turn_tokens": 1 << 14,
                    "max_model_len": 1 << 15,
                    **({"turn_senders": args.turn_senders} if args.turn_senders else {}),
                },
                "cell_agent": {
                    "kind": "standalone",
                    "index": -1,
                    "engine": "mock",
                    "policy_version": 1,
                    "slots": 4096,
                    "lease_ttl_s": 30,
                    "log_level": "WARNING",
                    "mock": {"fixed_decode_step_s": args.step_ms / 1000.0, "max_batch": 4096},
                },
            }
        )
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-load-"))
    pki = BenchPki(tmp / "certs")
    pki.tls("packer", Role.PACKER)
    pki.tls("router", Role.ROUTER)
    cell_ids = [f"cell-{c}" for c in range(args.cells)]
    for c in cell_ids:
        pki.tls(c, Role.CELL_AGENT)
    etcd_server = EtcdServer()
    etcd_server.start()
    tok_dir = build_tokenizer_dir(tmp / "model")
    cfg = tmp / "cluster.yaml"
    write_cluster(cfg, args, etcd_server.endpoint, pki, tok_dir, tmp)
    cluster = yaml.safe_load(cfg.read_text())["cluster"]["name"]
    procs: list[ServiceProcess] = []
    channels: list[Any] = []
    session = None
    try:
        packer = ServiceProcess("packer", cfg, log_path=tmp / "packer.log").start(timeout_s=120)
        procs.append(packer)
        text = cfg.read_text().replace("router:\n", f"router:\n  packer_target: {packer.target}\n", 1)
        cfg.write_text(text)
        cells = [
            ServiceProcess("cell_agent", cfg, {"cell_id": c}, name=c, log_path=tmp / f"{c}.log")
            for c in cell_ids
        ]
        cell_starts = [asyncio.to_thread(p.start, 180) for p in cells]
        router_starts = [
            asyncio.to_thread(start_router, cfg, tmp / f"router{r}.log") for r in range(args.routers)
        ]
        await asyncio.gather(*cell_starts)
        procs += cells
        routers = list(await asyncio.gather(*router_starts))
        procs += [p for p, _ in routers]
        etcd = Etcd([etcd_server.endpoint], 10.0)
        await etcd.connect()
        keys = Keys(cluster)
        execs = [(f"ex-{i}", secrets.token_hex(12)) for i in range(args.executions)]
        stream_execs = [(f"ex-s{i}", secrets.token_hex(12)) for i in range(args.executions)]
        for i in range(args.executions):
            cell = cells[i % len(cells)]
            for (ex, tok), group in (
                (execs[i], f"g{i // GROUP_SIZE}"),
                (stream_execs[i], f"gs{i // GROUP_SIZE}"),
            ):
                await put_route(etcd, keys, ex, cell_ids[i % len(cells)], cell.target, tok, group_id=group)
        opts: list[tuple[str, object]] = [("grpc.max_concurrent_streams", 8192)]
        engine_chs = [pki.channel(c.target, "router", Role.ROUTER, Role.CELL_AGENT, opts) for c in cells]
        finish_ch = pki.channel(packer.target, "scheduler", Role.SCHEDULER, Role.PACKER, opts)
        router_chs = [pki.channel(p.target, "harness", Role.HARNESS, Role.ROUTER, opts) for p, _ in routers]
        channels = [*engine_chs, finish_ch, *router_chs]
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        ctx = {
            "engine_stubs": [cell_agent_pb2_grpc.EngineStub(ch) for ch in engine_chs],
            "finish_stub": packer_pb2_grpc.PackerStub(finish_ch),
            "urls": [u for _, u in routers],
            "execs": execs,
            "stream_execs": stream_execs,
            "router_streams": [RouterStream(ch) for ch in router_chs],
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "executions": args.executions,
            "session": session,
        }
        pids = {
            "router": [p.pid for p, _ in routers],
            "cell_agent": [c.pid for c in cells],
            "packer": [packer.pid],
            "etcd": [etcd_server.pid],
        }
        print(f"{args.executions} executions, {args.routers} routers, {args.cells} cells", flush=True)
        phases: dict[str, dict[str, Any]] = {}
        for name in PHASES:
            print(f"  {name} phase ...", end=" ", flush=True)
            phases[name] = p = await phase(name, ctx, pids)
            print(f"{p['tokens_per_s']:.0f} tokens/s in {p['seconds']:.1f} s", flush=True)
        direct, routed, routed_stream = phases["direct"], phases["routed"], phases["routed_stream"]
        for rs in ctx["router_streams"]:
            await rs.close()
        want_turns = routed["calls"] + routed_stream["calls"]
        got_turns = await recorded_turns(ctx["finish_stub"], want_turns)
        await etcd.close()
        result = {
            "benchmark": "dataplane_load",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "params": {k: v for k, v in vars(args).items() if k != "out"},
            "setup": {
                "prompt_tokens": PROMPT_TOKENS,
                "next_turn_tokens": NEXT_TOKENS,
                "group_size": GROUP_SIZE,
                "engine": "cell agent, mock engine (fixed decode step, one chunk per request per step)",
                "tls": "mutual TLS on every gRPC hop",
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_1m_end": os.getloadavg()[0],
            },
            "direct": direct,
            "routed": routed,
            "routed_stream": routed_stream,
            "turns_expected": 2 * args.executions * args.turns,
            "turns_recorded": got_turns,
        }
        result["summary"] = summarize(result)
        return result
    finally:
        if session is not None:
            await session.close()
        for ch in channels:
            await ch.close()
        for p in reversed(procs):
            p.stop()
        etcd_server.cleanup()


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """What the load test says, from its rows: throughput, what the routers added to a call
    (p50/p99 completion through routers minus direct, streamed and non-streamed apart), CPU
    per relayed token per service, and losses (calls that failed, turns not recorded); the
    ``stream_*`` fields: the phase with every call on its router's GenerateStream (its
    completion p50 over the direct phase's non-streamed calls)."""
    d, r, m = result["direct"], result["routed"], result["routed_stream"]

    def added(kind: str, q: str) -> float:
        return round(r[kind]["call"][f"{q}_ms"] - d[kind]["call"][f"{q}_ms"], 1)

    def ratio(kind: str, phase: dict[str, Any] = r) -> float | None:
        base = d[kind]["call"]["p50_ms"]
        return round(phase[kind]["call"]["p50_ms"] / base, 3) if base else None

    def cpu(phase: dict[str, Any]) -> dict[str, float]:
        return {k: round(v, 1) for k, v in phase["cpu_us_per_token"].items()}

    return {
        "executions": result["params"]["executions"],
        "routers": result["params"]["routers"],
        "cells": result["params"]["cells"],
        "routed_tokens_per_s": round(r["tokens_per_s"], 1),
        "direct_tokens_per_s": round(d["tokens_per_s"], 1),
        "added_ms_streamed_p50": added("streamed", "p50"),
        "added_ms_streamed_p99": added("streamed", "p99"),
        "added_ms_non_streamed_p50": added("non_streamed", "p50"),
        "added_ms_non_streamed_p99": added("non_streamed", "p99"),
        "ratio_streamed_p50": ratio("streamed"),
        "ratio_non_streamed_p50": ratio("non_streamed"),
        "cpu_us_per_token": cpu(r),
        "stream_tokens_per_s": round(m["tokens_per_s"], 1),
        "ratio_stream_p50": ratio("non_streamed", m),
        "stream_cpu_us_per_token": cpu(m),
        "harness_errors": r["errors"] + d["errors"] + m["errors"],
        "turns_lost": result["turns_expected"] - result["turns_recorded"],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--routers", type=int, default=2)
    ap.add_argument("--cells", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the mock engine's decode step")
    ap.add_argument("--turn-senders", type=int, default=0, help="router turn_senders (0: its default)")
    ap.add_argument("--quick", action="store_true", help="64 executions, 2 turns (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dataplane_load.json"))
    a = ap.parse_args()
    if a.quick:
        a.executions, a.turns = 64, 2
    out = asyncio.run(main(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=2))
