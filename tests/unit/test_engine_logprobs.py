"""Behaviour log-probs are never made up: an engine answer with fewer log-probs than tokens
is an error (INTERNAL), wherever it is seen (a TokenChunk, the cell's GenerateStream
session, the vLLM engine's completion deltas), instead of the 0.0 it used to be padded with;
the vLLM engine asks for the sampled token's log-prob after temperature; the mock's
log-probs follow the request's temperature; and each cell's engine has its own seed."""

from __future__ import annotations

import hashlib
import math
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest

from gyre.errors import Internal, from_status, status_for
from gyre.tokens import Chunk, FinishReason
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import common_pb2
from services.cell_agent.config import CellAgentConfig, cell_seed
from services.cell_agent.engine_stream import EngineStreamSession
from services.cell_agent.engines import build_engine
from services.cell_agent.engines.base import Sampling
from services.cell_agent.engines.mock import MockEngine, MockTiming, VirtualClock, mock_logprob
from services.cell_agent.engines.vllm_engine import LOGPROBS_MODE, VllmEngine, _logprobs


def test_a_token_chunk_short_of_logprobs_is_refused():
    ok = common_pb2.TokenChunk(token_ids=[5, 6], logprobs=[-0.1, -0.2], policy_version=3)
    assert Chunk.from_proto(ok) == Chunk([5, 6], [-0.1, -0.2], 3)
    for lps in ([], [-0.1]):
        with pytest.raises(Internal, match="2 token\\(s\\) with .* log-prob"):
            Chunk.from_proto(common_pb2.TokenChunk(token_ids=[5, 6], logprobs=lps, policy_version=3))
    end = common_pb2.TokenChunk(policy_version=3, finish_reason=common_pb2.FINISH_REASON_STOP)
    assert Chunk.from_proto(end) == Chunk([], [], 3, FinishReason.STOP)
    with pytest.raises(Internal):
        Chunk([1, 2, 3], [-0.5, -0.5], 1).check()


def test_internal_is_grpc_internal_both_ways():
    code, message = status_for(Internal("engine answered 2 token(s) with 1 log-prob(s)"))
    assert code is grpc.StatusCode.INTERNAL
    back = from_status(code.value[0], message)
    assert isinstance(back, Internal) and "log-prob" in str(back)


async def test_the_cell_stream_fails_a_request_short_of_logprobs_and_keeps_the_others_aligned():
    """The request whose engine answer lacks a log-prob ends with INTERNAL and sends no
    token; the other request's tokens and log-probs in the same stream stay aligned."""

    async def start(request: pb.EngineGenerateRequest) -> AsyncIterator[Chunk]:
        if request.request_id == "bad":
            yield Chunk([7, 8], [-0.3], 1)
            yield Chunk([9], [-0.4], 1, FinishReason.LENGTH)
        else:
            yield Chunk([3, 4], [-0.1, -0.2], 1)
            yield Chunk([5], [-0.5], 1, FinishReason.LENGTH)

    async def requests() -> AsyncIterator[pb.EngineStreamRequest]:
        yield pb.EngineStreamRequest(
            starts=[
                pb.EngineStreamStart(tag=1, request=pb.EngineGenerateRequest(request_id="bad")),
                pb.EngineStreamStart(tag=2, request=pb.EngineGenerateRequest(request_id="good")),
            ]
        )

    session = EngineStreamSession(start, 16)
    tokens: dict[int, list[tuple[int, float]]] = {1: [], 2: []}
    ends: dict[int, pb.EngineStreamEnd] = {}
    async for step in session.serve(requests()):
        assert len(step.token_ids) == len(step.logprobs) == sum(step.counts)
        pos = 0
        for tag, n in zip(step.tags, step.counts, strict=True):
            tokens[tag] += list(zip(step.token_ids[pos : pos + n], step.logprobs[pos : pos + n], strict=True))
            pos += n
        ends.update({e.tag: e for e in step.ends})
    assert tokens == {1: [], 2: [(3, -0.1), (4, -0.2), (5, -0.5)]}
    assert ends[1].code == grpc.StatusCode.INTERNAL.value[0] and "log-prob" in ends[1].message
    assert ends[2].code == 0 and ends[2].finish_reason == common_pb2.FINISH_REASON_LENGTH


def _delta(token_ids: list[int], logprobs: list[dict[int, float] | None] | None):
    entries = (
        None
        if logprobs is None
        else [
            None if d is None else {t: SimpleNamespace(logprob=lp) for t, lp in d.items()} for d in logprobs
        ]
    )
    return token_ids, entries


