"""The staleness bound eta and the one rule for groups that can no longer be trained, shared
by every service that applies it (the scheduler cancels their open members, the packer drops
their ready copies) and by the policies and the simulator.

A group is stamped with the policy version it was dispatched with (the version it serves).
The batch that trains on version k may consume a group stamped u only if ``0 <= k - u <=
eta`` (``max_staleness``). **Cancel early:** once the trainer is past version ``u + eta``, or
at it with the batch full (every group it needs assigned), a group stamped u that is not
assigned can never be trained within eta: it is cancelled at once, not dropped later.
"""

from __future__ import annotations


def consumable(group_version: int, trainer_version: int, max_staleness: int) -> bool:
    """The batch training on ``trainer_version`` may take a group stamped ``group_version``."""
    return 0 <= trainer_version - group_version <= max_staleness


def unconsumable(group_version: int, trainer_version: int, batch_full: bool, max_staleness: int) -> bool:
    """The cancel-early rule: True once no batch within eta can take an unassigned group
    stamped ``group_version`` (the trainer is past batch ``u + eta``, or at it with the
    batch full)."""
    last = group_version + max_staleness
    return trainer_version > last or (trainer_version == last and batch_full)


def oldest_usable(trainer_version: int, batch_full: bool, max_staleness: int) -> int:
    """The oldest stamp whose unassigned groups can still be consumed."""
    return trainer_version - max_staleness + (1 if batch_full else 0)
