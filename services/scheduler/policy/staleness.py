"""The staleness bound eta, the dispatch gate, the one rule for unconsumable groups, and the
waterlevel of overlapping bursts. Pure functions; every policy and every mechanism (the
simulator's trainer, the packer, the scheduler) uses these and nothing else, so the rules
are identical for Gyre and for the baselines.

Versions. A group is stamped with the policy version it was dispatched with (the version it
serves); batch k is trained on version k and publishes version k + 1. Batch k may consume a
group stamped u only if ``k - u <= eta`` (``max_staleness``), so a group stamped u can be
consumed by batches ``u .. u + eta``.

Gate (AReaL's, plus over-provision). With the trainer at version v, at most
``(v + eta + 1) * B + X`` usable groups (dispatched minus cancelled minus filtered) may
have been dispatched: the batches up to ``v + eta`` can be served by groups of version >= v,
and X extra groups (``extra_groups``, the over-provision) let the batches close on their
fastest groups. A cancelled group leaves the gate (it is replaced), and so does a group the
packer filtered out after it closed (zero reward variance, failed members: AReaL's rejected
rollouts, which leave its staleness count the same way).

The rule for unconsumable groups: **cancel early**. Once batch ``u + eta`` has all its groups
(assigned, or the trainer has moved past it) a group stamped u that is not assigned can never
be trained within eta. At that moment the group is cancelled: its ready copy leaves the pool
and its still-open members are cancelled (their slots are freed; a cancelled execution counts
as finished). Nothing waits for a group that cannot be used, and nothing drops later what
could have been stopped earlier. Tokens keep the version they were generated with.

Waterlevel with overlapping bursts. The seed's W = D - F counts every open execution; with
continuous dispatch most of it is work for later batches that may queue without harm. The
committed work is the open work the trainer can still use and still needs::

    W_eta = min( open executions of consumable versions (u >= v - eta),
                 groups still needed by batches v .. v + eta beyond the ready supply
                 x group size )

**Invariant (Gyre):** a cell moves to training only if the rollout capacity left behind is
at least W_eta. With eta = 0, no over-provision and one batch per burst it is the seed's
W minus what the ready supply already covers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from gyre.staleness import consumable, oldest_usable, unconsumable
from services.scheduler.policy.snapshot import Pipeline, VersionCounts

__all__ = [
    "cells_to_cover",
    "consumable",
    "dispatch_room",
    "gate",
    "groups_needed",
    "oldest_usable",
    "unconsumable",
    "usable_open",
    "waterlevel",
]
"""``consumable``, ``unconsumable`` and ``oldest_usable`` are :mod:`gyre.staleness`'s: the one
rule, shared with the services that apply it (the scheduler cancels, the packer drops)."""


def gate(version: int, max_staleness: int, batch_groups: int, extra_groups: int = 0) -> int:
    """The most usable groups that may have been dispatched with the trainer at ``version``."""
    if version < 0 or max_staleness < 0 or batch_groups < 1 or extra_groups < 0:
        raise ValueError("gate needs version, eta, X >= 0 and B >= 1")
    return (version + max_staleness + 1) * batch_groups + extra_groups


def dispatch_room(p: Pipeline, version: int) -> int:
    """Groups that may be dispatched now without breaking the gate (>= 0). None while a group
    stamped ``version`` would be unconsumable at once (eta = 0 and the batch in progress
    full: wait for the update), else cancelling would free room for groups cancelled next."""
    full = p.optimizing or p.batch_assigned >= p.batch_groups
    if unconsumable(version, version, full, p.max_staleness):
        return 0
    return max(0, gate(version, p.max_staleness, p.batch_groups, p.extra_groups) - p.usable_dispatched)


def usable_open(versions: Iterable[VersionCounts], trainer_version: int, max_staleness: int) -> int:
    """Open executions of versions the trainer can still consume."""
    lo = trainer_version - max_staleness
    return sum(vc.open for vc in versions if vc.version >= lo)


def groups_needed(p: Pipeline) -> int:
    """Groups that batches v .. v + eta still need beyond the assigned and ready ones."""
    want = (p.max_staleness + 1) * p.batch_groups - p.batch_assigned - p.ready_groups
    return max(0, want)


def waterlevel(p: Pipeline, trainer_version: int, dispatching: int = 0) -> int:
    """W_eta: committed usable rollout work, in executions (see the module docstring);
    ``dispatching``: executions a decision dispatches now, counted as open."""
    open_ = usable_open(p.versions, trainer_version, p.max_staleness) + dispatching
    return min(open_, groups_needed(p) * p.group_size)


def cells_to_cover(work: int, slots_per_cell: int) -> int:
    """Rollout cells needed to hold ``work`` executions."""
    return math.ceil(work / slots_per_cell) if slots_per_cell > 0 else 0
