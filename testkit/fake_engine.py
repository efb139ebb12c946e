"""A deterministic fake of the cell agent's ``Engine`` gRPC service, for the router's tests
and benchmark (not the real mock engine: that one lives in services/cell_agent).

The next token is a function of (policy version, every context token) only, through a
rolling hash, so a continuation (prompt + tokens already generated) at any fake with the
same policy version produces exactly the tokens the first engine would have. Scriptable:
die (``os._exit``) or hang after k tokens of a request, per-token delay, tokens per chunk;
the same on both ``Generate`` and ``GenerateStream`` (the real engine's stream session).

Run as a process: ``python testkit/fake_engine.py --cell-id c1 [--die-after-tokens 5]``
prints ``{"ready": "fake_engine", "target": "127.0.0.1:PORT"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre.errors import FailedPrecondition, GyreError, status_for  # noqa: E402
from gyre.grpcx.tls import TlsFiles, process_tls, set_process_tls  # noqa: E402
from gyre.tokens import Chunk  # noqa: E402
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, common_pb2  # noqa: E402
from services.cell_agent.engine_stream import EngineStreamSession  # noqa: E402
from testkit.loopback import serve_loopback  # noqa: E402

_MOD = (1 << 61) - 1
FIRST_TOKEN = 3  # ids below are special tokens; the fake never emits them unless asked


def next_state(state: int, token: int) -> int:
    return (state * 1_000_003 + token + 1) % _MOD


def context_state(policy_version: int, tokens: list[int] | tuple[int, ...]) -> int:
    state = policy_version + 17
    for t in tokens:
        state = next_state(state, t)
    return state


def token_for(state: int, vocab: int) -> tuple[int, float]:
    tok = FIRST_TOKEN + (state >> 11) % (vocab - FIRST_TOKEN)
    return tok, -((state >> 3) % 1000) / 1000.0


def reference(
    policy_version: int, prompt: list[int], max_tokens: int, vocab: int = 512, stop: tuple[int, ...] = ()
) -> list[int]:
    """What one uninterrupted fake produces for ``prompt``."""
    state = context_state(policy_version, prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        tok, _ = token_for(state, vocab)
        out.append(tok)
        state = next_state(state, tok)
        if tok in stop:
            break
    return out


@dataclasses.dataclass
class FakeOptions:
    cell_id: str = "fake"
    policy_version: int = 1
    vocab: int = 512
    token_delay_s: float = 0.0
    step_clock: bool = False
    """Tokens come on one shared clock (a decode step every ``token_delay_s`` gives every
    waiting request its next token, as a batching engine does) instead of a timer per request."""
    tokens_per_chunk: int = 1
    die_after_tokens: int = 0  # os._exit after sending this many tokens of one request (0: never)
    hang_after_tokens: int = 0  # stop sending (stream stays open) after this many tokens
    slots: int = 64
    export_kv: bool = True
    script: tuple[tuple[int, ...], ...] = ()
    """Scripted outputs: request n (in arrival order) first emits ``script[n % len(script)]``
    (e.g. a tool call's tokens), then hash tokens as usual (stop ids and max_tokens apply)."""


def _resolve(step: asyncio.Future[None]) -> None:
    if not step.done():
        step.set_result(None)


class FakeEngine(cell_agent_pb2_grpc.EngineServicer):
    """The servicer; ``events`` records (kind, request_id, monotonic time)."""

    def __init__(self, opts: FakeOptions) -> None:
        self.opts = opts
        self.running: dict[str, asyncio.Task[Any] | None] = {}
        self.events: list[tuple[str, str, float]] = []
        self.requests: list[cell_agent_pb2.EngineGenerateRequest] = []
        self.exports: dict[str, cell_agent_pb2.KvHandle] = {}
        self.released: list[str] = []
        self.progress: dict[str, int] = {}
        self.accepting = True
        self._next_step: asyncio.Future[None] | None = None
        self.streams = 0
        """GenerateStream calls served (a router on the stream path opens one and keeps it)."""

    async def _step(self) -> None:
        """Waits for the next decode step (the first waiter schedules it; everyone waiting
        by then gets its token at that step)."""
        step = self._next_step
        if step is None or step.done():
            loop = asyncio.get_running_loop()
            step = self._next_step = loop.create_future()
            loop.call_later(self.opts.token_delay_s, _resolve, step)
        await asyncio.shield(step)

    def _event(self, kind: str, request_id: str) -> None:
        self.events.append((kind, request_id, time.monotonic()))

    def kinds(self, kind: str) -> list[str]:
        return [rid for k, rid, _ in self.events if k == kind]

    async def Generate(
        self, request: cell_agent_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        try:
            async for chunk in self._generate(request):
                yield chunk
        except GyreError as exc:
            await context.abort(*status_for(exc))

    async def GenerateStream(
        self, requests: AsyncIterator[cell_agent_pb2.EngineStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cell_agent_pb2.EngineStep]:
        """The real engine's stream session over this fake's requests (scripting included)."""
        self.streams += 1
        session = EngineStreamSession(self._chunks, max_requests=4096)
        try:
            async for step in session.serve(requests):
                yield step
        except GyreError as exc:  # e.g. a tag started twice
            await context.abort(*status_for(exc))

    async def _chunks(self, request: cell_agent_pb2.EngineGenerateRequest) -> AsyncIterator[Chunk]:
        async for msg in self._generate(request):
            yield Chunk.from_proto(msg)

    async def _generate(
        self, request: cell_agent_pb2.EngineGenerateRequest
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        """One request's chunks, as both Generate and GenerateStream serve them."""
        o = self.opts
        if request.required_policy_version and request.required_policy_version != o.policy_version:
            raise FailedPrecondition(
                f"serving policy {o.policy_version}, not {request.required_policy_version}"
            )
        if not self.accepting:
            raise FailedPrecondition("draining")
        rid = request.request_id
        self.requests.append(request)
        self.running[rid] = asyncio.current_task()
        self.progress[rid] = 0
        self._event("start", rid)
        if request.HasField("kv_handle") and request.kv_handle.handle_id:
            self._event("kv_import", rid)
        state = context_state(o.policy_version, list(request.prompt_token_ids))
        stops = set(request.sampling.stop_token_ids)
        scripted = list(o.script[(len(self.requests) - 1) % len(o.script)]) if o.script else []
        sent = 0
        try:
            while sent < request.sampling.max_tokens:
                ids: list[int] = []
                lps: list[float] = []
                finish = common_pb2.FINISH_REASON_UNSPECIFIED
                for _ in range(o.tokens_per_chunk):
                    tok, lp = token_for(state, o.vocab)
                    if scripted:
                        tok, lp = scripted.pop(0), -0.25
                    state = next_state(state, tok)
                    ids.append(tok)
                    lps.append(lp)
                    if tok in stops:
                        finish = common_pb2.FINISH_REASON_STOP
                        break
                    if sent + len(ids) >= request.sampling.max_tokens:
                        finish = common_pb2.FINISH_REASON_LENGTH
                        break
                if o.token_delay_s and o.step_clock:
                    for _ in ids:
                        await self._step()
                elif o.token_delay_s:
                    await asyncio.sleep(o.token_delay_s * len(ids))
                if rid not in self.running:  # aborted by Abort()
                    self._event("aborted", rid)
                    return
                if sent == 0:
                    self._event("first_token", rid)
                if finish:
                    self._event("finish", rid)  # before the yield: the caller may close right after it
                yield common_pb2.TokenChunk(
                    token_ids=ids, logprobs=lps, policy_version=o.policy_version, finish_reason=finish
                )
                sent += len(ids)
                self.progress[rid] = sent
                if o.die_after_tokens and sent >= o.die_after_tokens:
                    await asyncio.sleep(0.05)  # let the chunk leave, then crash
                    os._exit(137)
                if o.hang_after_tokens and sent >= o.hang_after_tokens:
                    self._event("hang", rid)
                    await asyncio.Event().wait()
                if finish:
                    return
        except asyncio.CancelledError:
            self._event("cancelled", rid)
            raise
        finally:
            self.running.pop(rid, None)

    async def Abort(
        self, request: cell_agent_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> cell_agent_pb2.AbortResponse:
        self._event("abort_rpc", request.request_id)
        task = self.running.pop(request.request_id, None)
        return cell_agent_pb2.AbortResponse(aborted=task is not None)

    async def GetLoad(
        self, request: cell_agent_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> cell_agent_pb2.EngineLoad:
        return cell_agent_pb2.EngineLoad(
            cell_id=self.opts.cell_id,
            slots=self.opts.slots,
            running_requests=len(self.running),
            policy_version=self.opts.policy_version,
            accepting=self.accepting,
            engine="fake",
        )

    async def ExportKv(
        self, request: cell_agent_pb2.ExportKvRequest, context: grpc.aio.ServicerContext
    ) -> cell_agent_pb2.ExportKvResponse:
        self._event("kv_export", request.request_id)
        if not self.opts.export_kv or request.request_id not in self.running:
            return cell_agent_pb2.ExportKvResponse()
        handle = cell_agent_pb2.KvHandle(
            handle_id=uuid.uuid4().hex,
            source_cell=self.opts.cell_id,
            num_tokens=self.progress.get(request.request_id, 0),
            locator=f"shm://fake/{request.request_id}",
            medium="shm",
        )
        self.exports[handle.handle_id] = handle
        return cell_agent_pb2.ExportKvResponse(handle=handle)

    async def ReleaseKv(
        self, request: cell_agent_pb2.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> cell_agent_pb2.ReleaseKvResponse:
        self._event("kv_release", request.handle_id)
        self.released.append(request.handle_id)
        return cell_agent_pb2.ReleaseKvResponse()


class FakeEngineServer:
    """A FakeEngine on a loopback port, in this process."""

    def __init__(self, opts: FakeOptions | None = None, port: int = 0, tls: TlsFiles | None = None) -> None:
        self.engine = FakeEngine(opts or FakeOptions())
        self._port = port
        self._tls = tls
        self.server: grpc.aio.Server | None = None
        self.target = ""

    async def start(self) -> FakeEngineServer:
        # The router dials engines as cell agents: present a cell certificate (this
        # process's, or the one given), and require the caller's, as a cell agent does.
        self.server, self.target = await serve_loopback(
            [(self.engine, cell_agent_pb2_grpc.add_EngineServicer_to_server)],
            self._tls or process_tls(),
            self._port,
        )
        self._port = int(self.target.rsplit(":", 1)[1])
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
            self.server = None


async def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cell-id", default="fake")
    p.add_argument("--policy-version", type=int, default=1)
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--step-clock", action="store_true", help="one decode-step clock for every request")
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--die-after-tokens", type=int, default=0)
    p.add_argument("--hang-after-tokens", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tls-dir", default="", help="identity directory of the cell certificate to serve with")
    p.add_argument("--insecure", action="store_true", help="plaintext (a cluster run with tls.insecure)")
    a = p.parse_args()
    set_process_tls(TlsFiles(insecure=True) if a.insecure else TlsFiles.from_dir(a.tls_dir))
    server = await FakeEngineServer(
        FakeOptions(
            cell_id=a.cell_id,
            policy_version=a.policy_version,
            token_delay_s=a.token_delay_s,
            step_clock=a.step_clock,
            tokens_per_chunk=a.tokens_per_chunk,
            die_after_tokens=a.die_after_tokens,
            hang_after_tokens=a.hang_after_tokens,
        ),
        a.port,
    ).start()
    print(json.dumps({"ready": "fake_engine", "target": server.target}), flush=True)
    assert server.server is not None
    await server.server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(_main())
