"""The training supply as the scheduler sees it: the packer's WatchSupply stream followed
(reconnecting), turned into the policy's :class:`~services.scheduler.policy.Supply`, and the
rates the asynchronous policies decide on (:class:`RateMeter`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable

from gyre.backoff import Backoff
from services.scheduler.peers import Peers, SupplyUpdate
from services.scheduler.policy import Supply, SupplyTracker
from services.scheduler.telemetry import Changes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured over the recent window; 0 means "not observed yet"."""

    ready_rate: float = 0.0
    """Groups becoming ready per second."""
    tokens_per_group: float = 0.0
    """Mean packed tokens of a ready group."""
    train_rate_per_cell: float = 0.0
    """Tokens one training cell trains per second while it has work."""


class RateMeter:
    """Rates from successive supply signals (the packer's cumulative counters) and the
    number of training cells; a counter going backwards (a packer restart) starts over."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int, float, float]] = collections.deque()
        """(time, groups ready so far, tokens trained so far, busy cell-seconds so far)."""
        self._last: SupplyUpdate | None = None
        self._busy_s = 0.0

    def observe(self, now_s: float, upd: SupplyUpdate, training_cells: int) -> Rates:
        last = self._last
        if last is not None and (
            upd.groups_ready_total < last.groups_ready_total or upd.tokens_trained < last.tokens_trained
        ):
            self._samples.clear()  # the packer restarted: its counters start over
            self._busy_s = 0.0
        elif self._samples and last is not None and last.backlog_tokens > 0 and not last.optimizing:
            self._busy_s += (now_s - self._samples[-1][0]) * max(training_cells, 0)
        self._last = upd
        self._samples.append((now_s, upd.groups_ready_total, upd.tokens_trained, self._busy_s))
        while len(self._samples) > 2 and now_s - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        return self.rates(upd)

    def rates(self, upd: SupplyUpdate) -> Rates:
        t0, g0, k0, b0 = self._samples[0]
        t1, g1, k1, b1 = self._samples[-1]
        ready_rate = (g1 - g0) / (t1 - t0) if t1 > t0 and g1 > g0 else 0.0
        train = (k1 - k0) / (b1 - b0) if b1 > b0 and k1 > k0 else 0.0
        seen = upd.tokens_trained + upd.backlog_tokens + upd.ready_tokens
        per_group = seen / upd.groups_ready_total if upd.groups_ready_total > 0 else 0.0
        return Rates(ready_rate, per_group, train)


class SupplyFollower:
    """The latest supply signal (``raw``) and the tracked :class:`Supply` (``current``)."""

    def __init__(
        self,
        *,
        peers: Peers,
        batch_size: int,
        fraction: float,
        clock: Callable[[], float],
        changes: Changes,
        rate_window_s: float = 120.0,
    ) -> None:
        self._peers = peers
        self._batch_size = batch_size
        self._clock = clock
        self._changes = changes
        self._tracker = SupplyTracker(fraction)
        self.raw = SupplyUpdate(0, batch_size, 0)
        self.current = self._tracker.observe(clock(), 0, batch_size, 0)
        self.meter = RateMeter(rate_window_s)
        self.rates = Rates()

    def observe(self, training_cells: int = 0) -> Supply:
        """Folds the latest signal into the tracker and the rates (once per decision)."""
        raw, now = self.raw, self._clock()
        self.current = self._tracker.observe(
            now, raw.ready_groups, self._batch_size, raw.batch_needs, raw.batch_id
        )
        self.rates = self.meter.observe(now, raw, training_cells)
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
