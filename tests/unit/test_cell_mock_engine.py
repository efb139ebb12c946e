"""The mock engine keeps the engine contract and follows its timing model: step costs are
exactly the roofline of its parameters (virtual time), tokens are deterministic and a
continuation from prompt + k tokens reproduces the uninterrupted run, weights are
fingerprinted by content, KV handles skip prefill, and scripted faults kill or hang it."""

from __future__ import annotations

import asyncio

import pytest

from services.cell_agent.engines.base import EngineDead, FinishReason, Sampling
from services.cell_agent.engines.mock import MockEngine, MockFaults, MockTiming, RealClock, VirtualClock


def _engine(**kw) -> tuple[MockEngine, VirtualClock]:
    clock = VirtualClock()
    timing = kw.pop("timing", MockTiming())
    return MockEngine(timing=timing, clock=clock, **kw), clock


async def _collect(engine, rid, prompt, n, **kw):
    chunks = [c async for c in engine.generate(rid, prompt, Sampling(max_tokens=n, **kw))]
    return [t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs], chunks


def _decode(p: MockTiming, contexts: list[int]) -> float:
    bw = (p.weight_bytes + sum(contexts) * p.kv_bytes_per_token) / (p.bw_efficiency * p.hbm_bytes_per_s)
    fl = 2 * p.n_params * len(contexts) / (p.flop_efficiency * p.flops)
    return max(bw, fl)


def _prefill(p: MockTiming, n: int, start: int) -> float:
    return n * (2 * p.n_params + 4 * p.n_layers * p.d_model * (start + n / 2)) / (p.flop_efficiency * p.flops)


@pytest.mark.parametrize(
    "timing", [MockTiming(), MockTiming(hbm_bytes_per_s=2.4e12, step_overhead_s=0.01, time_scale=0.5)]
)
async def test_single_request_time_follows_the_roofline(timing):
    engine, clock = _engine(timing=timing)
    await engine.start()
    prompt = list(range(3, 1003))
    await _collect(engine, "r", prompt, 5)
    expected = timing.step_overhead_s + _prefill(timing, 1000, 0)
    for i in range(1, 5):
        expected += timing.step_overhead_s + _decode(timing, [1000 + i])
    assert clock.now() == pytest.approx(expected * timing.time_scale, rel=1e-9)
    await engine.shutdown()


async def test_batched_decode_charges_the_batch_once_per_step():
    timing = MockTiming()
    engine, clock = _engine(timing=timing)
    await engine.start()
    await engine.pause()  # admit both in the same first step
    tasks = [asyncio.create_task(_collect(engine, f"r{i}", [5 + i] * 200, 4)) for i in range(2)]
    for _ in range(5):
        await asyncio.sleep(0)
    await engine.resume()
    await asyncio.gather(*tasks)
    expected = timing.step_overhead_s + 2 * _prefill(timing, 200, 0)
    for i in range(1, 4):
        expected += timing.step_overhead_s + _decode(timing, [200 + i, 200 + i])
    assert clock.now() == pytest.approx(expected, rel=1e-9)
    # Bandwidth-bound decode: a batch step costs far less than two single steps.
    assert _decode(timing, [201, 201]) < 2 * _decode(timing, [201])
    await engine.shutdown()


async def test_fixed_decode_step_and_zero_scale():
    t = MockTiming(fixed_decode_step_s=0.02, step_overhead_s=0.0, n_params=1.0)
    engine, clock = _engine(timing=t)
    await engine.start()
    await _collect(engine, "r", [7, 8], 11)
    assert clock.now() == pytest.approx(10 * 0.02 + _prefill(t, 2, 0))
    fast, fclock = _engine(timing=MockTiming(time_scale=0.0))
    await fast.start()
    await _collect(fast, "r", [7, 8], 50)
    assert fclock.now() == 0.0
    await engine.shutdown()
    await fast.shutdown()


async def test_tokens_are_deterministic_and_continuations_exact():
    engine, _ = _engine(timing=MockTiming(time_scale=0.0))
    await engine.start()
    prompt = [11, 12, 13, 14, 15]
    full, lps, chunks = await _collect(engine, "a", prompt, 40)
    assert len(full) == 40 and len(lps) == 40 and all(lp < 0 for lp in lps)
    assert chunks[-1].finish_reason is FinishReason.LENGTH
    again, lps2, _ = await _collect(engine, "b", prompt, 40)
    assert (again, lps2) == (full, lps)
    for k in (1, 17, 39):
        rest, rest_lps, _ = await _collect(engine, f"c{k}", prompt + full[:k], 40 - k)
        assert full[:k] + rest == full
        assert lps[:k] + rest_lps == lps
    await engine.shutdown()


async def test_stop_token_ends_the_stream():
    engine, _ = _engine(timing=MockTiming(time_scale=0.0))
    await engine.start()
    full, _, _ = await _collect(engine, "a", [1, 2, 3], 20)
    stop = full[5]
    got, _, chunks = await _collect(engine, "b", [1, 2, 3], 20, stop_token_ids=(stop,))
    assert got == full[: full.index(stop) + 1]
    assert chunks[-1].finish_reason is FinishReason.STOP
    await engine.shutdown()


