"""The training controller's tunables (:class:`ControllerParams`): how long a claim, a join
and a collective may wait, how many micro-steps a claim takes, how often claims are kept
alive, how many finished batches are remembered and whether the freed heap is returned.
The training service builds them from the cell's ``cell_agent.training`` settings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ControllerParams:
    claim_wait_s: float = 1.0
    join_wait_s: float = 10.0
    collective_timeout_s: float = 600.0
    prefetch: bool = True
    keep_claims_every_s: float = 2.0  # at most; a third of the packer's claim TTL when shorter
    claim_batch: int = 4  # micro-steps per ClaimMicroSteps call, acked together
    keep_batches: int = 16
    """The newest batches whose task and outcome the controller keeps (a redelivered
    JoinBatch, ``wait_batch``, ``status``); older finished ones are forgotten, so a run of
    days holds a bounded state, and a JoinBatch for one of them answers not joined."""
    release_heap: bool = True
    """After each batch, return the heap it freed to the system (:mod:`gyre.heap`)."""
