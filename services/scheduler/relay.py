"""The finish relay: every closed execution is reported to the packer, retried until
acknowledged (the packer's ReportFinish is idempotent), in close order."""

from __future__ import annotations

import asyncio
import logging

from gyre.backoff import Backoff
from services.scheduler.ledger import ExecutionRecord, Ledger
from services.scheduler.peers import FinishReport, Peers

log = logging.getLogger(__name__)


class FinishRelay:
    """A queue of finish reports and the loop that delivers them."""

    def __init__(self, ledger: Ledger, peers: Peers) -> None:
        self._ledger = ledger
        self._peers = peers
        self._queue: asyncio.Queue[FinishReport] = asyncio.Queue()

    def report(self, rec: ExecutionRecord) -> None:
        """Queues the report of a closed execution."""
        burst = self._ledger.bursts[rec.burst_id]
        self._queue.put_nowait(FinishReport(rec.execution_id, rec.group_id, burst.group_size, rec.state,
                rec.reward, rec.policy_version))

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        """Delivers queued reports one by one, each retried with backoff until acknowledged."""
        while True:
            report = await self._queue.get()
            backoff = Backoff(0.1, 5.0)
            while True:
                try:
                    await self._peers.report_finish(report)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 (the packer may be down: retry; the call is idempotent)
                    log.warning("finish report failed; retrying", extra={"execution_id": report.execution_id,
                            "error": repr(exc)})
                    await backoff.sleep()
