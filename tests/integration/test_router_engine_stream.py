"""The router's GenerateStream client demultiplexes one stream into per-request chunks
(through ``generate``, exactly as the per-request Generate path yields them; through
``attach``, straight into the caller's sink): each tag gets its own tokens (several
tags in one step, a tag twice in one step), the end's finish reason rides on the last chunk
(an empty chunk when the end brings no tokens), an error end raises its domain error, an end
with neither just stops; closing a request early or passing its deadline cancels its tag; a
broken stream fails every open request with UNAVAILABLE and the next request opens a new
stream; a step with fewer log-probs than tokens fails the requests in it with INTERNAL.
Real gRPC with mutual TLS on loopback: a scripted Engine servicer (steps written by the
test) and the router's fake engine (whose tokens are known in advance)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gyre.config import TlsConfig
from gyre.errors import DeadlineExceeded, FailedPrecondition, Internal, Unavailable
from gyre.tokens import Chunk, FinishReason
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from services.router.config import RouterConfig
from services.router.engine import EngineRequest, Sampling
from services.router.engine_stream import StreamEngineClient
from testkit.fake_engine import FakeEngineServer, FakeOptions, reference
from testkit.loopback import serve_loopback
from testkit.tls import PKI, tls

pytestmark = pytest.mark.timeout(60)

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class ScriptedEngine(pb_grpc.EngineServicer):
    """GenerateStream whose steps the test writes; records what the router sends."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[pb.EngineStreamRequest] = asyncio.Queue()
        self.steps: asyncio.Queue[pb.EngineStep | grpc.StatusCode] = asyncio.Queue()
        self.calls = 0

    async def GenerateStream(self, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        self.calls += 1

        async def read() -> None:
            async for msg in requests:
                await self.received.put(msg)

        reader = asyncio.create_task(read())
        try:
            while True:
                step = await self.steps.get()
                if isinstance(step, grpc.StatusCode):
                    await context.abort(step, "engine gone")
                yield step
        finally:
            reader.cancel()

    async def tags(self, n: int) -> dict[str, int]:
        """Tags of the next ``n`` starts, by request id."""
        out: dict[str, int] = {}
        while len(out) < n:
            msg = await asyncio.wait_for(self.received.get(), 10)
            out.update({s.request.request_id: s.tag for s in msg.starts})
        return out

    async def cancels(self) -> list[int]:
        while True:
            msg = await asyncio.wait_for(self.received.get(), 10)
            if msg.cancels:
                return list(msg.cancels)


def _config() -> RouterConfig:
    tls("router")  # issues the router's certificate
    return RouterConfig(tls=TlsConfig(dir=str(PKI / "router")))


def _request(rid: str, prompt: list[int] | None = None, max_tokens: int = 16) -> EngineRequest:
    return EngineRequest(rid, f"e-{rid}", tuple(prompt or [5, 6, 7]), Sampling(max_tokens=max_tokens))


async def _collect(it: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in it]


@pytest.fixture
async def scripted():
    engine = ScriptedEngine()
    server, target = await serve_loopback([(engine, pb_grpc.add_EngineServicer_to_server)], tls("cell-s"))
    client = StreamEngineClient(_config())
    try:
        yield engine, client, target
    finally:
        await client.close()
        await server.stop(None)


async def test_steps_are_demultiplexed_per_tag(scripted):
    engine, client, target = scripted
    one = asyncio.create_task(_collect(client.generate(target, _request("r1"), 10)))
    two = asyncio.create_task(_collect(client.generate(target, _request("r2"), 10)))
    tags = await engine.tags(2)
    t1, t2 = tags["r1"], tags["r2"]
    # r1 twice in one step, r2 once and ends in it with STOP; r1 ends alone later (LENGTH).
    await engine.steps.put(
        pb.EngineStep(
            tags=[t1, t2, t1],
            counts=[2, 1, 1],
            policy_versions=[3, 3, 3],
            token_ids=[10, 11, 20, 12],
            logprobs=[-0.1, -0.2, -0.3, -0.4],
            ends=[pb.EngineStreamEnd(tag=t2, finish_reason=STOP)],
        )
    )
    assert await asyncio.wait_for(two, 10) == [Chunk([20], [-0.3], 3, FinishReason.STOP)]
    await engine.steps.put(pb.EngineStep(ends=[pb.EngineStreamEnd(tag=t1, finish_reason=LENGTH)]))
    assert await asyncio.wait_for(one, 10) == [
        Chunk([10, 11], [-0.1, -0.2], 3),
        Chunk([12], [-0.4], 3),
        Chunk([], [], 3, FinishReason.LENGTH),
    ]
    assert engine.calls == 1  # both requests on one stream


async def test_error_end_raises_and_plain_end_stops(scripted):
    engine, client, target = scripted
    failed = asyncio.create_task(_collect(client.generate(target, _request("r1"), 10)))
    stopped = asyncio.create_task(_collect(client.generate(target, _request("r2"), 10)))
    tags = await engine.tags(2)
    code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    await engine.steps.put(
        pb.EngineStep(
            tags=[tags["r2"]],
            counts=[1],
            policy_versions=[1],
            token_ids=[7],
            logprobs=[0.0],
            ends=[
                pb.EngineStreamEnd(tag=tags["r1"], code=code, message="serving policy 2, not 1"),
                pb.EngineStreamEnd(tag=tags["r2"]),  # neither finish nor error: ended early
            ],
        )
    )
    with pytest.raises(FailedPrecondition, match="serving policy 2"):
        await asyncio.wait_for(failed, 10)
    assert await asyncio.wait_for(stopped, 10) == [Chunk([7], [0.0], 1)]


async def test_early_close_and_deadline_cancel_the_tag(scripted):
    engine, client, target = scripted
    stream = client.generate(target, _request("r1"), 10)
    first = asyncio.create_task(anext(stream))
    tag = (await engine.tags(1))["r1"]
    await engine.steps.put(
        pb.EngineStep(tags=[tag], counts=[1], policy_versions=[1], token_ids=[9], logprobs=[0.0])
    )
    assert (await asyncio.wait_for(first, 10)).token_ids == [9]
    await stream.aclose()  # the call loop's move or cancel
    assert await engine.cancels() == [tag]

    with pytest.raises(DeadlineExceeded):
        await _collect(client.generate(target, _request("r2"), 0.3))
    assert await engine.cancels() == [tag + 1]  # r2's tag: tags are numbered per stream


async def test_broken_stream_fails_every_request_and_the_next_reopens(scripted):
    engine, client, target = scripted
    open_ = [asyncio.create_task(_collect(client.generate(target, _request(f"r{i}"), 10))) for i in range(3)]
    await engine.tags(3)
    await engine.steps.put(grpc.StatusCode.UNAVAILABLE)
    for task in open_:
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 10)
    again = asyncio.create_task(_collect(client.generate(target, _request("r9"), 10)))
    tag = (await engine.tags(1))["r9"]
    await engine.steps.put(
        pb.EngineStep(
            tags=[tag],
            counts=[1],
            policy_versions=[1],
            token_ids=[4],
            logprobs=[0.0],
            ends=[pb.EngineStreamEnd(tag=tag, finish_reason=STOP)],
        )
    )
    assert await asyncio.wait_for(again, 10) == [Chunk([4], [0.0], 1, FinishReason.STOP)]
    assert engine.calls == 2


