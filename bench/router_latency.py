"""Router latency benchmark: what the router adds over calling the engine directly, and how
long a reroute takes.

Three kinds of processes on loopback, as in production: fake engines (testkit/fake_engine.py:
a deterministic token-level engine with a fixed per-token delay, standing in for the mock
engine), the router (``python -m services.router`` against a private etcd), and this client.
In the same run, at each concurrency (64, 256 and 1,024 streams of 32 tokens), rounds alternate
between calling Engine.Generate directly, Router.Generate (gRPC) and the router's OpenAI
SSE endpoint, and Router.Generate on a second router with no coalescing window (``coalesce_ms: 0``;
the routers' default holds each streamed message after the first up to 10 ms); per stream we
take the time to first token and to the last token.
Every gRPC hop runs with mutual TLS, as Gyre does by default (a bench CA issues the
identities); the same run also measures plaintext twins (``tls.insecure``: a second engine
and a third router, on their own routes) so ``tls_cost`` is TLS against plaintext on the
same machine at the same time: ``direct`` vs ``direct_plain`` and ``router_grpc`` vs
``router_grpc_plain``. The routers read the engine over one ``Engine.GenerateStream`` per
engine (the default, ``engine_stream: true``); a fourth router with ``engine_stream: false``
(one ``Engine.Generate`` call per request, the path before issue 20's multiplexed stream)
serves the ``*_percall`` rows of the same run, streamed and answered once. ``router_grpc_mux``:
the same calls answered once, all of them on one Router.GenerateStream of this client (a
harness process's calls multiplexed, ``gyre.client.router_stream``), and
``router_grpc_mux_streamed`` the same calls streamed on it. Reroute
latency: a stream runs on engine A; the "scheduler" (this script) rewrites the route to
engine B in etcd and calls Router.MoveExecutions; we measure from the start of that move
to B's first token (B runs in this process so its clock is ours) and to the next token the
harness receives.

    PYTHONPATH=. .venv/bin/python bench/router_latency.py [--rounds 3] [--streams 64,256,1024] [--quick]

Writes bench/results/router_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre import certs  # noqa: E402
from gyre.client.router_stream import RouterStream  # noqa: E402
from gyre.etcd import Etcd, Keys  # noqa: E402
from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.grpcx.channel import dial  # noqa: E402
from gyre.grpcx.tls import TlsFiles, set_process_tls  # noqa: E402
from gyre.identity import Identity, Role  # noqa: E402
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc  # noqa: E402
from services.router.config import RouterConfig  # noqa: E402
from testkit.fake_engine import FakeEngineServer, FakeOptions  # noqa: E402
from testkit.router_rig import build_tokenizer_dir, put_route, start_router, write_config  # noqa: E402

TOKENS = 32
TOKEN_DELAY_S = 0.005
PROMPT = list(range(10, 74))  # 64 prompt tokens
NO_WINDOW_MS = 0.0  # the second router's coalescing window (the others: the default, 10 ms)
STEP_CLOCK = True  # the engines step every request on one clock, as a batching engine does


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / __import__("os").sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summary(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(xs, 50) * 1e3,
        "p99_ms": pct(xs, 99) * 1e3,
        "mean_ms": statistics.fmean(xs) * 1e3,
        "n": len(xs),
    }


async def one_direct(stub: Any, i: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = 0.0
    req = cell_agent_pb2.EngineGenerateRequest(
        request_id=f"d{i}-{secrets.token_hex(3)}",
        execution_id="bench",
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=TOKENS),
    )
    n = 0
    async for chunk in stub.Generate(req, timeout=60):
        if not first:
            first = time.perf_counter() - t0
        n += len(chunk.token_ids)
    assert n == TOKENS
    return first, time.perf_counter() - t0


async def one_router(stub: Any, ex: str, token: str, answer_once: bool = False) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = 0.0
    req = router_pb2.GenerateRequest(
        execution_id=ex,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=TOKENS),
        answer_once=answer_once,
    )
    n = 0
    async for msg in stub.Generate(req, metadata=(("authorization", f"Bearer {token}"),), timeout=60):
        if not first:
            first = time.perf_counter() - t0
        n += len(msg.chunk.token_ids)
    assert n == TOKENS
    return first, time.perf_counter() - t0


async def one_mux(stream: RouterStream, ex: str, token: str) -> tuple[float, float]:
    """One call on the harness's shared Router.GenerateStream (answered once: first token
    and completion are the same moment)."""
    t0 = time.perf_counter()
    req = router_pb2.GenerateRequest(
        execution_id=ex, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=TOKENS)
    )
    responses = await stream.generate(token, req)
    assert sum(len(r.chunk.token_ids) for r in responses) == TOKENS
    done = time.perf_counter() - t0
    return done, done


async def one_mux_streamed(stream: RouterStream, ex: str, token: str) -> tuple[float, float]:
    """One streamed call on the harness's shared Router.GenerateStream."""
    t0 = time.perf_counter()
    first = 0.0
    req = router_pb2.GenerateRequest(
        execution_id=ex, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=TOKENS)
    )
    n = 0
    async for response in stream.generate_stream(token, req):
        if not first:
            first = time.perf_counter() - t0
        n += len(response.chunk.token_ids)
    assert n == TOKENS
    return first, time.perf_counter() - t0


