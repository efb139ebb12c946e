"""The worker-side half of in-place weight updates and of KV pins: a vLLM
``worker_extension_cls`` mixin.

vLLM mixes this class into its worker, so its methods run inside the worker (in-process or
in a worker process) and can reach the model runner. Weights arrive as safetensors bytes
(tensors do not cross vLLM's multiprocess RPC), are parsed here and handed to the model
runner's ``reload_weights``, which maps checkpoint names onto the loaded model in place.

Importing it in the engine core also ties that process's life to the cell agent's
(:func:`gyre.lifeline.die_with_parent`).
"""

from __future__ import annotations

from typing import Any

from gyre.lifeline import die_with_parent

# vLLM imports this module early in its engine-core process (where the worker lives): from
# here on the engine core dies with the cell agent that started it, however the agent dies
# (vLLM 0.32 has no parent-death handling of its own for the engine core).
die_with_parent()


class GyreWorkerExtension:
    """Methods callable through ``AsyncLLM.collective_rpc("gyre_load_weights", ...)``."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def gyre_load_weights(self, blob: bytes) -> int:
        """Loads every tensor of a safetensors blob into the model in place; returns the
        number of tensors loaded."""
        from safetensors.torch import load as st_load

        tensors = st_load(blob)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        return len(tensors)

    def gyre_weight_checksum(self) -> float:
        """A cheap fingerprint of the loaded weights (sum of every parameter), for tests."""
        import torch

        model = self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.float().sum().item() for p in model.parameters()))

    def gyre_kv_pin(
        self, request_ids: list[str], handle_id: str, ttl_s: float
    ) -> tuple[str, str, int] | None:
        """Pins a running request's KV blocks for a handoff (see :mod:`.vllm_kv`); runs in the
        engine process, between steps."""
        from services.cell_agent.engines import vllm_kv

        return vllm_kv.pin(request_ids, handle_id, ttl_s)

    def gyre_kv_release(self, handle_id: str) -> None:
        """Releases a pin (idempotent)."""
        from services.cell_agent.engines import vllm_kv

        vllm_kv.release(handle_id)
