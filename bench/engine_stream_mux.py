"""What a router pays to read engine tokens: one gRPC stream per call against one stream per
router-engine pair carrying each engine step's tokens of every call (issue 20, part 2).

The router's per-token cost has three parts: reading the engine's message, handing it from
the attempt task to the harness-facing task, and writing the harness's message. A multiplexed
engine stream changes only the first. This measures it alone, in this process (the reader),
against a fake engine process (the writer), over plaintext gRPC (mutual TLS made no
difference the router benchmark could resolve per token, docs/benchmarks/router.md):

- *per call*: ``--streams`` concurrent ``Engine.Generate`` streams of ``--tokens`` tokens,
  one message per token (a decode step gives each running request one token);
- *per step*: one stream whose every message carries ``--streams`` tokens (what one decode
  step gives all those requests), ``--tokens`` messages in all; the reader then hands each
  request its token (one ``asyncio.Queue`` per request, as the router's hand-off), so the
  fan-out a multiplexed stream needs is counted too.

The figure is this process's CPU time per token (``time.process_time``), and the ratio
between the two in the same run. ``--rounds`` alternate the modes.

    PYTHONPATH=. .venv/bin/python bench/engine_stream_mux.py [--streams 256] [--tokens 32]

Writes bench/results/engine_stream_mux.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.grpcx.channel import dial  # noqa: E402
from gyre.grpcx.tls import TlsFiles  # noqa: E402
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, common_pb2  # noqa: E402


def _engine(tokens_per_chunk: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "testkit" / "fake_engine.py"),
            "--insecure",
            "--tokens-per-chunk",
            str(tokens_per_chunk),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["target"]


def _request(rid: str, max_tokens: int) -> cell_agent_pb2.EngineGenerateRequest:
    return cell_agent_pb2.EngineGenerateRequest(
        request_id=rid,
        execution_id="bench",
        prompt_token_ids=list(range(10, 42)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
    )


async def per_call(stub: Any, streams: int, tokens: int, rnd: int) -> int:
    async def one(i: int) -> int:
        n = 0
        async for chunk in stub.Generate(_request(f"c{rnd}-{i}", tokens), timeout=120):
            n += len(chunk.token_ids)
        return n

    return sum(await asyncio.gather(*(one(i) for i in range(streams))))


async def per_step(stub: Any, streams: int, tokens: int, rnd: int) -> int:
    queues: list[asyncio.Queue[list[int]]] = [asyncio.Queue() for _ in range(streams)]
    n = 0
    async for chunk in stub.Generate(_request(f"s{rnd}", streams * tokens), timeout=120):
        ids = chunk.token_ids
        for k, q in enumerate(queues):  # hand each request its token of this step
            q.put_nowait(ids[k : k + 1])
        n += len(ids)
    return n


async def main(args: argparse.Namespace) -> dict[str, Any]:
    one, one_target = _engine(1)
    step, step_target = _engine(args.streams)
    opts: list[tuple[str, object]] = [("grpc.max_concurrent_streams", 4096)]
    plain = TlsFiles(insecure=True)
    ch1, ch2 = dial(one_target, plain, None, opts), dial(step_target, plain, None, opts)
    stubs = cell_agent_pb2_grpc.EngineStub(ch1), cell_agent_pb2_grpc.EngineStub(ch2)
    cpu: dict[str, list[float]] = {"per_call": [], "per_step": []}
    try:
        await per_call(stubs[0], 8, 4, -1)  # warm-up
        await per_step(stubs[1], 8, 4, -1)
        for rnd in range(args.rounds):
            for mode, fn, stub in (("per_call", per_call, stubs[0]), ("per_step", per_step, stubs[1])):
                c0 = time.process_time()
                n = await fn(stub, args.streams, args.tokens, rnd)
                cpu[mode].append((time.process_time() - c0) / n * 1e6)
    finally:
        await ch1.close()
        await ch2.close()
        for p in (one, step):
            p.kill()
            p.wait()
    med = {m: statistics.median(v) for m, v in cpu.items()}
    return {
        "benchmark": "engine_stream_mux",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "params": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_1m": os.getloadavg()[0],
        },
        "reader_cpu_us_per_token": {m: [round(x, 2) for x in v] for m, v in cpu.items()},
        "summary": {
            "per_call_stream_us_per_token": round(med["per_call"], 2),
            "per_step_stream_us_per_token": round(med["per_step"], 2),
            "ratio_per_step_vs_per_call": round(med["per_step"] / med["per_call"], 4),
        },
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_stream_mux.json"))
    a = ap.parse_args()
    out = asyncio.run(main(a))
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=2))
