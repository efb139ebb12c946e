"""Publication: the newest policy version (``keys.policy()``, written by the training core)
and loading it onto the rollout engines.

The core writes each new version with the address engines load it from; the policy decides
when rollout engines get it (:class:`~services.scheduler.policy.PublishPolicy`), once per
version. A new leader publishes again what it finds (engines already serving the version are
skipped), since the old leader may have died mid-publication.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gyre.errors import GyreError, InvalidArgument
from gyre.etcd.values import decode_policy_record
from services.scheduler.fleet import CellGone, Fleet
from services.scheduler.leadership import Leadership
from services.scheduler.peers import Peers
from services.scheduler.policy import CellState
from services.scheduler.status import TrainingDiagnostics
from services.scheduler.telemetry import Telemetry

log = logging.getLogger(__name__)


class Publication:
    """The published version, its source, and the loads onto rollout engines."""

    def __init__(self, lead: Leadership, fleet: Fleet, peers: Peers, telemetry: Telemetry) -> None:
        self._lead = lead
        self._fleet = fleet
        self._peers = peers
        self._telemetry = telemetry
        self.version = 0
        """The newest version the core published."""
        self.source = ""
        """Where engines load it from (the core's target)."""
        self.published = 0
        """The newest version we have sent to rollout engines."""
        self.training: TrainingDiagnostics | None = None
        """The newest record's training diagnostics (None: it carries none)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def on_policy(self, items: Mapping[bytes, Any]) -> None:
        for kv in items.values():
            try:
                self.observe(decode_policy_record(kv.value))
            except InvalidArgument as exc:
                log.warning("malformed policy key ignored", extra={"error": str(exc)})

    def observe(self, body: Mapping[str, Any]) -> None:
        """A policy record (the key's JSON): a newer version replaces ours, and its training
        diagnostics (``training``, absent from mock trainers' and older records) ours."""
        version = int(body.get("version", 0))
        if version > self.version:
            self.version = version
            self.source = str(body.get("source_target", ""))
            self.training = TrainingDiagnostics.from_record(version, body.get("training"))
            self._telemetry.emit("policy_version", f"policy v{version} published by {self.source or '?'}")

    def publish(self, version: int, moving: Callable[[str], bool]) -> bool:
        """Loads ``version`` on every rollout engine behind it (cells not ``moving``), in the
        background; False when it was already published."""
        if version <= self.published:
            return False
        self.published = version
        self._spawn(self._load_all(version, moving))
        return True

    def catch_up(self, moving: Callable[[str], bool]) -> None:
        """After a takeover: engines still behind the newest version catch up."""
        self.published = self.version
        if self.version > 0:
            self._spawn(self._load_all(self.version, moving))

    async def load(self, cell_id: str, attempts: int = 0) -> None:
        """Loads the newest version on one cell if it is behind."""
        v = self.version
        if v <= self._fleet.version(cell_id) or not self.source:
            return
        got = await self._fleet.call(cell_id, self._loader(cell_id, v), attempts)
        self._fleet.loaded(cell_id, max(int(got), v))

    def _loader(self, cell_id: str, version: int) -> Callable[[], Awaitable[int]]:
        return lambda: self._peers.load_policy(
            self._fleet.target(cell_id), self._lead.epoch, version, self.source
        )

    async def _load_all(self, version: int, moving: Callable[[str], bool]) -> None:
        if not self.source:
            self._telemetry.emit("publish_skipped", f"policy v{version}: no source target known")
            return
        fleet = self._fleet
        cells = [
            v.cell_id
            for v in fleet.cells.views()
            if v.state is CellState.ROLLOUT and not moving(v.cell_id) and fleet.version(v.cell_id) < version
        ]

        async def one(cell_id: str) -> None:
            try:
                got = await fleet.call(cell_id, self._loader(cell_id, version), attempts=5)
                fleet.loaded(cell_id, max(int(got), version))
            except (GyreError, CellGone) as exc:
                self._telemetry.emit(
                    "load_failed", f"{cell_id} could not load policy v{version}: {exc}", cell_id=cell_id
                )

        await asyncio.gather(*(one(c) for c in cells))
        self._telemetry.emit("policy_loaded", f"policy v{version} loaded on {len(cells)} rollout engines")

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
