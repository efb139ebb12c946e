"""The staleness bound eta and the one rule for groups that can no longer be trained, shared
by every service that applies it (the scheduler cancels or restamps their open members, the
packer drops their ready copies) and by the policies and the simulator.

A group is stamped with the policy version it was dispatched with (the version it serves).
The batch that trains on version k may consume a group stamped u only if ``0 <= k - u <=
eta`` (``max_staleness``). Once the trainer is past version ``u + eta``, or at it with the
batch full (every group it needs assigned), an unassigned group stamped u can never be
trained within eta (:func:`unconsumable`). What happens to it is the rule
(``stale_rule``), the same for every policy:

* **cancel** (cancel early): its open members are cancelled at once, its ready copy is
  dropped; nothing is kept that cannot be used, and every consumed token is at most eta
  versions old.
* **partial** (partial rollouts, as AReaL's interruptible generation and slime's partial
  rollout): a group with a member already launched goes on, restamped with
  :func:`restamp_version` (the member records carry the new stamp; the engines already
  serve the newest weights). A group none of whose members has started is withdrawn as
  under cancel (a fresh one replaces it at the current version), and a ready copy is still
  dropped. Nothing started is thrown away; the price is that the tokens a group generated
  before its restamp keep their older version, so a consumed token may be more than eta
  versions old (the stamp, not every token, is within eta). ``partial_max_versions`` L
  bounds that: a group goes on only while its new stamp is at most L versions past its
  dispatch, so a consumed group was dispatched at most eta + L versions before its batch
  (its tokens are no older, once the engines serve the version it was dispatched at); past
  it, it is cancelled. A first restamp already moves a group ``max(eta, 1)`` versions (it
  happens when the trainer reaches ``u + eta``), so L below that is the cancel rule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

CANCEL = "cancel"
PARTIAL = "partial"
STALE_RULES = (CANCEL, PARTIAL)


class StalenessSettings(BaseModel):
    """eta and the rule, declared once for every config that applies them (the scheduler's,
    the packer's, the simulator's). In a cluster, set them once in ``cluster:``; the
    launcher refuses a config where the scheduler's and the packer's differ."""

    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description="eta: the most policy versions a consumed group may lag the newest. The policy "
        "cancels (or restamps) groups that cannot be trained within it; the packer drops a group whose "
        "oldest output token came from a policy more than eta versions behind the newest known one "
        "(under partial: whose stamp lags more than eta).",
    )
    stale_rule: Literal["cancel", "partial"] = Field(
        "cancel",
        description="What happens to a group that cannot be trained within max_staleness: cancel (its "
        "open members are cancelled, every consumed token is within eta) or partial (a group with a "
        "member started goes on restamped with a newer version; only unstarted groups are withdrawn; a "
        "consumed token may be older than eta, and the packer judges staleness by the group's stamp).",
    )


def consumable(group_version: int, trainer_version: int, max_staleness: int) -> bool:
    """The batch training on ``trainer_version`` may take a group stamped ``group_version``."""
    return 0 <= trainer_version - group_version <= max_staleness


def unconsumable(group_version: int, trainer_version: int, batch_full: bool, max_staleness: int) -> bool:
    """True once no batch within eta can take an unassigned group stamped ``group_version``
    (the trainer is past batch ``u + eta``, or at it with the batch full)."""
    last = group_version + max_staleness
    return trainer_version > last or (trainer_version == last and batch_full)


def oldest_usable(trainer_version: int, batch_full: bool, max_staleness: int) -> int:
    """The oldest stamp whose unassigned groups can still be consumed."""
    return trainer_version - max_staleness + (1 if batch_full else 0)


def restamp_version(trainer_version: int, batch_full: bool, max_staleness: int) -> int:
    """The partial rule's new stamp: the trainer's version, or the next one when no batch
    within eta could take a group stamped with it (eta = 0 and the batch full)."""
    return max(oldest_usable(trainer_version, batch_full, max_staleness), trainer_version)


def goes_on(rule: str, started: bool, moved: int = 0, max_moved: int | None = None) -> bool:
    """Whether an unconsumable group that is still open goes on (restamped) rather than being
    cancelled: under the partial rule, once any of its members has started, and while its new
    stamp would be at most ``max_moved`` versions past the one it was dispatched with
    (``moved``; None: no limit). A batch takes a group stamped at most eta versions back, so
    with a limit L a consumed group was dispatched at most eta + L versions before its batch."""
    if rule not in STALE_RULES:
        raise ValueError(f"stale_rule must be one of {', '.join(STALE_RULES)}, got {rule!r}")
    return rule == PARTIAL and started and (max_moved is None or moved <= max_moved)
