"""GPU check of the vLLM engine (skipped without CUDA): on a small real-architecture model
(the tiny Qwen2 build, or GYRE_GPU_MODEL_DIR, e.g. a downloaded Qwen checkpoint) it times
engine start, sleep -> wake (sleep must free device memory and wake must restore serving
with the same greedy output), and an in-place weight update (output changes, restoring the
weights restores it). Figures are printed and saved to bench/results/engine_gpu.json; they
go in docs/benchmarks/engine.md once measured on a GPU machine."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[2]


async def _greedy(engine, rid, prompt, n=32):
    from services.cell_agent.engines.base import Sampling

    return [t async for c in engine.generate(rid, prompt, Sampling(max_tokens=n)) for t in c.token_ids]


async def test_gpu_engine_start_sleep_wake_and_weight_update(tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file

    from apps.model.tiny import build_tiny_model
    from services.cell_agent.engines.vllm_engine import VllmEngine

    model_dir = os.environ.get("GYRE_GPU_MODEL_DIR") or str(build_tiny_model(tmp_path / "tiny", seed=0))
    figures: dict[str, object] = {"model_dir": model_dir, "device": torch.cuda.get_device_name(0)}

    t0 = time.perf_counter()
    engine = VllmEngine(model_dir, max_model_len=4096, max_num_seqs=64, gpu_memory_utilization=0.5)
    await engine.start()
    figures["engine_start_s"] = time.perf_counter() - t0
    try:
        assert engine.can_sleep
        prompt = list(range(10, 60))
        base = await _greedy(engine, "base", prompt)

        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        assert await engine.sleep() is True
        figures["sleep_s"] = time.perf_counter() - t0
        free_asleep = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        await engine.wake()
        figures["wake_s"] = time.perf_counter() - t0
        figures["freed_gib"] = (free_asleep - free_awake) / 2**30
        assert free_asleep > free_awake
        assert await _greedy(engine, "woken", prompt) == base

        files = sorted(Path(model_dir).glob("*.safetensors"))
        original: dict[str, torch.Tensor] = {}
        for f in files:
            original.update(load_file(str(f)))
        figures["weight_bytes"] = sum(t.numel() * t.element_size() for t in original.values())
        gen = torch.Generator().manual_seed(1)
        perturbed = {
            k: v + 0.05 * torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in original.items()
        }
        t0 = time.perf_counter()
        await engine.load_weights(1, perturbed)
        figures["weight_update_s"] = time.perf_counter() - t0
        assert await _greedy(engine, "changed", prompt) != base
        t0 = time.perf_counter()
        await engine.load_weights(2, original)
        figures["weight_restore_s"] = time.perf_counter() - t0
        assert await _greedy(engine, "restored", prompt) == base
    finally:
        t0 = time.perf_counter()
        await engine.shutdown()
        figures["shutdown_s"] = time.perf_counter() - t0
    out = ROOT / "bench" / "results" / "engine_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