def test_vllm_deltas_without_a_logprob_per_token_are_refused():
    ids, entries = _delta([11, 12], [{11: -0.25}, {12: -1.5, 99: -0.1}])
    assert _logprobs(entries, ids, "r") == [-0.25, -1.5]
    assert _logprobs(None, [], "r") == []
    for bad in (None, [], [{11: -0.25}], [{11: -0.25}, None], [{11: -0.25}, {99: -0.1}]):
        ids, entries = _delta([11, 12], bad)
        with pytest.raises(Internal, match="vllm engine \\(request r\\) answered 2 token"):
            _logprobs(entries, ids, "r")


def test_the_vllm_engine_reports_processed_logprobs():
    """vLLM's default (raw_logprobs) is the untempered model's; the trainer scores tokens
    at the sampling temperature, so the engine asks for the sampler's own distribution."""
    assert LOGPROBS_MODE == "processed_logprobs"
    engine = VllmEngine("/nonexistent", seed=5)
    assert engine._args["logprobs_mode"] == "processed_logprobs" and engine._args["seed"] == 5


async def _mock_run(engine: MockEngine, rid: str, n: int, **sampling) -> tuple[list[int], list[float]]:
    chunks = [c async for c in engine.generate(rid, [11, 12, 13, 14], Sampling(max_tokens=n, **sampling))]
    return [t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs]


async def test_mock_logprobs_follow_the_temperature():
    engine = MockEngine(MockTiming(time_scale=0.0), VirtualClock())
    await engine.start()
    _, greedy_lps = await _mock_run(engine, "g", 12)
    at_1 = await _mock_run(engine, "t1", 12, temperature=1.0, seed=9)
    for temp in (0.3, 0.7, 1.5):
        ids, lps = await _mock_run(engine, f"t{temp}", 12, temperature=temp, seed=9)
        assert ids == at_1[0]  # the same draws; their log-probs under the tempered distribution
        assert lps == [mock_logprob(lp, temp, 512) for lp in at_1[1]]
        assert all(math.isfinite(lp) and lp <= 0 for lp in lps) and lps != at_1[1]
    await engine.shutdown()
    # Greedy and temperature 1 are the untempered log-probs (vLLM scales greedy rows by 1).
    assert [mock_logprob(lp, 0.0, 512) for lp in greedy_lps] == greedy_lps
    assert [mock_logprob(lp, 1.0, 512) for lp in at_1[1]] == at_1[1]


@pytest.mark.parametrize("temp", [0.05, 0.5, 2.0, 100.0])
@pytest.mark.parametrize("raw", [-0.001, -0.7, -4.0, -8.0])
def test_mock_logprob_is_a_tempered_distribution(raw, temp):
    """p = exp(raw) on the emitted id, the rest spread evenly over the other V-1 ids; at
    temperature T each probability goes to the power 1/T and is renormalized."""
    vocab = 512
    p, q = math.exp(raw), (1 - math.exp(raw)) / (vocab - 1)
    expected = math.log(p ** (1 / temp) / (p ** (1 / temp) + (vocab - 1) * q ** (1 / temp)))
    assert mock_logprob(raw, temp, vocab) == pytest.approx(expected, abs=1e-9)
    assert mock_logprob(raw, temp, vocab) <= 0.0


def test_each_cell_gets_its_own_engine_seed():
    cells = [CellAgentConfig(cell_id=f"cell-{i}") for i in range(64)]
    seeds = [c.engine_seed for c in cells]
    assert all(c.seed == 0 for c in cells) and len(set(seeds)) == len(seeds)
    assert all(1 <= s < 2**31 for s in seeds)
    # Stable: the same cell id gives the same seed in every process (no ``hash``).
    assert CellAgentConfig(cell_id="cell-3").engine_seed == seeds[3] == cell_seed("cell-3")
    digest = hashlib.blake2b(b"gyre-cell-seed\0cell-3", digest_size=8).digest()
    assert cell_seed("cell-3") == 1 + int.from_bytes(digest, "little") % (2**31 - 1)
    assert CellAgentConfig(cell_id="cell-3", seed=42).engine_seed == 42  # pinned by hand


async def test_two_mock_cells_sample_unseeded_requests_differently_and_seeded_ones_alike():
    engines = [
        build_engine(CellAgentConfig(cell_id=c, mock={"time_scale": 0.0})) for c in ("cell-a", "cell-b")
    ]
    for e in engines:
        await e.start()
    try:
        a, b = engines
        assert await _mock_run(a, "u", 16, temperature=1.0) != await _mock_run(b, "u", 16, temperature=1.0)
        # A request's own seed (the router gives every sampled call one) is the same stream
        # on any cell: a rerouted call continues it; greedy is the model's, on any cell.
        assert await _mock_run(a, "s", 16, temperature=1.0, seed=7) == await _mock_run(
            b, "s", 16, temperature=1.0, seed=7
        )
        assert await _mock_run(a, "g", 16) == await _mock_run(b, "g", 16)
    finally:
        for e in engines:
            await e.shutdown()
