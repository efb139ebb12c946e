"""The launcher's etcd upkeep: every ``defrag_every_s`` it checks the private etcd's
database and defragments it when the rule of :mod:`gyre.etcd.maintenance` says the free
part is worth it. Configured under ``launch.etcd``::

    launch:
      etcd: {defrag_every_s: 600, defrag_min_free_mb: 32, defrag_min_free_share: 0.5}

``defrag_every_s: 0`` turns it off. Each defragmentation is a ``defragmented`` event of
``etcd`` in ``supervisor.jsonl``; a check that fails (etcd restarting, paused) is retried at
the next period and never stops the run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from gyre.etcd.client import Etcd
from gyre.etcd.maintenance import MB, DefragOutcome, DefragRule, defragment_if_due
from gyre.grpcx.tls import TlsFiles

log = logging.getLogger(__name__)

DEFRAG_EVERY_S = 600.0


class EtcdUpkeep:
    """A daemon thread that defragments one etcd member when it is due."""

    def __init__(
        self,
        endpoint: str,
        tls: TlsFiles,
        rule: DefragRule,
        every_s: float,
        record: Callable[..., None],
    ) -> None:
        self.endpoint = endpoint
        self.tls = tls
        self.rule = rule
        self.every_s = every_s
        self._record = record
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(
        cls, section: dict[str, Any], endpoint: str, tls: TlsFiles, record: Callable[..., None]
    ) -> EtcdUpkeep:
        rule = DefragRule(
            min_free_mb=float(section.get("defrag_min_free_mb", DefragRule.min_free_mb)),
            min_free_share=float(section.get("defrag_min_free_share", DefragRule.min_free_share)),
        )
        return cls(endpoint, tls, rule, float(section.get("defrag_every_s", DEFRAG_EVERY_S)), record)

    def start(self) -> None:
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gyre-etcd-upkeep", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def check(self) -> DefragOutcome | None:
        """One check (and defragmentation when due); raises what the connection raises."""

        async def run() -> DefragOutcome | None:
            async with Etcd([self.endpoint], timeout_s=10.0, tls=self.tls) as etcd:
                return await defragment_if_due(etcd, self.rule)

        outcome = asyncio.run(run())
        if outcome is not None:
            self._record(
                "etcd",
                "defragmented",
                db_mb_before=round(outcome.before.file_bytes / MB, 2),
                db_mb_after=round(outcome.after.file_bytes / MB, 2),
                in_use_mb=round(outcome.after.in_use_bytes / MB, 2),
                seconds=round(outcome.seconds, 3),
            )
        return outcome

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # etcd restarting or paused: the next period tries again
                log.warning("etcd upkeep check failed: %s", exc)
