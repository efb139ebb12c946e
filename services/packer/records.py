"""The records the packer's state is made of: executions, groups (and their lifecycle),
micro-steps and batches, and the event type that changes them. :mod:`services.packer.state`
holds them in a :class:`~services.packer.state.PackerState`; :mod:`services.packer.snapshot`
writes and restores them."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from gyre.errors import FatalError
from gyre.ids import BatchId, CellId, ExecutionId, GroupId
from services.packer.model import Finish, Turn

SeqRef = tuple[str, int]
"""(execution_id, turn_index) of a turn, or of a segment's first turn."""

Event = dict[str, Any]


class GroupState(enum.Enum):
    """Lifecycle of a group: collecting -> ready -> assigned -> done, or dropped."""

    COLLECTING = "collecting"
    READY = "ready"
    ASSIGNED = "assigned"
    DONE = "done"
    DROPPED = "dropped"


_GROUP_TRANSITIONS = {
    GroupState.COLLECTING: {GroupState.READY, GroupState.DROPPED},
    GroupState.READY: {GroupState.ASSIGNED, GroupState.DROPPED},
    GroupState.ASSIGNED: {GroupState.DONE},
    GroupState.DONE: set(),
    GroupState.DROPPED: set(),
}


@dataclasses.dataclass
class Execution:
    """One execution's turns and, once closed, its finish report."""

    id: ExecutionId
    group_id: GroupId
    turns: dict[int, Turn] = dataclasses.field(default_factory=dict)
    finish: Finish | None = None
    segments: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # first turn -> its turns
    call_keys: dict[str, int] = dataclasses.field(default_factory=dict)  # idempotency key -> turn index


@dataclasses.dataclass
class Group:
    """The executions of one task; ready when ``size`` of them have closed."""

    id: GroupId
    size: int = 0  # 0 until the first finish report says
    execs: dict[str, Execution] = dataclasses.field(default_factory=dict)
    state: GroupState = GroupState.COLLECTING
    batch_id: int = 0
    advantages: dict[str, float] = dataclasses.field(default_factory=dict)
    oldest_version: int = 0
    gone: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # dropped members' turns

    @property
    def closed(self) -> int:
        return sum(1 for e in self.execs.values() if e.finish is not None)

    @property
    def turns(self) -> int:
        return sum(len(e.turns) for e in self.execs.values())

    def transition(self, to: GroupState) -> None:
        if to not in _GROUP_TRANSITIONS[self.state]:
            raise FatalError(f"group {self.id}: illegal transition {self.state.value} -> {to.value}")
        self.state = to


@dataclasses.dataclass
class MicroStep:
    """A packed piece of a batch, and who holds or trained it."""

    id: str
    batch_id: int
    index: int
    seqs: list[SeqRef]  # its segments (by first turn)
    n_seqs: int  # turns in those segments (conservation counts turns)
    loss_tokens: int
    packed_tokens: int
    holder: CellId | None = None
    deadline: float = 0.0  # runtime only: when the holder's claim lapses
    acked_by: CellId | None = None
    released_from: CellId | None = None  # whose claim lapsed last (may still ack late)
    committed: bool = False  # trained for good (its batch's step is durable)

    @property
    def free(self) -> bool:
        return self.holder is None and self.acked_by is None


@dataclasses.dataclass
class Batch:
    """Groups trained by one optimizer step, on one weight version."""

    id: BatchId
    size: int
    version: int | None = None  # pinned by the first claim (the batch is active from then)
    groups: list[str] = dataclasses.field(default_factory=list)
    # Assigned, not emitted: an ordered set (an emit takes its segments out in O(its size)).
    pending: dict[SeqRef, None] = dataclasses.field(default_factory=dict)
    micro_steps: list[MicroStep] = dataclasses.field(default_factory=list)
    free: dict[str, None] = dataclasses.field(default_factory=dict)  # claimable ids, in order
    participants: set[str] = dataclasses.field(default_factory=set)
    sealed: bool = False
    closed: bool = False
    done: bool = False
    total_loss_tokens: int = 0
    acked: int = 0
    packed_seqs: int = 0  # turns in emitted, uncommitted micro-steps
    attempt: int = 0  # OpenBatch calls: > 0 makes acks leases until the commit
    committed: bool = False  # the core's step is durable: trained for good
    claim_keys: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (cell, key) -> ms

    @property
    def leased(self) -> bool:
        """Acks are leases (the core opened the batch and will commit it)."""
        return self.attempt > 0

    @property
    def active(self) -> bool:
        return self.version is not None

    @property
    def needs(self) -> int:
        return 0 if self.sealed else max(self.size - len(self.groups), 0)

    @property
    def claimed(self) -> int:
        return sum(1 for m in self.micro_steps if m.holder is not None)

    @property
    def unclaimed(self) -> int:
        return len(self.free)
