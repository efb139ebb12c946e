"""The small interfaces the training controller drives (packer claims, batch membership,
prefix collectives, policy publication, snapshot pulls), so each has a real and a fake
implementation."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from services.cell_agent.training.microstep import Claim


class MicroStepSource(Protocol):
    """The packer's claim API for one cell. A claim retried with the same ``claim_id``
    answers the same micro-steps. In a batch the core opened (``open_batch``), an ack is a
    lease until the core's ``commit``; opening the batch again (a new attempt after a
    failed one) returns every uncommitted micro-step to the pool."""

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        """Up to ``max_micro_steps`` claims in one call (waiting only for the first): one
        CLAIMED claim per micro-step, or a single WAIT / CLOSED claim."""
        ...

    async def ack_many(self, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        """Acknowledges several micro-steps in one call (all or nothing)."""
        ...

    async def open_batch(self, batch_id: int) -> None: ...

    async def commit(self, batch_id: int) -> None: ...

    async def keep(self) -> None: ...


class JoinResult(enum.Enum):
    """A satellite's registration into a batch."""

    JOINED = "joined"
    CLOSED = "closed"  # the joining window had closed
    NOT_YET = "not_yet"  # the core has not opened the batch, or a predecessor has not joined


class Membership(Protocol):
    """Who takes part in a batch. Blocking calls (run them in a thread).

    The core opens a batch at its weight version; satellites register in index order while
    the window is open and learn that version (they train on exactly it); the core freezes
    the window and everyone learns the final prefix size."""

    def open(self, batch_id: int, version: int) -> None: ...

    def register(self, batch_id: int, index: int) -> tuple[JoinResult, int]:
        """(result, the batch's version)."""
        ...

    def freeze(self, batch_id: int) -> int: ...

    def wait_frozen(self, batch_id: int, timeout_s: float) -> int: ...

    def members(self, batch_id: int) -> int:
        """Cells in the batch so far, the core included (0: not opened)."""
        ...


class Collective(Protocol):
    """Collectives over the prefix group of size ``k`` (ranks 0..k-1; rank 0 is the core).
    Blocking calls; every member of the prefix calls each one in the same order."""

    def reduce_to_core(self, k: int, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduces ``tensor`` into the core's copy: ``op`` "sum" or "max"."""
        ...

    def broadcast_from_core(self, k: int, tensor: torch.Tensor) -> None: ...


class PolicyPublisher(Protocol):
    """Announces a new policy version (etcd ``keys.policy()``)."""

    async def publish(self, version: int, batch_id: int, diagnostics: dict[str, Any] | None = None) -> None:
        """Announces ``version`` (made by ``batch_id``), with the step's loss diagnostics."""
        ...


Puller = Callable[[str, int], Awaitable[tuple[int, dict[str, torch.Tensor]]]]
"""pull(target, version) -> (version, state dict): a WeightSnapshots client."""