async def test_a_step_short_of_logprobs_fails_its_requests_and_the_stream_goes_on(scripted):
    """Whose tokens lack a log-prob cannot be told: every request with tokens in the step
    fails with INTERNAL (none gets a made-up 0.0) and its tag is cancelled; a request not in
    the step goes on, on the same stream."""
    engine, client, target = scripted
    one = asyncio.create_task(_collect(client.generate(target, _request("r1"), 10)))
    two = asyncio.create_task(_collect(client.generate(target, _request("r2"), 10)))
    three = asyncio.create_task(_collect(client.generate(target, _request("r3"), 10)))
    tags = await engine.tags(3)
    await engine.steps.put(
        pb.EngineStep(
            tags=[tags["r1"], tags["r2"], tags["r1"]],
            counts=[1, 2, 1],
            policy_versions=[1, 1, 1],
            token_ids=[10, 20, 21, 11],
            logprobs=[-0.1, -0.2, -0.3],
            ends=[pb.EngineStreamEnd(tag=tags["r2"], finish_reason=STOP)],
        )
    )
    for task in (one, two):
        with pytest.raises(Internal, match="4 token\\(s\\) with 3 log-prob"):
            await asyncio.wait_for(task, 10)
    assert sorted(await engine.cancels()) == sorted([tags["r1"], tags["r2"]])
    await engine.steps.put(
        pb.EngineStep(
            tags=[tags["r3"]],
            counts=[1],
            policy_versions=[1],
            token_ids=[30],
            logprobs=[-0.5],
            ends=[pb.EngineStreamEnd(tag=tags["r3"], finish_reason=LENGTH)],
        )
    )
    assert await asyncio.wait_for(three, 10) == [Chunk([30], [-0.5], 1, FinishReason.LENGTH)]
    assert engine.calls == 1


