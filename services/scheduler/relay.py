"""The finish relay: closed executions reported to the packer, none blocking another.

Every closed execution is reported once (by the close, or by a new leader for the closed
records of its live bursts) and delivered by a few concurrent workers (the packer's
ReportFinish is idempotent, and the order of reports does not matter to it). A delivery ends in
one of three ways:

* **acknowledged** (new or duplicate): settled;
* **refused** (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND: e.g. a group the packer
  already resolved and forgot, or one that is full): settled and logged, never retried,
  since a retry would be refused the same way;
* **not delivered** (the packer is down or slow, any other error): retried after a back-off
  with jitter (:mod:`gyre.backoff`, doubling up to ``max_backoff_s``), while the other reports go on.

:attr:`FinishRelay.unsettled` names the executions not settled yet: their burst is not
archived until they are (the packer may still need them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from gyre.backoff import Backoff
from gyre.errors import FailedPrecondition, InvalidArgument, NotFound
from services.scheduler.ledger import ExecutionRecord, Ledger
from services.scheduler.peers import FinishReport, Peers

log = logging.getLogger(__name__)

REFUSED = (InvalidArgument, FailedPrecondition, NotFound)
"""Answers that a retry cannot change: the report is settled as refused."""


@dataclasses.dataclass
class RelayCounts:
    """What the relay has done (for status, metrics and tests)."""

    delivered: int = 0
    refused: int = 0
    retries: int = 0


class FinishRelay:
    """Delivers finish reports to the packer with ``workers`` concurrent calls."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        peers: Peers,
        workers: int = 4,
        max_backoff_s: float = 5.0,
        on_refused: Callable[[FinishReport, Exception], None] | None = None,
    ) -> None:
        self._ledger = ledger
        self._peers = peers
        self._workers = max(1, workers)
        self._max_backoff_s = max_backoff_s
        self._on_refused = on_refused
        self._queue: asyncio.Queue[FinishReport] = asyncio.Queue()
        self._pending: dict[str, FinishReport] = {}
        self._backoffs: dict[str, Backoff] = {}
        self.counts = RelayCounts()

    @property
    def unsettled(self) -> frozenset[str]:
        """Executions whose report is neither acknowledged nor refused yet."""
        return frozenset(self._pending)

    @property
    def pending(self) -> int:
        """Reports not settled yet."""
        return len(self._pending)

    def report(self, rec: ExecutionRecord) -> None:
        """Queues the report of a closed execution."""
        burst = self._ledger.bursts[rec.burst_id]
        self.submit(
            FinishReport(
                rec.execution_id, rec.group_id, burst.group_size, rec.state, rec.reward, rec.policy_version
            )
        )

    def submit(self, report: FinishReport) -> None:
        """Queues a report (a report already pending is not queued twice)."""
        if report.execution_id in self._pending:
            return
        self._pending[report.execution_id] = report
        self._queue.put_nowait(report)

    async def run(self) -> None:
        """Delivers until cancelled."""
        workers = [asyncio.create_task(self._work(), name=f"finish-relay-{i}") for i in range(self._workers)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            report = await self._queue.get()
            await self.deliver(report)

    async def deliver(self, report: FinishReport) -> None:
        """One delivery attempt; schedules the retry of a report not delivered."""
        eid = report.execution_id
        try:
            await self._peers.report_finish(report)
        except asyncio.CancelledError:
            raise
        except REFUSED as exc:
            self._settle(eid)
            self.counts.refused += 1
            log.warning(
                "finish report refused by the packer; settled, not retried",
                extra={"execution_id": eid, "group_id": report.group_id, "error": str(exc)},
            )
            if self._on_refused is not None:
                self._on_refused(report, exc)
            return
        except Exception as exc:  # noqa: BLE001 -- the packer may be down or slow: retry later (the call is idempotent)
            backoff = self._backoffs.setdefault(eid, Backoff(0.1, self._max_backoff_s))
            self.counts.retries += 1
            delay = backoff.next()
            log.info(
                "finish report not delivered; retrying in %.2f s",
                delay,
                extra={"execution_id": eid, "error": repr(exc)},
            )
            asyncio.get_running_loop().call_later(delay, self._queue.put_nowait, report)
            return
        self._settle(eid)
        self.counts.delivered += 1

    def _settle(self, execution_id: str) -> None:
        self._pending.pop(execution_id, None)
        self._backoffs.pop(execution_id, None)
