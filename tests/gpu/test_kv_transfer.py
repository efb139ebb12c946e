"""GPU checks of the KV handoff transports (skipped without CUDA), for a GPU machine:

* transport level: a source process holds a pinned request in a paged cache shaped like a
  7B model's (28 layers x 4 KV heads x 128, bf16, 57,344 bytes per token) on cuda:0; this
  process reads its blocks with ``cuda_ipc`` (same node), ``nccl`` (two GPUs: NCCL refuses
  two ranks on one device) and ``tcp`` (staged through host memory) into its own paged cache,
  checks every block arrived intact, and records bytes/s per medium and prefix length;
* engine level: two vLLM engines on one GPU hand a moved request off (pin -> abort -> read
  -> release) with each medium at 1k/4k/16k tokens: the continuation is token-identical to
  the uninterrupted run, the destination reports the prefix cached, and the handoff's first
  token is timed against recomputing the prefix.

Figures are printed as JSON lines and, when $OUT is set, appended to $OUT/kv_transfer.jsonl
(``scripts/gpu_kv_checks.sh`` runs this file and keeps them)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from services.cell_agent.engines.kv_transport import (
    KvServer,
    PagedCaches,
    PinTable,
    ReadSpec,
    read,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYERS, HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2
LENGTHS = {"1k": 1024, "4k": 4096, "16k": 16384}


def _record(figures: dict) -> None:
    line = json.dumps(figures)
    print(line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kv_transfer.jsonl"), "a") as f:
            f.write(line + "\n")


def _cache(num_blocks: int, device: str, seed: int | None) -> PagedCaches:
    """A vLLM-GPU-layout paged cache: per layer [2, num_blocks, block, heads, head_dim]."""
    tensors = {}
    for i in range(LAYERS):
        t = torch.empty((2, num_blocks, BLOCK, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
        if seed is None:
            t.zero_()
        else:
            g = torch.Generator(device=device).manual_seed(seed + i)
            t.copy_(torch.randn(t.shape, generator=g, device=device).to(torch.bfloat16))
        tensors[f"model.layers.{i}.self_attn.attn"] = t
    return PagedCaches(tensors, num_blocks)


def _source(conn, device: str, num_blocks: int, tokens: list[int], block_ids: list[int]) -> None:
    """The source process: a paged cache, one sealed pin, a KvServer; serves until told."""
    torch.cuda.set_device(device)
    caches = _cache(num_blocks, device, seed=7)
    table = PinTable()
    table.pin("h", "r", 600.0)
    table.finish("r", tokens, block_ids, len(tokens))
    table.seal({"r"})
    server = KvServer(table, caches, BLOCK)
    conn.send(server.locator)
    conn.recv()  # done
    server.close()


@pytest.fixture(scope="module")
def spawn():
    import torch.multiprocessing as mp

    return mp.get_context("spawn")


@pytest.mark.parametrize("medium", ["cuda_ipc", "nccl", "tcp"])
@pytest.mark.parametrize("name", list(LENGTHS))
def test_transport_moves_pinned_blocks_intact(spawn, medium, name):
    if medium == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank")
    length = LENGTHS[name]
    n_blocks = length // BLOCK
    num_blocks = 2 * n_blocks + 8
    src_ids = list(range(num_blocks - 1, num_blocks - 1 - n_blocks, -1))  # scattered, reversed
    dst_ids = list(range(3, 3 + n_blocks))
    tokens = [3 + (j * 7) % 500 for j in range(length)]
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_source, args=(child, "cuda:0", num_blocks, tokens, src_ids))
    proc.start()
    try:
        locator = parent.recv()
        dst_device = "cuda:1" if medium == "nccl" else "cuda:0"
        dst = _cache(num_blocks, dst_device, seed=None)
        spec = ReadSpec(locator, "h", medium, tokens, 0, dst_ids, 120.0)
        read(spec, dst)  # warm-up: connections, IPC mapping, NCCL communicator
        for t in dst.tensors.values():
            t.zero_()
        t0 = time.perf_counter()
        got = read(spec, dst)
        seconds = time.perf_counter() - t0
        assert got == n_blocks
        expected = _cache(num_blocks, dst_device, seed=7)  # the source's fill, regenerated
        for layer, t in dst.tensors.items():
            idx_dst = torch.tensor(dst_ids, device=t.device)
            idx_src = torch.tensor(src_ids, device=t.device)
            assert torch.equal(
                t.index_select(1, idx_dst), expected.tensors[layer].index_select(1, idx_src)
            ), layer
        nbytes = length * BYTES_PER_TOKEN
        _record(
            {
                "test": "transport",
                "medium": medium,
                "prefix": name,
                "bytes": nbytes,
                "seconds": seconds,
                "bytes_per_s": nbytes / seconds,
            }
        )
    finally:
        parent.send("done")
        proc.join(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from apps.model.tiny import build_tiny_model

    return os.environ.get("GYRE_GPU_MODEL_DIR") or str(
        build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    )


@pytest.mark.vllm
@pytest.mark.parametrize("medium", ["cuda_ipc", "tcp"])
async def test_vllm_handoff_on_gpu_is_token_identical_and_cached(model_dir, medium):
    from services.cell_agent.engines.base import Sampling
    from services.cell_agent.engines.vllm_engine import VllmEngine

    def engine(cell: str) -> VllmEngine:
        return VllmEngine(
            model_dir,
            max_model_len=16384 + 512,
            max_num_seqs=8,
            cell_id=cell,
            gpu_memory_utilization=0.3,
            kv_medium=medium,
        )

    src, dst = engine("src"), engine("dst")
    await src.start()
    await dst.start()
    try:
        for name, length in LENGTHS.items():
            prompt = [3 + (j * 11 + length) % 500 for j in range(length)]
            full = [
                t
                async for c in src.generate(f"ref-{name}", prompt, Sampling(max_tokens=24))
                for t in c.token_ids
            ]
            live = src.generate(f"live-{name}", prompt, Sampling(max_tokens=24))
            got: list[int] = []
            async for c in live:
                got += c.token_ids
                if len(got) >= 8:
                    break
            handle = await src.export_kv(f"live-{name}")
            await src.abort(f"live-{name}")
            await live.aclose()
            assert handle is not None
            timings = {}
            for label, h, rid in (("handoff", handle, f"kv-{name}"), ("recompute", None, f"re-{name}")):
                cont = prompt + got if label == "handoff" else [t + 1 for t in prompt] + got
                t0 = time.perf_counter()
                first = None
                rest: list[int] = []
                async for c in dst.generate(rid, cont, Sampling(max_tokens=24 - len(got)), kv_handle=h):
                    if first is None and c.token_ids:
                        first = time.perf_counter() - t0
                    rest += c.token_ids
                timings[label] = first
                if label == "handoff":
                    assert got + rest == full
                    assert dst.cached_tokens[rid] >= len(cont) - 128
            await src.release_kv(handle.handle_id)
            _record(
                {
                    "test": "vllm_handoff",
                    "medium": medium,
                    "prefix": name,
                    "ttft_handoff_s": timings["handoff"],
                    "ttft_recompute_s": timings["recompute"],
                    "handoff_vs_recompute": timings["handoff"] / timings["recompute"],
                }
            )
        assert src.pinned_kv == 0
    finally:
        await dst.shutdown()
        await src.shutdown()
