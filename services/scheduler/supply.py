"""The training supply as the scheduler sees it: the packer's WatchSupply stream followed
(reconnecting), turned into the policy's :class:`~services.scheduler.policy.Supply`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gyre.backoff import Backoff
from services.scheduler.peers import Peers, SupplyUpdate
from services.scheduler.policy import Supply, SupplyTracker
from services.scheduler.telemetry import Changes

log = logging.getLogger(__name__)


class SupplyFollower:
    """The latest supply signal (``raw``) and the tracked :class:`Supply` (``current``)."""

    def __init__(self, peers: Peers, batch_size: int, fraction: float, clock: Callable[[], float],
            changes: Changes) -> None:
        self._peers = peers
        self._batch_size = batch_size
        self._clock = clock
        self._changes = changes
        self._tracker = SupplyTracker(fraction)
        self.raw = SupplyUpdate(0, batch_size, 0)
        self.current = self._tracker.observe(clock(), 0, batch_size, 0)

    def observe(self) -> Supply:
        """Folds the latest signal into the tracker (once per decision)."""
        raw = self.raw
        self.current = self._tracker.observe(self._clock(), raw.ready_groups, self._batch_size,
                raw.batch_needs, raw.batch_id)
        return self.current

    async def run(self, enabled: bool) -> None:
        """Follows the packer's supply stream (reconnecting); idles without a packer."""
        if not enabled:
            await asyncio.Event().wait()
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                async for upd in self._peers.watch_supply():
                    self.raw = upd
                    backoff.reset()
                    self._changes.wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (any stream error: reconnect)
                log.info("supply stream interrupted; reconnecting", extra={"error": repr(exc)})
            await backoff.sleep()
