"""Bursts: what the next burst would dispatch, and dispatching it (a fenced create of the
burst record, then the ledger). The ledger itself (D / L / F per burst) is :mod:`ledger`."""

from __future__ import annotations

from collections.abc import Callable

from gyre.errors import Conflict
from services.scheduler.config import SchedulerConfig
from services.scheduler.history import History
from services.scheduler.leadership import Leadership
from services.scheduler.ledger import Burst, Ledger, Task
from services.scheduler.policy import BurstView
from services.scheduler.tasks import TaskSource
from services.scheduler.telemetry import Changes, Telemetry


class Bursts:
    """Dispatches bursts of tasks from the task source into the ledger."""

    def __init__(self, cfg: SchedulerConfig, ledger: Ledger, tasks: TaskSource, lead: Leadership,
            history: History, telemetry: Telemetry, changes: Changes, wall: Callable[[], float]) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.tasks = tasks
        self.lead = lead
        self.history = history
        self.telemetry = telemetry
        self.changes = changes
        self.wall = wall

    def current(self) -> BurstView | None:
        """The newest burst as the policy sees it."""
        b = self.ledger.current_burst
        return None if b is None else BurstView(b.burst_id, b.quota, b.policy_version, b.target_version)

    def next_quota(self) -> int:
        """Executions the next burst would dispatch (0: the task source or ``max_bursts`` is
        exhausted)."""
        if self.cfg.max_bursts and len(self.ledger.bursts) >= self.cfg.max_bursts:
            return 0
        return len(self._next_tasks()) * self.cfg.group_size

    def _next_tasks(self) -> list[Task]:
        taken = sum(len(b.tasks) for b in self.ledger.bursts.values())
        return self.tasks.take(taken, self.cfg.groups_per_burst())

    async def dispatch(self, policy_version: int, kind: str, gauges: dict[str, int]) -> Burst | None:
        """Dispatches the next burst at ``policy_version``; None when there is nothing to
        dispatch or an earlier attempt already did (the next rebuild or tick picks it up)."""
        tasks = self._next_tasks()
        if not tasks:
            return None
        burst = self.ledger.plan_burst(tasks, self.cfg.group_size, policy_version,
                self.cfg.batches_per_burst, self.wall())
        try:
            rev = await self.lead.fenced(self.lead.store.dispatch(burst))
        except Conflict:
            return None
        self.ledger.apply_burst(burst)
        self.history.append("dispatch", self.lead.epoch, rev=rev, burst_id=burst.burst_id, quota=burst.quota,
                            policy_version=burst.policy_version)
        self.telemetry.emit(kind,
                f"dispatched burst {burst.burst_id}: {burst.quota} executions "
                f"({len(tasks)} groups of {burst.group_size}) at policy v{burst.policy_version}", **gauges)
        await self.changes.notify()
        return burst
