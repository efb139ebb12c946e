"""The packer's write path, shared by its parts: the state, the event log, replaying it, and
what follows every change.

A part commits each decision as an event (:meth:`Journal.commit`: applied to the state,
appended to the WAL buffer) and, once its operation's commits are done, calls
:meth:`Journal.after`: work moves forward (``forward``, the batches' pump), the
conservation invariant is rechecked (``strict``), the change is counted and whoever waits
for one wakes. Durability is the caller's: it syncs the log before it answers. Nothing here
awaits, so a part that checks and commits without awaiting in between stays atomic (the
rule in :mod:`services.packer.packer`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from gyre.errors import FatalError
from services.packer.history import HistoryLog
from services.packer.records import Event
from services.packer.state import PackerState
from services.packer.wal import EventLog

log = logging.getLogger(__name__)


class Journal:
    """Commits events to the state and the WAL; signals every change."""

    def __init__(
        self, *, state: PackerState, log: EventLog, strict: bool, forward: Callable[[], None]
    ) -> None:
        self.state = state
        self.log = log
        self.strict = strict  # recheck conservation after every change (else: every reap)
        self._forward = forward
        self._wake = asyncio.Event()
        self.changes = 0  # bumped on every change (supply watchers compare it)
        self.fatal: BaseException | None = None
        self.skipped: list[int] = []  # WAL events set aside at replay (see replay)
        self.restarted = False  # the replayed log held a run (any record beyond its header)

    def replay(self, events: Iterable[Event]) -> int:
        """Applies the WAL's events; returns how many applied.

        An event that no longer applies (it depends on a record the WAL quarantined as
        corrupt) is set aside with an error, and replay goes on; the invariants are then
        checked in full, and a state that is still inconsistent stops the process."""
        n = 0
        self.restarted = False
        self.skipped = []
        for k, ev in enumerate(events):
            self.restarted = self.restarted or ev.get("t") != "wal"
            try:
                self.state.apply(ev)
            except (KeyError, ValueError, TypeError, FatalError) as exc:
                self.skipped.append(k)
                log.error(
                    "packer WAL: an event does not apply (a record it depends on was lost); set aside",
                    extra={"event": k, "type": ev.get("t"), "error": repr(exc)},
                )
                continue
            n += 1
        if self.skipped:
            self.state.check(deep=True)
        return n

    def commit(self, ev: Event) -> None:
        self.state.apply(ev)
        self.log.append(ev)

    def after(self) -> None:
        """After every change: move work forward, check invariants, wake waiters."""
        self._forward()
        if self.strict:
            self.check()
        self.changes += 1
        self._wake.set()
        self._wake = asyncio.Event()

    def check(self) -> None:
        """Rechecks the invariants; a violation is kept in ``fatal`` and raised."""
        try:
            self.state.check()
        except FatalError as exc:
            self.fatal = exc
            raise

    async def sync(self) -> None:
        """Makes everything committed so far durable (one WAL flush, shared with the others)."""
        await self.log.sync()

    def note(self, op: str, **fields: Any) -> None:
        """Writes ``op`` to the operation history, when there is one (nothing changed)."""
        if isinstance(self.log, HistoryLog):
            self.log.note(op, **fields)

    async def wait_changed(self, timeout_s: float | None) -> None:
        """Returns at the next change, or after ``timeout_s``."""
        wake = self._wake
        try:
            await asyncio.wait_for(wake.wait(), timeout_s)
        except TimeoutError:
            pass
