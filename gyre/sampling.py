"""Sampling parameters of one model call: the domain form of ``gyre.v1.SamplingParams``,
shared by the router (which validates what harnesses send) and the engines (which validate
again at their own edge)."""

from __future__ import annotations

import dataclasses

from gyre.errors import InvalidArgument
from gyre.v1 import common_pb2

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one model call (validated). Greedy when ``temperature == 0``."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self, max_tokens_limit: int = 1 << 20) -> Sampling:
        if not 1 <= self.max_tokens <= max_tokens_limit:
            raise InvalidArgument(f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:  # also refuses NaN
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if not INT64_MIN <= self.seed <= INT64_MAX:
            raise InvalidArgument(f"seed must fit a signed 64-bit integer, got {self.seed}")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidArgument(f"stop_token_ids must be in [0, {INT32_MAX}]")
        return self

    @classmethod
    def from_proto(
        cls,
        msg: common_pb2.SamplingParams,
        max_tokens_limit: int = 1 << 20,
        default_stop: tuple[int, ...] = (),
    ) -> Sampling:
        """Validated; an unset top_p (0) means 1, unset stop ids mean ``default_stop``."""
        return cls(
            max_tokens=int(msg.max_tokens),
            temperature=float(msg.temperature),
            top_p=float(msg.top_p) if msg.top_p else 1.0,
            seed=int(msg.seed),
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids) or default_stop,
        ).validate(max_tokens_limit)

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=list(self.stop_token_ids),
        )
