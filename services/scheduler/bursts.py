"""Bursts: what the next burst would dispatch, and dispatching it (a fenced create of the
burst record, then the ledger); archiving closed bursts (a fenced fold into the ledger
summary that deletes their records). The ledger itself (D / L / F per burst) is
:mod:`ledger`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set as AbstractSet

from gyre.errors import Conflict
from services.scheduler.ledger import Burst, Task
from services.scheduler.parts import Part, Shared
from services.scheduler.policy import BurstView
from services.scheduler.tasks import TaskSource

log = logging.getLogger(__name__)


class Bursts(Part):
    """Dispatches bursts of tasks from the task source into the ledger."""

    def __init__(self, *, shared: Shared, tasks: TaskSource) -> None:
        super().__init__(shared=shared)
        self.tasks = tasks

    def current(self) -> BurstView | None:
        """The newest burst as the policy sees it."""
        b = self.ledger.current_burst
        return None if b is None else BurstView(b.burst_id, b.quota, b.policy_version, b.target_version)

    def next_quota(self, continuous: bool = False) -> int:
        """Executions the next burst would dispatch (0: the task source or ``max_bursts`` is
        exhausted). ``continuous`` (the asynchronous policies, whose staleness gate bounds
        each dispatch): as many as any gate could allow, ``(max_staleness + 2)`` bursts'
        worth, and ``max_bursts`` caps the tasks (``max_bursts x`` a burst's groups), not
        the dispatches."""
        if continuous:
            return (
                len(self._next_tasks((self.cfg.max_staleness + 2) * self.cfg.groups_per_burst()))
                * self.cfg.group_size
            )
        if self.cfg.max_bursts and self.ledger.bursts_total >= self.cfg.max_bursts:
            return 0
        return len(self._next_tasks(self.cfg.groups_per_burst())) * self.cfg.group_size

    def _next_tasks(self, groups: int) -> list[Task]:
        taken = self.ledger.tasks_taken
        if self.cfg.max_bursts:
            groups = min(groups, self.cfg.max_bursts * self.cfg.groups_per_burst() - taken)
        return self.tasks.take(taken, groups) if groups > 0 else []

    async def dispatch(
        self, policy_version: int, quota: int, kind: str, gauges: dict[str, int]
    ) -> Burst | None:
        """Dispatches the next burst at ``policy_version``: ``quota`` executions, in whole
        groups; None when there is nothing to dispatch or an earlier attempt already did
        (the next rebuild or tick picks it up)."""
        tasks = self._next_tasks(quota // self.cfg.group_size)
        if not tasks:
            return None
        burst = self.ledger.plan_burst(
            tasks, self.cfg.group_size, policy_version, self.cfg.batches_per_burst, self.wall()
        )
        self.history.invoke("dispatch", self.lead.epoch, burst_id=burst.burst_id, quota=burst.quota)
        try:
            rev = await self.lead.fenced(self.lead.store.dispatch(burst))
        except Conflict:
            return None
        self.ledger.apply_burst(burst)
        self.history.append(
            "dispatch",
            self.lead.epoch,
            rev=rev,
            burst_id=burst.burst_id,
            quota=burst.quota,
            policy_version=burst.policy_version,
        )
        self.telemetry.emit(
            kind,
            f"dispatched burst {burst.burst_id}: {burst.quota} executions "
            f"({len(tasks)} groups of {burst.group_size}) at policy v{burst.policy_version}",
            **gauges,
        )
        await self.changes.notify()
        return burst

    async def archive_closed(self, unsettled: AbstractSet[str]) -> None:
        """Archives closed bursts, oldest first, once their last close is ``archive_grace_s``
        old and none of their finish reports is ``unsettled`` (:mod:`ledger`): memory, etcd
        space and the next takeover stay bounded by the live bursts."""
        before = self.wall() - self.cfg.archive_grace_s
        while (burst := self.ledger.archivable(unsettled, before)) is not None:
            summary = self.ledger.plan_archive(burst)
            try:
                rev = await self.lead.fenced(self.lead.store.archive(summary, self.ledger.archived.revision))
            except Conflict as exc:  # only a leader writes it: our view is stale; the next takeover rebuilds
                log.warning("archive refused: %s", exc)
                return
            self.ledger.apply_archive(dataclasses.replace(summary, revision=rev))
            self.history.append(
                "archive", self.lead.epoch, rev=rev, burst_id=burst.burst_id, executions=burst.quota
            )
            self.telemetry.emit(
                "archive",
                f"archived burst {burst.burst_id} ({burst.quota} executions closed); "
                f"{summary.bursts} bursts, {summary.executions} executions archived in all",
            )
