"""The packer's domain types (turns, finish reports, packed sequences, micro-steps), their
validation, and their conversion to and from the wire (the only module that knows protos)."""

from __future__ import annotations

import array
import dataclasses
import enum
import functools
import math
import zlib
from collections.abc import Container, Iterable
from typing import Any

from gyre.errors import InvalidArgument, ResourceExhausted
from gyre.execution import ExecutionStatus
from gyre.ids import BatchId, CellId, ExecutionId, GroupId, PolicyVersion, check_idempotency_key
from gyre.v1 import packer_pb2
from services.packer.segments import Segment

MAX_ID_CHARS = 256
"""Longest accepted execution, group or cell id."""

MAX_CHAT_STATE_CHARS = 256
"""Longest accepted TurnRecord.chat_state."""

DEFAULT_TEMPERATURE = 1.0
"""A turn's sampling temperature when its record has none (TurnRecord.temperature unset)."""

MAX_ABS_REWARD = 1e9
"""Default bound on |reward| (PackerConfig.max_abs_reward). Finite bounds on both ends keep
the group statistics finite: the squares in a std overflow to inf near 1e154, and an
advantage of inf or NaN cannot be written to the WAL (nor trained)."""


class ClaimOutcome(enum.Enum):
    """What a claim got."""

    CLAIMED = "claimed"
    WAIT = "wait"
    CLOSED = "closed"