async def test_weights_fingerprint_by_content():
    torch = pytest.importorskip("torch")
    engine, _ = _engine(timing=MockTiming(time_scale=0.0))
    await engine.start()
    base, _, _ = await _collect(engine, "a", [4, 5, 6], 16)
    w1 = {"w": torch.ones(4, dtype=torch.bfloat16)}
    await engine.load_weights(1, w1)
    changed, _, chunks = await _collect(engine, "b", [4, 5, 6], 16)
    assert changed != base and chunks[0].policy_version == 1
    await engine.load_weights(2, {"w": torch.zeros(4, dtype=torch.bfloat16)})
    other, _, _ = await _collect(engine, "c", [4, 5, 6], 16)
    await engine.load_weights(3, {"w": torch.ones(4, dtype=torch.bfloat16)})
    same, _, _ = await _collect(engine, "d", [4, 5, 6], 16)
    assert other != changed and same == changed
    await engine.shutdown()


async def test_kv_export_import_skips_prefill(tmp_path):
    for kv_dir in ("", str(tmp_path)):
        src, _ = _engine(timing=MockTiming(time_scale=0.0), kv_dir=kv_dir, cell_id="src")
        dst, _ = _engine(timing=MockTiming(time_scale=0.0), cell_id="dst", prefix_cache_tokens=0)
        await src.start()
        await dst.start()
        prompt = list(range(3, 300))
        full, _, _ = await _collect(src, "ref", prompt, 30)
        gen = src.generate("live", prompt, Sampling(max_tokens=30))
        got: list[int] = []
        async for c in gen:
            got += c.token_ids
            if len(got) >= 10:
                break
        handle = await src.export_kv("live")
        assert handle is not None and handle.num_tokens >= len(prompt) + 10 - 1
        await gen.aclose()
        cont = prompt + got
        stream = dst.generate("cont", cont, Sampling(max_tokens=30 - len(got)), kv_handle=handle)
        rest = [t async for c in stream for t in c.token_ids]
        assert got + rest == full
        assert dst.stats.kv_imports == 1
        assert dst.stats.prefill_tokens <= len(cont) - handle.num_tokens + 1
        await src.release_kv(handle.handle_id)
        await src.release_kv(handle.handle_id)  # idempotent
        if kv_dir:
            assert not list(tmp_path.glob("*.json"))
        await src.shutdown()
        await dst.shutdown()


async def test_a_kv_handle_nobody_takes_is_dropped_after_its_ttl(tmp_path):
    """As vLLM's pins: a handle exported for a hand-off that never happens (the router died
    between the export and the continuation) is dropped after kv_pin_ttl_s, its copy and its
    file with it; over a soak of days the mock kept every such handle."""
    for kv_dir in ("", str(tmp_path)):
        src, _ = _engine(timing=MockTiming(time_scale=0.0), kv_dir=kv_dir, cell_id="src", kv_pin_ttl_s=0.05)
        await src.start()
        gen = src.generate("live", list(range(3, 100)), Sampling(max_tokens=30))
        async for _ in gen:
            break
        handle = await src.export_kv("live")
        await gen.aclose()
        assert handle is not None and src.pinned_kv == 1
        await asyncio.sleep(0.2)
        assert src.pinned_kv == 0
        assert src._read_handle(handle) is None
        assert not list(tmp_path.glob("*.json"))
        await src.release_kv(handle.handle_id)  # a late release is a no-op
        await src.shutdown()


async def test_abort_one_of_several():
    engine = MockEngine(MockTiming(fixed_decode_step_s=0.002, step_overhead_s=0.0, n_params=1.0), RealClock())
    await engine.start()
    tasks = {i: asyncio.create_task(_collect(engine, f"r{i}", [i + 3] * 4, 200)) for i in range(3)}
    await asyncio.sleep(0.05)
    assert await engine.abort("r1")
    assert not await engine.abort("nope")
    out = {i: await t for i, t in tasks.items()}
    assert out[1][2][-1].finish_reason is FinishReason.ABORT and len(out[1][0]) < 200
    assert len(out[0][0]) == 200 and len(out[2][0]) == 200
    assert engine.running_requests == 0
    await engine.shutdown()


async def test_scripted_death_fails_every_waiter():
    engine, _ = _engine(timing=MockTiming(time_scale=0.0), faults=MockFaults(die_after_tokens=10))
    await engine.start()
    results = await asyncio.gather(
        *[_collect(engine, f"r{i}", [3, i + 4], 50) for i in range(3)], return_exceptions=True
    )
    assert all(isinstance(r, EngineDead) for r in results)
    assert engine.died.is_set()
    with pytest.raises(EngineDead):
        await _collect(engine, "late", [3], 2)
    await engine.shutdown()


async def test_hang_is_caught_by_the_probe():
    engine, _ = _engine(timing=MockTiming(time_scale=0.0), faults=MockFaults(hang_after_tokens=5))
    await engine.start()
    waiter = asyncio.create_task(_collect(engine, "r", [3, 4], 50))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    with pytest.raises(EngineDead, match="timed out"):
        await engine.probe(timeout_s=0.2)
    with pytest.raises(EngineDead):
        await waiter
    await engine.shutdown()