class Sink:
    """A ChunkSink that records."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.ends: list[tuple[FinishReason | None, BaseException | None]] = []
        self.ended = asyncio.Event()

    def on_chunk(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def on_end(self, finish: FinishReason | None, error: BaseException | None) -> None:
        self.ends.append((finish, error))
        self.ended.set()


async def test_attached_sinks_get_chunks_and_one_end(scripted):
    engine, client, target = scripted
    finished, expiring, detached = Sink(), Sink(), Sink()
    detach_finished = client.attach(target, _request("r1"), 10, finished)
    client.attach(target, _request("r2"), 0.3, expiring)
    detach = client.attach(target, _request("r3"), 10, detached)
    tags = await engine.tags(3)
    t1, t3 = tags["r1"], tags["r3"]
    await engine.steps.put(
        pb.EngineStep(
            tags=[t1, t3, t1],
            counts=[1, 1, 2],
            policy_versions=[2, 2, 2],
            token_ids=[1, 2, 3, 4],
            logprobs=[0.0, 0.0, 0.0, 0.0],
            ends=[pb.EngineStreamEnd(tag=t1, finish_reason=STOP)],
        )
    )
    await asyncio.wait_for(finished.ended.wait(), 10)
    assert finished.chunks == [Chunk([1], [0.0], 2), Chunk([3, 4], [0.0, 0.0], 2)]
    assert finished.ends == [(FinishReason.STOP, None)]
    detach_finished()  # ended: nothing to cancel
    # r2 passes its deadline: its sink hears DEADLINE_EXCEEDED, the engine a cancel.
    await asyncio.wait_for(expiring.ended.wait(), 10)
    assert isinstance(expiring.ends[0][1], DeadlineExceeded)
    assert await engine.cancels() == [tags["r2"]]
    # r3 detached: a cancel, and its sink hears nothing more (not even an end).
    detach()
    assert await engine.cancels() == [t3]
    await engine.steps.put(
        pb.EngineStep(
            tags=[t3],
            counts=[1],
            policy_versions=[2],
            token_ids=[5],
            logprobs=[0.0],
            ends=[pb.EngineStreamEnd(tag=t3, finish_reason=LENGTH)],
        )
    )
    await asyncio.sleep(0.2)
    assert detached.chunks == [Chunk([2], [0.0], 2)] and detached.ends == []
    assert engine.calls == 1


async def test_fake_engine_tokens_match_the_per_request_path():
    """Many concurrent requests over one stream to the router's fake engine give exactly the
    tokens of one uninterrupted engine; the last chunk carries the finish reason."""
    server = await FakeEngineServer(FakeOptions(token_delay_s=0.002, tokens_per_chunk=3)).start()
    client = StreamEngineClient(_config())
    try:
        prompts = [[5, 6, i] for i in range(20)]
        outs = await asyncio.gather(
            *(
                _collect(client.generate(server.target, _request(f"r{i}", p, 25), 10))
                for i, p in enumerate(prompts)
            )
        )
        for prompt, chunks in zip(prompts, outs, strict=True):
            assert [t for c in chunks for t in c.token_ids] == reference(1, prompt, 25)
            assert chunks[-1].finish_reason is FinishReason.LENGTH
            assert all(c.finish_reason is None for c in chunks[:-1])
    finally:
        await client.close()
        await server.stop(None)
