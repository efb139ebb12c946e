"""Engine.GenerateStream against a real cell agent process (mock engine, mutual TLS): one
stream carries many requests; each engine step comes back as one message with every
request's new tokens; the tokens are those Engine.Generate gives for the same request; bad
starts end their own request with Generate's status and leave the others running; a cancel
aborts its engine request; ending the call aborts every request on it; a cell that stops
finishes the requests running on the stream, refuses new ones and ends the call."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from apps.procs import ServiceProcess
from gyre.identity import Role
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from services.cell_agent.servicer import EngineServicer
from testkit.cell_config import write_cell_config as write_config
from testkit.tls import RoleStubs

pytestmark = pytest.mark.timeout(120)


def _request(rid: str, prompt: list[int], n: int, **kw) -> pb.EngineGenerateRequest:
    return pb.EngineGenerateRequest(
        request_id=rid,
        execution_id=f"e-{rid}",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=n),
        **kw,
    )


class Reader:
    """Reads a GenerateStream call into per-tag tokens and ends."""

    def __init__(self, call) -> None:
        self.call = call
        self.tokens: dict[int, list[int]] = collections.defaultdict(list)
        self.versions: dict[int, set[int]] = collections.defaultdict(set)
        self.ends: dict[int, pb.EngineStreamEnd] = {}
        self.steps = 0
        self.max_tags_per_step = 0

    async def until(self, done) -> None:
        while not done():
            step = await self.call.read()
            assert step is not grpc.aio.EOF
            self.steps += 1
            assert len(step.tags) == len(step.counts) == len(step.policy_versions)
            assert sum(step.counts) == len(step.token_ids) == len(step.logprobs)
            self.max_tags_per_step = max(self.max_tags_per_step, len(set(step.tags)))
            at = 0
            for tag, n, v in zip(step.tags, step.counts, step.policy_versions, strict=True):
                assert tag not in self.ends, "tokens after the request's end"
                self.tokens[tag].extend(step.token_ids[at : at + n])
                self.versions[tag].add(v)
                at += n
            for end in step.ends:
                assert end.tag not in self.ends
                self.ends[end.tag] = end


async def _running(engine) -> int:
    return (await engine.GetLoad(pb.GetLoadRequest(), timeout=10)).running_requests


async def _until_idle(engine, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while await _running(engine):
            await asyncio.sleep(0.05)


async def test_generate_stream(tmp_path, etcd_server, cluster_name):
    path = write_config(tmp_path, etcd_server, cluster_name, slots=64)
    proc = ServiceProcess("cell_agent", path, log_path=tmp_path / "cell.log").start(timeout_s=60)
    try:
        async with RoleStubs(proc.target, pb_grpc.EngineStub, EngineServicer.ACCESS) as engine:
            router = engine.as_("router", Role.ROUTER)
            prompts = {tag: [5 + tag, 6, 7 + 2 * tag] for tag in range(1, 17)}

            # Many requests on one stream, tokens equal to Generate's for the same request.
            call = router.GenerateStream(timeout=60)
            await call.write(
                pb.EngineStreamRequest(
                    starts=[
                        pb.EngineStreamStart(tag=tag, request=_request(f"s{tag}", prompt, 12))
                        for tag, prompt in prompts.items()
                    ]
                )
            )
            reader = Reader(call)
            await reader.until(lambda: len(reader.ends) == len(prompts))
            for tag, prompt in prompts.items():
                assert reader.ends[tag].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert reader.ends[tag].code == 0
                direct = [c async for c in engine.Generate(_request(f"g{tag}", prompt, 12), timeout=30)]
                assert reader.tokens[tag] == [t for c in direct for t in c.token_ids], tag
            # One message per engine step, not per request: 16 requests x 12 tokens came in
            # far fewer messages, each carrying several requests.
            assert reader.max_tags_per_step > 1
            assert reader.steps < len(prompts) * 12 / 2, reader.steps

            # Bad starts end their own request with Generate's status; the stream goes on.
            bad = {
                100: (_request("", [1], 1), grpc.StatusCode.INVALID_ARGUMENT),
                101: (_request("b1", [], 1), grpc.StatusCode.INVALID_ARGUMENT),
                102: (
                    pb.EngineGenerateRequest(request_id="b2", prompt_token_ids=[1]),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                103: (_request("b3", [1] * 200_000, 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
                104: (_request("b4", [1], 1, required_policy_version=9), grpc.StatusCode.FAILED_PRECONDITION),
            }
            await call.write(
                pb.EngineStreamRequest(
                    starts=[pb.EngineStreamStart(tag=t, request=r) for t, (r, _) in bad.items()]
                    + [pb.EngineStreamStart(tag=200, request=_request("ok", [9, 9], 5))]
                )
            )
            await reader.until(lambda: all(t in reader.ends for t in [*bad, 200]))
            for tag, (_, code) in bad.items():
                assert reader.ends[tag].code == code.value[0], (tag, reader.ends[tag])
                assert reader.ends[tag].message
                assert tag not in reader.tokens
            assert reader.ends[200].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(reader.tokens[200]) == 5

            # A cancel aborts the engine request.
            await call.write(
                pb.EngineStreamRequest(
                    starts=[pb.EngineStreamStart(tag=300, request=_request("long", [3], 60_000))]
                )
            )
            await reader.until(lambda: len(reader.tokens[300]) > 0)
            assert await _running(engine) == 1
            await call.write(pb.EngineStreamRequest(cancels=[300, 12345]))  # unknown tags are ignored
            await _until_idle(engine)

            # The router half-closes: running requests finish, then the call ends.
            await call.write(
                pb.EngineStreamRequest(
                    starts=[pb.EngineStreamStart(tag=400, request=_request("last", [4], 20))]
                )
            )
            await call.done_writing()
            await reader.until(lambda: 400 in reader.ends)
            assert len(reader.tokens[400]) == 20
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

            # The router gives the call up (or dies): every request on it is aborted.
            call = router.GenerateStream(timeout=60)
            await call.write(
                pb.EngineStreamRequest(
                    starts=[
                        pb.EngineStreamStart(tag=t, request=_request(f"c{t}", [t + 1], 60_000))
                        for t in range(8)
                    ]
                )
            )
            reader = Reader(call)
            await reader.until(lambda: len(reader.tokens) == 8)
            assert await _running(engine) == 8
            call.cancel()
            await _until_idle(engine)

            # A start under a tag still running ends the call: INVALID_ARGUMENT, and every
            # request on it is aborted.
            call = router.GenerateStream(timeout=60)
            start = pb.EngineStreamStart(tag=7, request=_request("d1", [3], 60_000))
            await call.write(pb.EngineStreamRequest(starts=[start]))
            reader = Reader(call)
            await reader.until(lambda: len(reader.tokens[7]) > 0)
            await call.write(pb.EngineStreamRequest(starts=[start]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reader.until(lambda: False)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tag 7" in err.value.details()
            await _until_idle(engine)

            # A message that does not parse ends the call with INVALID_ARGUMENT.
            channel = engine._channels["router"]
            garbage = channel.stream_stream(
                "/gyre.v1.Engine/GenerateStream", request_serializer=None, response_deserializer=None
            )(timeout=10)
            await garbage.write(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await garbage.read()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # Only a router may open the stream.
            denied = engine.as_("harness", Role.HARNESS).GenerateStream(timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await denied.read()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        proc.stop()


async def test_a_stopping_cell_finishes_the_streams_requests_and_ends_the_call(
    tmp_path, etcd_server, cluster_name
):
    """SIGTERM while a request runs on a router's stream: the request still ends with all its
    tokens, a start sent after the signal is answered UNAVAILABLE (the router continues it at
    another engine), the call then ends OK, and the cell's drain did not wait out its grace
    period for the stream (before: every cell of a demo waited its full 5 s)."""
    path = write_config(tmp_path, etcd_server, cluster_name, slots=8)
    log = tmp_path / "cell.log"
    proc = ServiceProcess("cell_agent", path, log_path=log).start(timeout_s=60)
    try:
        async with RoleStubs(proc.target, pb_grpc.EngineStub, EngineServicer.ACCESS) as engine:
            call = engine.as_("router", Role.ROUTER).GenerateStream(timeout=60)
            long = pb.EngineStreamStart(tag=1, request=_request("long", [3, 4], 300))
            await call.write(pb.EngineStreamRequest(starts=[long]))
            reader = Reader(call)
            await reader.until(lambda: len(reader.tokens[1]) > 0)
            proc.proc.terminate()  # the graceful stop: drain, then cancel past grace_s
            await asyncio.sleep(0.3)
            late = pb.EngineStreamStart(tag=2, request=_request("late", [5], 4))
            await call.write(pb.EngineStreamRequest(starts=[late]))
            await reader.until(lambda: 1 in reader.ends and 2 in reader.ends)
            assert reader.ends[1].code == 0, reader.ends[1]
            assert reader.ends[1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert len(reader.tokens[1]) == 300
            assert reader.ends[2].code == grpc.StatusCode.UNAVAILABLE.value[0], reader.ends[2]
            assert 2 not in reader.tokens
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        assert await asyncio.to_thread(proc.proc.wait, 30) == 0
        assert "drain grace period passed" not in log.read_text()
    finally:
        proc.stop()
