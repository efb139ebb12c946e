"""Engines of a cell (one interface, :mod:`.base`): the vLLM engine and the mock engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.cell_agent.engines.base import Chunk, Engine, EngineDead, FinishReason, KvHandle, Sampling

if TYPE_CHECKING:
    from services.cell_agent.config import CellAgentConfig

__all__ = ["Chunk", "Engine", "EngineDead", "FinishReason", "KvHandle", "Sampling", "build_engine"]


def build_engine(cfg: CellAgentConfig) -> Engine:
    """The engine the config names (not started)."""
    if cfg.engine == "vllm":
        from gyre.grpcx.tls import process_tls
        from services.cell_agent.engines.vllm_engine import VllmEngine

        if not cfg.model_dir:
            raise ValueError("engine=vllm needs model_dir")
        return VllmEngine(
            cfg.model_dir,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            seed=cfg.engine_seed,
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            policy_version=cfg.policy_version,
            cell_id=cfg.cell_id,
            kv_handoff=cfg.kv_handoff,
            kv_medium=cfg.kv_medium,
            kv_host=cfg.kv_host,
            kv_pin_ttl_s=cfg.kv_pin_ttl_s,
            kv_read_timeout_s=cfg.kv_read_timeout_s,
            kv_tls=process_tls(),
        )
    from services.cell_agent.engines.mock import MockEngine, MockFaults, MockTiming

    mock = cfg.mock
    timing = MockTiming(**mock.timing())
    faults = MockFaults(die_after_tokens=mock.die_after_tokens, hang_after_tokens=mock.hang_after_tokens)
    return MockEngine(
        timing=timing,
        faults=faults,
        vocab_size=mock.vocab_size,
        max_batch=mock.max_batch,
        # The mock's model (its fingerprint: model_dir's weights, or a fixed one) is the same
        # on every cell; only what unseeded sampled requests draw is the cell's own.
        sampling_seed=cfg.engine_seed,
        model_dir=cfg.model_dir,
        cell_id=cfg.cell_id,
        kv_dir=cfg.kv_dir or mock.kv_dir,
        kv_pin_ttl_s=cfg.kv_pin_ttl_s,
        policy_version=cfg.policy_version,
    )
