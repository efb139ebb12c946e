"""The engine as the router sees it: domain types of a token-level call and the small
interface every engine client implements (the gRPC client, and fakes in unit tests)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator
from typing import Protocol

from gyre.kv import KvHandle  # noqa: F401  (re-exported)
from gyre.sampling import Sampling  # noqa: F401  (re-exported)
from gyre.v1 import cell_agent_pb2, common_pb2


class Finish(enum.Enum):
    """Why a stream ended (mirrors gyre.v1.FinishReason)."""

    LENGTH = common_pb2.FINISH_REASON_LENGTH
    STOP = common_pb2.FINISH_REASON_STOP
    ABORT = common_pb2.FINISH_REASON_ABORT

    @classmethod
    def from_proto(cls, value: int) -> Finish | None:
        return None if value == common_pb2.FINISH_REASON_UNSPECIFIED else cls(value)

    @property
    def openai(self) -> str:
        """The OpenAI ``finish_reason`` string."""
        return {Finish.LENGTH: "length", Finish.STOP: "stop", Finish.ABORT: "abort"}[self]


@dataclasses.dataclass
class Chunk:
    """Generated tokens of one engine step (or several, once coalesced)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish: Finish | None = None
    text: str = ""
    """The text these tokens add (HTTP calls only; the router detokenizes, see stops.py)."""

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenChunk) -> Chunk:
        ids = list(msg.token_ids)
        logprobs = list(msg.logprobs)
        if len(logprobs) != len(ids):
            # An engine that sends no log-probs still produces a well-formed record.
            logprobs = (logprobs + [0.0] * len(ids))[: len(ids)]
        return cls(ids, logprobs, int(msg.policy_version), Finish.from_proto(msg.finish_reason))

    def to_proto(self) -> common_pb2.TokenChunk:
        return common_pb2.TokenChunk(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            policy_version=self.policy_version,
            finish_reason=self.finish.value if self.finish else common_pb2.FINISH_REASON_UNSPECIFIED,
        )


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
