"""The engine as the router sees it: domain types of a token-level call and the small
interface every engine client implements (the gRPC client, and fakes in unit tests)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from gyre.kv import KvHandle  # noqa: F401  (re-exported)
from gyre.sampling import Sampling  # noqa: F401  (re-exported)
from gyre.tokens import Chunk, FinishReason  # noqa: F401  (re-exported)
from gyre.v1 import cell_agent_pb2


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One attempt of a model call at one engine."""

    request_id: str
    execution_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    required_policy_version: int = 0
    kv_handle: KvHandle | None = None

    def to_proto(self) -> cell_agent_pb2.EngineGenerateRequest:
        return cell_agent_pb2.EngineGenerateRequest(
            request_id=self.request_id,
            execution_id=self.execution_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling.to_proto(),
            required_policy_version=self.required_policy_version,
            kv_handle=self.kv_handle.to_proto() if self.kv_handle else None,
        )


class ChunkSink(Protocol):
    """Where an attached request's output goes (engine clients that can ``attach``: the
    GenerateStream client). Both are called synchronously by the client's reader."""

    def on_chunk(self, chunk: Chunk) -> None:
        """New tokens of the request (never its finish: that comes with :meth:`on_end`)."""
        ...

    def on_end(self, finish: FinishReason | None, error: BaseException | None) -> None:
        """The request ended, once: finished (``finish``), failed (``error``, a domain
        error), or neither (the engine stopped it early)."""
        ...


class EngineClient(Protocol):
    """What the router needs from an engine at ``target``. Errors are domain errors."""

    def generate(self, target: str, request: EngineRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        """Streams chunks; closing the iterator cancels the engine request."""
        ...

    async def abort(self, target: str, request_id: str, timeout_s: float) -> None:
        """Aborts a request (idempotent)."""
        ...

    async def export_kv(self, target: str, request_id: str, timeout_s: float) -> KvHandle | None:
        """Pins the request's KV blocks; None when the engine cannot export."""
        ...

    async def release_kv(self, target: str, handle_id: str, timeout_s: float) -> None:
        """Releases pinned blocks (idempotent)."""
        ...