async def one_sse(session: aiohttp.ClientSession, url: str, token: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = 0.0
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "stream": True, "return_token_ids": True}
    n = 0
    async with session.post(
        f"{url}/completions", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                got = len(json.loads(raw[6:])["choices"][0].get("token_ids", []))
                if got and not first:
                    first = time.perf_counter() - t0
                n += got
    assert n == TOKENS, n
    return first, time.perf_counter() - t0


async def one_json(session: aiohttp.ClientSession, url: str, token: str) -> tuple[float, float]:
    """A non-streaming OpenAI completion: the first token arrives with the last."""
    t0 = time.perf_counter()
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "stream": False, "return_token_ids": True}
    async with session.post(
        f"{url}/completions", json=body, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        n = len((await r.json())["choices"][0]["token_ids"])
    assert n == TOKENS, n
    done = time.perf_counter() - t0
    return done, done


async def run_round(kind: str, conc: int, ctx: dict[str, Any]) -> list[tuple[float, float]]:
    if kind == "direct":
        coros = [one_direct(ctx["engine_stub"], i) for i in range(conc)]
    elif kind == "direct_plain":
        coros = [one_direct(ctx["engine_plain_stub"], i) for i in range(conc)]
    elif kind == "router_grpc":
        coros = [one_router(ctx["router_stub"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_plain":
        coros = [one_router(ctx["router_plain_stub"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_nowindow":
        coros = [one_router(ctx["router2_stub"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_percall":
        coros = [one_router(ctx["router_percall_stub"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_once_percall":
        stub = ctx["router_percall_stub"]
        coros = [one_router(stub, ex, tok, answer_once=True) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_once":
        coros = [one_router(ctx["router_stub"], ex, tok, answer_once=True) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_mux":
        coros = [one_mux(ctx["router_stream"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_grpc_mux_streamed":
        coros = [one_mux_streamed(ctx["router_stream"], ex, tok) for ex, tok in ctx["execs"][:conc]]
    elif kind == "router_http_json":
        coros = [one_json(ctx["session"], ctx["url"], tok) for _, tok in ctx["execs"][:conc]]
    else:
        coros = [one_sse(ctx["session"], ctx["url"], tok) for _, tok in ctx["execs"][:conc]]
    return list(await asyncio.gather(*coros))


async def reroute_trials(ctx: dict[str, Any], trials: int) -> dict[str, Any]:
    dest: FakeEngineServer = ctx["dest"]
    etcd, keys = ctx["etcd"], ctx["keys"]
    to_engine: list[float] = []
    to_harness: list[float] = []
    for t in range(trials):
        ex, tok = f"rr-{t}-{secrets.token_hex(3)}", secrets.token_hex(8)
        await put_route(etcd, keys, ex, "a", ctx["engine_target"], tok)
        await asyncio.sleep(0.15)
        req = router_pb2.GenerateRequest(
            execution_id=ex, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=60)
        )
        call = ctx["router_stub"].Generate(req, metadata=(("authorization", f"Bearer {tok}"),), timeout=60)
        got = 0
        t_move = 0.0
        after_move = 0.0
        async for msg in call:
            got += len(msg.chunk.token_ids)
            if got >= 10 and not t_move:
                t_move = time.monotonic()
                epoch = await put_route(etcd, keys, ex, "b", dest.target, tok)
                await ctx["mover_stub"].MoveExecutions(
                    router_pb2.MoveExecutionsRequest(
                        fence=common_pb2.Fence(epoch=ctx["epoch"]),
                        moves=[
                            router_pb2.Move(execution_id=ex, from_cell="a", to_cell="b", route_epoch=epoch)
                        ],
                    ),
                    timeout=10,
                )
            elif t_move and not after_move and [r for r in dest.engine.requests if r.execution_id == ex]:
                after_move = time.monotonic()
        rids = [r.request_id for r in dest.engine.requests if r.execution_id == ex]
        assert rids and got == 60, (rids, got)
        first = [ts for k, r, ts in dest.engine.events if r == rids[0] and k == "first_token"][0]
        to_engine.append(first - t_move)
        to_harness.append(after_move - t_move)
    return {
        "move_to_first_token_at_destination": summary(to_engine),
        "move_to_next_token_at_harness": summary(to_harness),
        "trials": trials,
    }


def _engine(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "testkit" / "fake_engine.py"),
            "--token-delay-s",
            str(TOKEN_DELAY_S),
            *(["--step-clock"] if STEP_CLOCK else []),
            *args,
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


async def main(
    rounds: int, concurrencies: list[int], trials: int, only: list[str] | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="gyre-bench-router-"))
    pki = tmp / "certs"  # the bench's own CA: every TLS hop authenticates both ends
    certs.ensure(
        pki,
        [
            Identity(Role.CELL_AGENT, "a"),
            Identity(Role.CELL_AGENT, "b"),
            Identity(Role.ROUTER, "router"),
            Identity(Role.HARNESS, "harness"),
            Identity(Role.SCHEDULER, "scheduler"),
        ],
    )
    set_process_tls(TlsFiles.from_dir(pki / "b"))  # the in-process destination engine is cell b
    etcd_server = EtcdServer()
    etcd_server.start()
    engine = _engine("--cell-id", "a", "--tls-dir", str(pki / "a"))
    engine_plain = _engine("--cell-id", "a", "--insecure")
    router = router2 = router_plain = router_percall = None
    try:
        assert engine.stdout is not None and engine_plain.stdout is not None
        engine_target = json.loads(engine.stdout.readline())["target"]
        plain_target = json.loads(engine_plain.stdout.readline())["target"]
        tok_dir = build_tokenizer_dir(tmp / "model")
        cluster = "bench" + secrets.token_hex(3)
        cfg = write_config(
            tmp / "cluster.yaml",
            cluster,
            etcd_server.endpoint,
            model_dir=str(tok_dir),
            http_port=0,
            log_level="WARNING",
            tls={"dir": str(pki / "router")},
        )
        cfg_plain = write_config(
            tmp / "plain.yaml",
            cluster + "p",
            etcd_server.endpoint,
            model_dir=str(tok_dir),
            http_port=0,
            log_level="WARNING",
            tls={"insecure": True},
        )
        router, url = start_router(cfg, tmp / "router.log")
        router2, _ = start_router(cfg, tmp / "router2.log", coalesce_ms=NO_WINDOW_MS)
        router_plain, _ = start_router(cfg_plain, tmp / "router_plain.log")
        router_percall, _ = start_router(cfg, tmp / "router_percall.log", engine_stream=False)
        etcd = Etcd([etcd_server.endpoint], 5.0)
        await etcd.connect()
        keys, keys_plain = Keys(cluster), Keys(cluster + "p")
        await etcd.create(keys.leader(), b"bench")  # the "scheduler" (this script) leads: its epoch
        epoch = (await etcd.get(keys.leader())).create_revision
        execs = [(f"ex-{i}", secrets.token_hex(8)) for i in range(max(concurrencies))]
        for ex, tok in execs:
            await put_route(etcd, keys, ex, "a", engine_target, tok)
            await put_route(etcd, keys_plain, ex, "a", plain_target, tok)
        await asyncio.sleep(0.5)
        opts = [("grpc.max_concurrent_streams", 1000)]
        insecure = TlsFiles(insecure=True)
        ech = dial(
            engine_target, TlsFiles.from_dir(pki / "router"), Role.CELL_AGENT, opts
        )  # as the router does
        ech_plain = dial(plain_target, insecure, None, opts)
        harness = TlsFiles.from_dir(pki / "harness")
        rch = dial(router.target, harness, Role.ROUTER, opts)
        rch2 = dial(router2.target, harness, Role.ROUTER, opts)
        rch_plain = dial(router_plain.target, insecure, None, opts)
        rch_percall = dial(router_percall.target, harness, Role.ROUTER, opts)
        mover = dial(router.target, TlsFiles.from_dir(pki / "scheduler"), Role.ROUTER, opts)
        dest = await FakeEngineServer(FakeOptions(cell_id="b", token_delay_s=TOKEN_DELAY_S)).start()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        ctx = {
            "engine_stub": cell_agent_pb2_grpc.EngineStub(ech),
            "router_stub": router_pb2_grpc.RouterStub(rch),
            "execs": execs,
            "engine_plain_stub": cell_agent_pb2_grpc.EngineStub(ech_plain),
            "router_plain_stub": router_pb2_grpc.RouterStub(rch_plain),
            "router2_stub": router_pb2_grpc.RouterStub(rch2),
            "router_percall_stub": router_pb2_grpc.RouterStub(rch_percall),
            "mover_stub": router_pb2_grpc.RouterStub(mover),
            "router_stream": RouterStream(rch),  # every call of the harness on one stream
            "epoch": epoch,
            "session": session,
            "url": url,
            "etcd": etcd,
            "keys": keys,
            "engine_target": engine_target,
            "dest": dest,
        }
        kinds = [
            "direct",
            "router_grpc",
            "router_sse",
            "router_grpc_nowindow",
            "router_grpc_once",
            "router_grpc_mux",
            "router_grpc_mux_streamed",
            "router_http_json",
            "router_grpc_percall",
            "router_grpc_once_percall",
            "direct_plain",
            "router_grpc_plain",
        ]
        if only:  # a subset (an A/B of one path): direct stays, as every ratio's baseline
            kinds = [k for k in kinds if k == "direct" or k in only]
        for kind in kinds:  # warm-up: channels, connections, TLS sessions
            await run_round(kind, 8, ctx)
        results: dict[str, Any] = {}
        for conc in concurrencies:
            samples: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
            cpu = {k: {"router": 0.0, "engine": 0.0} for k in kinds}
            for _ in range(rounds):
                for kind in kinds:  # alternate so drift hits every kind alike
                    rpid = {
                        "router_grpc_nowindow": router2.pid,
                        "router_grpc_plain": router_plain.pid,
                        "router_grpc_percall": router_percall.pid,
                        "router_grpc_once_percall": router_percall.pid,
                    }.get(kind, router.pid)
                    epid = engine_plain.pid if kind.endswith("_plain") else engine.pid
                    r0, e0 = cpu_s(rpid), cpu_s(epid)
                    samples[kind] += await run_round(kind, conc, ctx)
                    cpu[kind]["router"] += cpu_s(rpid) - r0
                    cpu[kind]["engine"] += cpu_s(epid) - e0
            per: dict[str, Any] = {}
            for kind in kinds:
                tokens = rounds * conc * TOKENS
                per[kind] = {
                    "ttft": summary([a for a, _ in samples[kind]]),
                    "stream": summary([b for _, b in samples[kind]]),
                    "router_cpu_us_per_token": cpu[kind]["router"] / tokens * 1e6,
                    "engine_cpu_us_per_token": cpu[kind]["engine"] / tokens * 1e6,
                }
            for kind in kinds[1:]:
                per[kind]["added_ms"] = {
                    f"{m}_{q}": per[kind][m][f"{q}_ms"] - per["direct"][m][f"{q}_ms"]
                    for m in ("ttft", "stream")
                    for q in ("p50", "p99")
                }
                per[kind]["ratio_vs_direct"] = {
                    f"{m}_{q}": per[kind][m][f"{q}_ms"] / per["direct"][m][f"{q}_ms"]
                    for m in ("ttft", "stream")
                    for q in ("p50", "p99")
                }
            per["tls_cost"] = {
                kind: {
                    "router_cpu_us_per_token_added": per[kind]["router_cpu_us_per_token"]
                    - per[plain]["router_cpu_us_per_token"],
                    "engine_cpu_us_per_token_added": per[kind]["engine_cpu_us_per_token"]
                    - per[plain]["engine_cpu_us_per_token"],
                    **{
                        f"ratio_{m}_{q}": per[kind][m][f"{q}_ms"] / per[plain][m][f"{q}_ms"]
                        for m in ("ttft", "stream")
                        for q in ("p50", "p99")
                    },
                }
                for kind, plain in (("direct", "direct_plain"), ("router_grpc", "router_grpc_plain"))
                if kind in per and plain in per
            }
            results[str(conc)] = per
            print(f"[{conc} streams]")
            for kind in kinds:
                p = per[kind]
                print(
                    f"  {kind:20s} ttft p50 {p['ttft']['p50_ms']:7.1f} p99 {p['ttft']['p99_ms']:7.1f} | "
                    f"stream p50 {p['stream']['p50_ms']:7.1f} "
                    f"p99 {p['stream']['p99_ms']:7.1f} ms | cpu/token router {p['router_cpu_us_per_token']:5.0f} "
                    f"engine {p['engine_cpu_us_per_token']:5.0f} us"
                )
            for kind, c in per["tls_cost"].items():
                print(
                    f"  TLS cost ({kind} vs plaintext): stream p50 x{c['ratio_stream_p50']:.2f} "
                    f"p99 x{c['ratio_stream_p99']:.2f}; "
                    f"router CPU {c['router_cpu_us_per_token_added']:+.1f} us/token, "
                    f"engine {c['engine_cpu_us_per_token_added']:+.1f} us/token"
                )
        reroute = await reroute_trials(ctx, trials)
        r = reroute["move_to_first_token_at_destination"]
        print(
            f"reroute: move -> first token at destination p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} ms; "
            f"-> next token at harness p50 {reroute['move_to_next_token_at_harness']['p50_ms']:.1f} ms"
        )
        await session.close()
        await ctx["router_stream"].close()
        for ch in (ech, ech_plain, rch, rch2, rch_plain, rch_percall, mover):
            await ch.close()
        await dest.stop(0)
        await etcd.close()
        return {
            "benchmark": "router_latency",
            "setup": {
                "tokens_per_stream": TOKENS,
                "token_delay_s": TOKEN_DELAY_S,
                "step_clock": STEP_CLOCK,
                "prompt_tokens": len(PROMPT),
                "rounds": rounds,
                "engine": "testkit/fake_engine.py (one message per token and request on Generate; "
                "one message per loop turn for every request of a router on GenerateStream)",
                "router_engine_path": "GenerateStream (engine_stream: true); *_percall: Generate per request",
                "coalesce_ms": RouterConfig.model_fields["coalesce_ms"].default,
                "coalesce_ms_of_router_grpc_nowindow": NO_WINDOW_MS,
                "processes": "engine, router, client on loopback",
                "tls": "mutual TLS (ECDSA P-256, TLS 1.3) on every gRPC hop; *_plain: tls.insecure",
                "cpus": __import__("os").cpu_count(),
                "python": platform.python_version(),
            },
            "concurrency": results,
            "reroute": reroute,
            "load_average_1m": __import__("os").getloadavg()[0],
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    finally:
        for r in (router, router2, router_plain, router_percall):
            if r is not None:
                r.stop()
        for e in (engine, engine_plain):
            e.kill()
            e.wait()
        etcd_server.cleanup()


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """The output contract other tools read, for streamed calls through one router over
    mutual TLS (``router_grpc``), and the same for calls answered once (``*_answer_once``:
    Router.Generate with ``answer_once``, one message a call):

    - ``router_cpu_us_per_token``: the router process's CPU time over the tokens it relayed,
      at the largest concurrency measured;
    - ``ratio_256`` / ``ratio_1024``: median stream completion time through the router over
      direct, at 256 / 1,024 streams (null when that concurrency was not run);
    - ``routers_per_1000_streams``: router processes the run used per 1,000 streams (one router
      carried the largest concurrency), and ``router_cores_per_1000_streams``: the CPU cores
      1,000 streams at the benchmark's token rate would keep busy at the measured cost;
    - ``*_stream_mux``: the same calls answered once, all of the harness's calls on one
      Router.GenerateStream (``router_grpc_mux``); ``*_stream_mux_streamed``: streamed on it;
    - ``*_per_call_path``: the same figures on the router that reads engines with one
      Generate call per request (``engine_stream: false``), measured in the same run.
    """
    conc = out["concurrency"]
    top = max(conc, key=int)
    cpu = conc[top]["router_grpc"]["router_cpu_us_per_token"]
    tokens_per_s_per_stream = 1.0 / out["setup"]["token_delay_s"]

    def ratio(n: str, kind: str = "router_grpc") -> float | None:
        if n not in conc or kind not in conc[n]:
            return None
        return round(conc[n][kind]["ratio_vs_direct"]["stream_p50"], 3)

    def cpu_of(kind: str) -> float | None:
        got = conc[top].get(kind, {}).get("router_cpu_us_per_token")
        return round(got, 1) if got is not None else None

    return {
        "router_cpu_us_per_token": round(cpu, 1),
        "ratio_256": ratio("256"),
        "ratio_1024": ratio("1024"),
        "routers_per_1000_streams": round(1000 / int(top), 2),
        "router_cores_per_1000_streams": round(cpu * tokens_per_s_per_stream * 1000 / 1e6, 2),
        "streams_measured": sorted(int(c) for c in conc),
        "router_cpu_us_per_token_answer_once": cpu_of("router_grpc_once"),
        "ratio_256_answer_once": ratio("256", "router_grpc_once"),
        "ratio_1024_answer_once": ratio("1024", "router_grpc_once"),
        "router_cpu_us_per_token_stream_mux": cpu_of("router_grpc_mux"),
        "ratio_256_stream_mux": ratio("256", "router_grpc_mux"),
        "ratio_1024_stream_mux": ratio("1024", "router_grpc_mux"),
        "router_cpu_us_per_token_stream_mux_streamed": cpu_of("router_grpc_mux_streamed"),
        "ratio_256_stream_mux_streamed": ratio("256", "router_grpc_mux_streamed"),
        "ratio_1024_stream_mux_streamed": ratio("1024", "router_grpc_mux_streamed"),
        "router_cpu_us_per_token_per_call_path": cpu_of("router_grpc_percall"),
        "router_cpu_us_per_token_answer_once_per_call_path": cpu_of("router_grpc_once_percall"),
        "ratio_256_per_call_path": ratio("256", "router_grpc_percall"),
        "ratio_1024_per_call_path": ratio("1024", "router_grpc_percall"),
        "router_cpu_us_per_token_no_window": cpu_of("router_grpc_nowindow"),
        "ratio_256_no_window": ratio("256", "router_grpc_nowindow"),
        "ratio_1024_no_window": ratio("1024", "router_grpc_nowindow"),
        "calls": "streamed (Router.Generate, mTLS); *_answer_once: Router.Generate with answer_once "
        "(one message a call); *_stream_mux: the same calls all on one Router.GenerateStream "
        "(*_stream_mux_streamed: streamed on it); "
        "the OpenAI API's non-streaming rows are router_http_json; the router "
        "reads engines over GenerateStream, *_per_call_path over one Generate call per request; streamed "
        "calls hold each message after the first up to coalesce_ms (10), *_no_window forward every chunk",
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="one round at 64 streams, 5 reroutes (a smoke run)")
    ap.add_argument("--streams", default="64,256,1024", help="concurrencies, comma-separated")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="tokens per stream")
    ap.add_argument(
        "--timer-per-request",
        action="store_true",
        help="a timer per request in the fake engines, no step clock",
    )
    ap.add_argument(
        "--kinds",
        default="",
        help="measure only these kinds, comma-separated (direct always runs); for an A/B of "
        "one path, with --out elsewhere: the summary needs every kind",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "router_latency.json"))
    a = ap.parse_args()
    TOKENS = a.tokens
    STEP_CLOCK = not a.timer_per_request
    concs = [64] if a.quick else [int(c) for c in a.streams.split(",")]
    only = [k for k in a.kinds.split(",") if k]
    out = asyncio.run(main(1 if a.quick else a.rounds, concs, 5 if a.quick else a.trials, only))
    if not only:
        out["summary"] = summarize(out)
    dest = Path(a.out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print(f"wrote {dest}")
