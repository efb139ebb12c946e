"""The domain form of the packer's micro-steps (validated at the proto edge)."""

from __future__ import annotations

import dataclasses
import enum
import math

from gyre.errors import InvalidArgument
from gyre.v1 import packer_pb2 as ppb


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One packed training sequence: prompt + output tokens, aligned mask and log-probs."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    advantage: float
    execution_id: str = ""
    policy_versions: tuple[int, ...] = ()
    """Policy version of each token (0 where not generated); empty: unknown (lag 0)."""
    temperature: float = 1.0
    """The temperature the engine sampled at; the trainer scores tokens at it (0: greedy,
    scored at 1)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n < 2:
            raise InvalidArgument("a training sequence needs at least 2 tokens")
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise InvalidArgument(
                f"sequence lengths differ: tokens {n}, mask {len(self.loss_mask)}, logprobs {len(self.logprobs)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise InvalidArgument("loss_mask values must be 0 or 1")
        if any(t < 0 for t in self.token_ids):
            raise InvalidArgument("negative token id")
        if self.policy_versions and len(self.policy_versions) != n:
            raise InvalidArgument(f"policy_versions has {len(self.policy_versions)} entries for {n} tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument("temperature must be finite and >= 0")
        if not math.isfinite(self.advantage):
            raise InvalidArgument("advantage must be finite")
        if any(not math.isfinite(lp) or lp > 1e-6 for lp, m in zip(self.logprobs, self.loss_mask) if m):
            raise InvalidArgument("behaviour log-probs of trained tokens must be finite and <= 0")

    @property
    def num_loss_tokens(self) -> int:
        # Position 0 has no context to predict it from: it is never trained.
        return sum(self.loss_mask[1:])

    @classmethod
    def from_proto(cls, m: ppb.PackedSequence) -> Sequence:
        return cls(
            token_ids=tuple(m.token_ids),
            loss_mask=tuple(m.loss_mask) if len(m.loss_mask) else (1,) * len(m.token_ids),
            logprobs=tuple(m.logprobs),
            advantage=m.advantage,
            execution_id=m.execution_id,
            policy_versions=tuple(m.token_policy_versions),
            temperature=m.temperature if m.HasField("temperature") else 1.0,
        )

    def to_proto(self) -> ppb.PackedSequence:
        return ppb.PackedSequence(
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            advantage=self.advantage,
            execution_id=self.execution_id,
            token_policy_versions=list(self.policy_versions),
            temperature=self.temperature,
        )


@dataclasses.dataclass(frozen=True)
class MicroStep:
    """A claimed piece of a batch."""

    micro_step_id: str
    batch_id: int
    sequences: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_loss_tokens for s in self.sequences)

    @classmethod
    def from_proto(cls, m: ppb.MicroStep) -> MicroStep:
        if not m.micro_step_id:
            raise InvalidArgument("micro_step_id is empty")
        if not m.sequences:
            raise InvalidArgument(f"micro-step {m.micro_step_id} has no sequences")
        return cls(m.micro_step_id, m.batch_id, tuple(Sequence.from_proto(s) for s in m.sequences))

    def to_proto(self) -> ppb.MicroStep:
        return ppb.MicroStep(
            micro_step_id=self.micro_step_id,
            batch_id=self.batch_id,
            sequences=[s.to_proto() for s in self.sequences],
            num_tokens=self.num_tokens,
        )


class Outcome(enum.Enum):
    """What a claim returned (the packer's ClaimOutcome)."""

    CLAIMED = "claimed"
    WAIT = "wait"
    CLOSED = "closed"

    @classmethod
    def from_proto(cls, value: int) -> Outcome:
        table: dict[int, Outcome] = {
            ppb.CLAIM_OUTCOME_CLAIMED: cls.CLAIMED,
            ppb.CLAIM_OUTCOME_WAIT: cls.WAIT,
            ppb.CLAIM_OUTCOME_CLOSED: cls.CLOSED,
        }
        if value not in table:
            raise InvalidArgument(f"unknown claim outcome {value}")
        return table[value]

    def to_proto(self) -> int:
        return {
            Outcome.CLAIMED: ppb.CLAIM_OUTCOME_CLAIMED,
            Outcome.WAIT: ppb.CLAIM_OUTCOME_WAIT,
            Outcome.CLOSED: ppb.CLAIM_OUTCOME_CLOSED,
        }[self]


@dataclasses.dataclass(frozen=True)
class Claim:
    """One claim's answer: a micro-step when CLAIMED."""

    outcome: Outcome
    micro_step: MicroStep | None = None
    ttl_s: float = 0.0
