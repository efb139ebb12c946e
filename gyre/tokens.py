"""Generated tokens as both sides of ``gyre.v1.TokenChunk`` see them: the engines that produce
them (``services/cell_agent/engines``) and the router that relays them (``services/router``).
One :class:`FinishReason`, one :class:`Chunk`."""

from __future__ import annotations

import dataclasses
import enum

from gyre.errors import Internal
from gyre.v1 import common_pb2


class FinishReason(enum.Enum):
    """Why a stream ended (mirrors ``gyre.v1.FinishReason``; values are the proto numbers)."""

    LENGTH = common_pb2.FINISH_REASON_LENGTH
    STOP = common_pb2.FINISH_REASON_STOP
    ABORT = common_pb2.FINISH_REASON_ABORT

    @classmethod
    def from_proto(cls, value: int) -> FinishReason | None:
        """None for FINISH_REASON_UNSPECIFIED (the stream goes on)."""
        return None if value == common_pb2.FINISH_REASON_UNSPECIFIED else cls(value)

    @property
    def openai(self) -> str:
        """The OpenAI ``finish_reason`` string."""
        return self.name.lower()


@dataclasses.dataclass
class Chunk:
    """Tokens of one engine step for one request (or several steps, once coalesced)."""

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: FinishReason | None = None
    text: str = ""
    """The text these tokens add (the router's HTTP calls only; it detokenizes, see
    ``services/router/stops.py``); not on the wire."""

    def check(self, source: str = "engine") -> Chunk:
        """This chunk, when it has one behaviour log-prob per token; raises
        :class:`~gyre.errors.Internal` otherwise (a log-prob is never made up: the trainer's
        importance ratios need the sampler's own)."""
        if len(self.logprobs) != len(self.token_ids):
            raise missing_logprobs(len(self.token_ids), len(self.logprobs), source)
        return self

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenChunk) -> Chunk:
        """Raises :class:`~gyre.errors.Internal` when the chunk lacks a log-prob per token."""
        ids = list(msg.token_ids)
        logprobs = list(msg.logprobs)
        if len(logprobs) != len(ids):
            raise missing_logprobs(len(ids), len(logprobs), "engine")
        return cls(ids, logprobs, int(msg.policy_version), FinishReason.from_proto(msg.finish_reason))

    def to_proto(self) -> common_pb2.TokenChunk:
        return common_pb2.TokenChunk(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            policy_version=self.policy_version,
            finish_reason=self.finish_reason.value
            if self.finish_reason
            else common_pb2.FINISH_REASON_UNSPECIFIED,
        )


def missing_logprobs(tokens: int, logprobs: int, source: str) -> Internal:
    """The error for an answer with ``tokens`` tokens but ``logprobs`` log-probs."""
    return Internal(
        f"{source} answered {tokens} token(s) with {logprobs} log-prob(s): every generated "
        "token needs its behaviour log-prob (none is made up)"
    )
