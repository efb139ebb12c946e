"""Mock engine benchmark: (1) the timing model reproduces the figures of docs/design/workloads.md for a 7B
model on an H200 (simulated decode throughput of 53 concurrent 35k-token sequences, prefill
of a 35k context), measured in virtual time; (2) what a mock cell costs in real CPU, i.e.
how many simulated tokens one core drives per second, batched vs one sequence (the
baseline, same run), which bounds how many mock cells one machine can host.

    PYTHONPATH=. .venv/bin/python bench/engine_mock.py
Writes bench/results/engine_mock.json.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from services.cell_agent.engines.base import Sampling
from services.cell_agent.engines.mock import MockEngine, MockTiming, VirtualClock

OUT = Path(__file__).resolve().parent / "results" / "engine_mock.json"


async def _run_batch(engine: MockEngine, n_seqs: int, prompt_len: int, max_tokens: int) -> int:
    async def one(i: int) -> int:
        prompt = [3 + (i * 7 + j) % 500 for j in range(prompt_len)]
        stream = engine.generate(f"r{i}", prompt, Sampling(max_tokens=max_tokens))
        return sum([len(c.token_ids) async for c in stream])

    await engine.pause()  # admit every sequence in the same first step
    tasks = [asyncio.create_task(one(i)) for i in range(n_seqs)]
    for _ in range(3):
        await asyncio.sleep(0)
    await engine.resume()
    return sum(await asyncio.gather(*tasks))


async def simulated_figures() -> dict[str, float]:
    timing = MockTiming()
    clock = VirtualClock()
    engine = MockEngine(timing, clock, prefix_cache_tokens=0)
    await engine.start()
    tokens = await _run_batch(engine, 53, 35_000, 64)
    total = clock.now()
    prefill = 53 * timing.prefill_s(35_000, 0)
    decode_time = total - prefill - timing.step_overhead_s
    await engine.shutdown()
    step = timing.step_s([], [35_000 + 32] * 53)
    return {
        "decode_tok_s_53x35k": 53 * 63 / decode_time,
        "decode_tok_s_per_seq_53x35k": 63 / decode_time,
        "decode_step_ms_53x35k": step * 1e3,
        "prefill_35k_s": timing.prefill_s(35_000, 0),
        "tokens": tokens,
        "published_tok_s_per_gpu": 1700.0,
        "published_tok_s_per_seq": 32.0,
        "published_recompute_35k_s": 1.6,
    }


async def cpu_cost(n_seqs: int, tokens_each: int) -> float:
    """Simulated tokens per real CPU second at time_scale 0 (no waiting)."""
    engine = MockEngine(MockTiming(time_scale=0.0), VirtualClock())
    await engine.start()
    t0 = time.process_time()
    tokens = await _run_batch(engine, n_seqs, 64, tokens_each)
    cpu = time.process_time() - t0
    await engine.shutdown()
    return tokens / cpu


async def main() -> None:
    sim = await simulated_figures()
    single = await cpu_cost(1, 4000)
    batched = await cpu_cost(64, 500)
    result = {
        "simulated": sim,
        "ratios": {
            "decode_tok_s_vs_published": sim["decode_tok_s_53x35k"] / sim["published_tok_s_per_gpu"],
            "prefill_vs_published": sim["prefill_35k_s"] / sim["published_recompute_35k_s"],
            "cpu_tok_per_s_batched_vs_single": batched / single,
        },
        "cpu": {"single_seq_tok_per_cpu_s": single, "batch64_tok_per_cpu_s": batched},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
