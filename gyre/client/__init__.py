"""The harness client: what an agent harness uses to take part in Gyre.

Light on purpose: it needs grpcio, protobuf and aiohttp, never torch or vLLM.

    async with HarnessClient("127.0.0.1:50051", harness_id="h1", tls_dir="CERTS/harness") as client:
        while (execution := await client.acquire(wait_s=5)) is not None:
            async with execution:                      # heartbeats in the background
                text = await execution.chat([{"role": "user", "content": "hi"}])
                await execution.finish(reward=1.0)     # idempotent; retried safely

Any OpenAI-compatible client works against ``execution.openai_base_url`` with
``api_key=execution.token`` and ``model=execution.model``.
"""

from gyre.client.harness import ExecutionHandle, HarnessClient, NoExecution

__all__ = ["HarnessClient", "ExecutionHandle", "NoExecution"]
