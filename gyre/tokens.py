"""Generated tokens as both sides of ``gyre.v1.TokenChunk`` see them: the engines that produce
them (``services/cell_agent/engines``) and the router that relays them (``services/router``).
One :class:`FinishReason`, one :class:`Chunk`."""

from __future__ import annotations

import dataclasses
import enum

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

    @classmethod
    def from_proto(cls, msg: common_pb2.TokenChunk) -> Chunk:
        ids = list(msg.token_ids)
        logprobs = list(msg.logprobs)
        if len(logprobs) != len(ids):
            # An engine that sends no log-probs still produces a well-formed record.
            logprobs = (logprobs + [0.0] * len(ids))[: len(ids)]
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