def check_id(value: str, what: str, max_chars: int = MAX_ID_CHARS) -> str:
    """A non-empty id of bounded length without control characters."""
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > max_chars:
        raise InvalidArgument(f"{what} longer than {max_chars} characters")
    if any(ord(c) < 32 for c in value):
        raise InvalidArgument(f"{what} contains control characters")
    return value


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model call of an execution, as the router recorded it."""

    execution_id: ExecutionId
    group_id: GroupId
    turn_index: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]  # per output token; empty: unknown (the finish's version is used)
    mask: tuple[int, ...]  # per output token, 0/1; never empty after validation
    call_key: str = ""
    """The harness's idempotency key for the model call ("": none); not part of the digest."""
    chat_state: str = ""
    """The router's digest of what a chat call was rendered from and answered ("": a
    token-level call); kept for GetTrajectory, opaque here, not part of the digest."""
    temperature: float = DEFAULT_TEMPERATURE
    """The call's sampling temperature (0: greedy), finite and >= 0; a record without one
    (and a WAL entry from before the field) has 1. The trainer scores the tokens at it, so a
    segment never mixes temperatures (:func:`services.packer.segments.continues`)."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.execution_id, self.turn_index)

    @property
    def tokens(self) -> int:
        """All tokens of the packed sequence (what the micro-step budget bounds)."""
        return len(self.prompt) + len(self.output)

    @functools.cached_property
    def loss_tokens(self) -> int:
        # Cached (the fields are tuples, never changed): every emit and claim reads it.
        return sum(self.mask)

    @functools.cached_property
    def _min_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    def oldest_version(self, fallback: int) -> int:
        v = self._min_version  # cached: every claimed sequence asks (a min over its tokens)
        return fallback if v is None else v

    def digest(self) -> int:
        """A content checksum, to tell an idempotent retry from a conflicting duplicate
        (stable across processes, unlike ``hash``)."""
        head = (
            f"{self.execution_id}\0{self.group_id}\0{self.turn_index}\0{len(self.prompt)}\0"
            f"{len(self.output)}\0{len(self.versions)}"
        )
        h = zlib.crc32(head.encode())
        for ints in (self.prompt, self.output, self.versions, self.mask):
            h = zlib.crc32(array.array("q", ints).tobytes(), h)
        if self.temperature != DEFAULT_TEMPERATURE:
            # Only then: the digests of turns from before the field (kept in snapshots) stay.
            h = zlib.crc32(array.array("d", (self.temperature,)).tobytes(), h)
        return zlib.crc32(array.array("d", self.logprobs).tobytes(), h)

    @classmethod
    def validated(
        cls,
        execution_id: str,
        group_id: str,
        turn_index: int,
        prompt: Iterable[int],
        output: Iterable[int],
        logprobs: Iterable[float],
        versions: Iterable[int],
        mask: Iterable[int],
        max_tokens: int,
        call_key: str = "",
        chat_state: str = "",
        temperature: float = DEFAULT_TEMPERATURE,
    ) -> Turn:
        """Checks every field; raises InvalidArgument or ResourceExhausted (too long)."""
        check_id(execution_id, "execution_id")
        check_id(group_id, "group_id")
        if turn_index < 0:
            raise InvalidArgument(f"turn_index must be >= 0, got {turn_index}")
        prompt_t, output_t = tuple(prompt), tuple(output)
        logprobs_t, versions_t, mask_t = tuple(logprobs), tuple(versions), tuple(mask)
        if len(prompt_t) + len(output_t) > max_tokens:
            raise ResourceExhausted(
                f"turn has {len(prompt_t) + len(output_t)} tokens; a micro-step holds at most {max_tokens}"
            )
        if not output_t:
            raise InvalidArgument("output_token_ids is empty: nothing to train on")
        if not prompt_t:
            # Every model call has a prompt; and position 0 of a sequence is never trained
            # (nothing precedes it), so an output token there would be lost silently.
            raise InvalidArgument("prompt_token_ids is empty")
        if any(t < 0 for t in prompt_t) or any(t < 0 for t in output_t):
            raise InvalidArgument("token ids must be >= 0")
        if len(logprobs_t) != len(output_t):
            raise InvalidArgument(
                f"output_logprobs has {len(logprobs_t)} entries for {len(output_t)} output tokens"
            )
        for lp in logprobs_t:
            if not math.isfinite(lp) or lp > 1e-6:
                raise InvalidArgument(f"output_logprobs must be finite and <= 0, got {lp!r}")
        if versions_t and len(versions_t) != len(output_t):
            raise InvalidArgument(
                f"output_policy_versions has {len(versions_t)} entries for {len(output_t)} output tokens"
            )
        if any(v < 0 for v in versions_t):
            raise InvalidArgument("policy versions must be >= 0")
        if mask_t:
            if len(mask_t) != len(output_t):
                raise InvalidArgument(
                    f"output_loss_mask has {len(mask_t)} entries for {len(output_t)} output tokens"
                )
            if any(m not in (0, 1) for m in mask_t):
                raise InvalidArgument("output_loss_mask entries must be 0 or 1")
        else:
            mask_t = (1,) * len(output_t)
        if call_key:
            check_idempotency_key(call_key)
        if chat_state:
            check_id(chat_state, "chat_state", MAX_CHAT_STATE_CHARS)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidArgument(f"temperature must be finite and >= 0, got {temperature!r}")
        return cls(
            ExecutionId(execution_id),
            GroupId(group_id),
            turn_index,
            prompt_t,
            output_t,
            tuple(float(x) for x in logprobs_t),
            versions_t,
            mask_t,
            call_key,
            chat_state,
            float(temperature) + 0.0,  # + 0.0: -0.0 is 0.0 (one digest, one JSON form)
        )

    @classmethod
    def from_proto(cls, msg: packer_pb2.TurnRecord, max_tokens: int) -> Turn:
        return cls.validated(
            msg.execution_id,
            msg.group_id,
            msg.turn_index,
            msg.prompt_token_ids,
            msg.output_token_ids,
            msg.output_logprobs,
            msg.output_policy_versions,
            msg.output_loss_mask,
            max_tokens,
            msg.idempotency_key,
            msg.chat_state,
            msg.temperature if msg.HasField("temperature") else DEFAULT_TEMPERATURE,
        )

    def to_proto(self) -> packer_pb2.TurnRecord:
        return packer_pb2.TurnRecord(
            execution_id=self.execution_id,
            group_id=self.group_id,
            turn_index=self.turn_index,
            prompt_token_ids=self.prompt,
            output_token_ids=self.output,
            output_logprobs=self.logprobs,
            output_policy_versions=self.versions,
            output_loss_mask=self.mask,
            idempotency_key=self.call_key,
            chat_state=self.chat_state,
            temperature=self.temperature,
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "x": self.execution_id,
            "g": self.group_id,
            "i": self.turn_index,
            "p": list(self.prompt),
            "o": list(self.output),
            "lp": list(self.logprobs),
            "v": list(self.versions),
            "m": list(self.mask),
        }
        if self.call_key:
            out["k"] = self.call_key
        if self.chat_state:
            out["c"] = self.chat_state
        if self.temperature != DEFAULT_TEMPERATURE:
            out["T"] = self.temperature  # absent: 1 (so WALs from before the field read alike)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Turn:
        return cls(
            ExecutionId(d["x"]),
            GroupId(d["g"]),
            int(d["i"]),
            tuple(d["p"]),
            tuple(d["o"]),
            tuple(float(x) for x in d["lp"]),
            tuple(d["v"]),
            tuple(d["m"]),
            str(d.get("k", "")),
            str(d.get("c", "")),
            float(d.get("T", DEFAULT_TEMPERATURE)),
        )


@dataclasses.dataclass(frozen=True)
class Finish:
    """The scheduler's report that an execution closed, with its reward."""

    execution_id: ExecutionId
    group_id: GroupId
    group_size: int
    status: ExecutionStatus
    reward: float
    policy_version: PolicyVersion

    @classmethod
    def validated(
        cls,
        execution_id: str,
        group_id: str,
        group_size: int,
        status: ExecutionStatus | None,
        reward: float,
        policy_version: int,
        max_group_size: int,
        max_abs_reward: float = MAX_ABS_REWARD,
    ) -> Finish:
        check_id(execution_id, "execution_id")
        check_id(group_id, "group_id")
        if not 1 <= group_size <= max_group_size:
            raise InvalidArgument(f"group_size must be in 1..{max_group_size}, got {group_size}")
        if status is None:
            raise InvalidArgument("status must be COMPLETED, FAILED, TIMED_OUT or CANCELLED")
        if not math.isfinite(reward):
            raise InvalidArgument(f"reward must be finite, got {reward!r}")
        if abs(reward) > max_abs_reward:
            raise InvalidArgument(
                f"reward must be in [-{max_abs_reward:g}, {max_abs_reward:g}], got {reward!r}"
            )
        if policy_version < 0:
            raise InvalidArgument(f"policy_version must be >= 0, got {policy_version}")
        return cls(
            ExecutionId(execution_id),
            GroupId(group_id),
            group_size,
            status,
            float(reward),
            PolicyVersion(policy_version),
        )

    @classmethod
    def from_proto(
        cls, msg: packer_pb2.FinishReport, max_group_size: int, max_abs_reward: float = MAX_ABS_REWARD
    ) -> Finish:
        return cls.validated(
            msg.execution_id,
            msg.group_id,
            msg.group_size,
            ExecutionStatus.closed_from_proto(msg.status),
            msg.reward,
            msg.policy_version,
            max_group_size,
            max_abs_reward,
        )

    def to_proto(self) -> packer_pb2.FinishReport:
        return packer_pb2.FinishReport(
            execution_id=self.execution_id,
            group_id=self.group_id,
            group_size=self.group_size,
            status=self.status.to_proto(),
            reward=self.reward,
            policy_version=self.policy_version,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "x": self.execution_id,
            "g": self.group_id,
            "n": self.group_size,
            "s": self.status.value.lower(),  # the WAL's spelling: completed, timed_out, ...
            "r": self.reward,
            "v": self.policy_version,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finish:
        return cls(
            ExecutionId(d["x"]),
            GroupId(d["g"]),
            int(d["n"]),
            ExecutionStatus.from_name(d["s"]),
            float(d["r"]),
            PolicyVersion(int(d["v"])),
        )


@dataclasses.dataclass(frozen=True)
class PackedSequence:
    """One trajectory segment ready to train (see :mod:`services.packer.segments`): all its
    tokens once, loss mask, log-probs and policy versions aligned."""

    segment: Segment
    advantage: float
    policy_version: int  # oldest version among its output tokens

    def encode(self) -> bytes:
        """Its wire form (a serialized ``PackedSequence``), what :class:`WireCache` keeps."""
        return self.to_proto().SerializeToString()

    def to_proto(self) -> packer_pb2.PackedSequence:
        first = self.segment.turns[0]
        ids, mask, logprobs, versions = self.segment.arrays()
        return packer_pb2.PackedSequence(
            token_ids=ids,
            loss_mask=mask,
            logprobs=logprobs,
            advantage=self.advantage,
            execution_id=first.execution_id,
            group_id=first.group_id,
            turn_index=first.turn_index,
            policy_version=self.policy_version,
            token_policy_versions=versions,
            turns=len(self.segment.turns),
            temperature=first.temperature,  # every turn's (a segment never mixes them)
        )


@dataclasses.dataclass(frozen=True)
class MicroStepView:
    """A claimed micro-step as handed to a cell."""

    micro_step_id: str
    batch_id: BatchId
    policy_version: int
    sequences: tuple[PackedSequence, ...]
    loss_tokens: int
    packed_tokens: int

    def encode(self, sequences: Iterable[bytes]) -> bytes:
        """A serialized ``MicroStep`` from its sequences' wire forms, without re-encoding
        them: the same bytes ``to_proto().SerializeToString()`` gives (fields in number
        order; each sequence is field 3 as tag + length + bytes)."""
        head = packer_pb2.MicroStep(micro_step_id=self.micro_step_id, batch_id=self.batch_id)
        tail = packer_pb2.MicroStep(
            num_tokens=self.loss_tokens, policy_version=self.policy_version, packed_tokens=self.packed_tokens
        )
        return b"".join(
            (
                head.SerializeToString(),
                *(_LEN_FIELD_3 + _varint(len(b)) + b for b in sequences),
                tail.SerializeToString(),
            )
        )

    def to_proto(self) -> packer_pb2.MicroStep:
        return packer_pb2.MicroStep(
            micro_step_id=self.micro_step_id,
            batch_id=self.batch_id,
            sequences=[s.to_proto() for s in self.sequences],
            num_tokens=self.loss_tokens,
            policy_version=self.policy_version,
            packed_tokens=self.packed_tokens,
        )


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """The answer to a claim."""

    outcome: ClaimOutcome
    batch_id: BatchId
    policy_version: int
    ttl_s: float
    micro_step: MicroStepView | None = None

    def encode_many(self, micro_steps: Iterable[bytes]) -> bytes:
        """A serialized ``ClaimMicroStepsResponse`` around encoded micro-steps (see
        :meth:`MicroStepView.encode`; field 2, repeated, each as tag + length + bytes): the
        bytes ``to_proto_many`` serializes to (fields in number order: 1 outcome, 2 the
        micro-steps, 3 claim_ttl_s, 4 batch_id, 5 policy_version)."""
        head = packer_pb2.ClaimMicroStepsResponse(outcome=_OUTCOME_TO_PROTO[self.outcome])
        tail = packer_pb2.ClaimMicroStepsResponse(
            claim_ttl_s=self.ttl_s, batch_id=self.batch_id, policy_version=self.policy_version
        )
        field_2 = b"".join(_LEN_FIELD_2 + _varint(len(b)) + b for b in micro_steps)
        return head.SerializeToString() + field_2 + tail.SerializeToString()

    def to_proto_many(self, views: list[MicroStepView]) -> packer_pb2.ClaimMicroStepsResponse:
        """The answer to a batched claim that took ``views`` (this result is its first claim's)."""
        resp = packer_pb2.ClaimMicroStepsResponse(
            outcome=_OUTCOME_TO_PROTO[self.outcome],
            claim_ttl_s=self.ttl_s,
            batch_id=self.batch_id,
            policy_version=self.policy_version,
        )
        resp.micro_steps.extend(v.to_proto() for v in views)
        return resp


_OUTCOME_TO_PROTO = {
    ClaimOutcome.CLAIMED: packer_pb2.CLAIM_OUTCOME_CLAIMED,
    ClaimOutcome.WAIT: packer_pb2.CLAIM_OUTCOME_WAIT,
    ClaimOutcome.CLOSED: packer_pb2.CLAIM_OUTCOME_CLOSED,
}
_LEN_FIELD_2 = bytes([2 << 3 | 2])  # tag of field 2, wire type 2 (length-delimited)
_LEN_FIELD_3 = bytes([3 << 3 | 2])


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint of ``n`` >= 0 (a length prefix)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class WireCache:
    """Pre-encoded ``PackedSequence``s, so that a claim never re-encodes one.

    A sequence is encoded once (when its group becomes ready, or on its first claim after
    a restart) and kept under its execution and turn indexes; an entry answers only for
    the very same turns, advantage and policy version it was made from (else it is
    encoded afresh), so a stale entry can never be handed out, and a redelivered
    micro-step gets the same bytes. ``keep`` drops the executions the packer let go of."""

    def __init__(self) -> None:
        self._by_exec: dict[str, dict[tuple[int, ...], tuple[PackedSequence, bytes]]] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_exec.values())

    def put(self, seq: PackedSequence) -> bytes:
        data = seq.encode()
        key = tuple(t.turn_index for t in seq.segment.turns)
        self._by_exec.setdefault(seq.segment.last.execution_id, {})[key] = (seq, data)
        return data

    def get(self, seq: PackedSequence) -> bytes:
        """The wire form of ``seq``: the cached one when it was made from the same content."""
        turns = seq.segment.turns
        entry = self._by_exec.get(turns[-1].execution_id, {}).get(tuple(t.turn_index for t in turns))
        if entry is not None:
            cached, data = entry
            if (
                cached.advantage == seq.advantage
                and cached.policy_version == seq.policy_version
                and len(cached.segment.turns) == len(turns)
                and all(a is b for a, b in zip(cached.segment.turns, turns, strict=True))
            ):
                self.hits += 1
                return data
        self.misses += 1
        return self.put(seq)

    def micro_step(self, view: MicroStepView) -> bytes:
        return view.encode(self.get(s) for s in view.sequences)

    def keep(self, executions: Container[str]) -> int:
        """Drops the entries of executions not in ``executions``; returns how many went."""
        gone = [x for x in self._by_exec if x not in executions]
        n = 0
        for x in gone:
            n += len(self._by_exec.pop(x))
        return n


def check_cell(cell_id: str) -> CellId:
    return CellId(check_id(cell_id, "cell_id"))
