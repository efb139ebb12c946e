"""What every part of the scheduler is built with: :class:`Shared`, the collaborators one
leadership term's parts have in common (settings, leadership, ledger, fleet, peers, history,
telemetry, wake-ups, clocks), and :class:`Part`, the base that keeps them under the names the
parts use. :class:`~services.scheduler.scheduler.Scheduler` builds one ``Shared`` per term
(and again after a step-down) and gives it to each part, with the part's own collaborators,
as keyword arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from services.scheduler.config import SchedulerConfig
from services.scheduler.fleet import Fleet
from services.scheduler.history import History
from services.scheduler.leadership import Leadership
from services.scheduler.ledger import Ledger
from services.scheduler.peers import Peers
from services.scheduler.telemetry import Changes, Telemetry


@dataclasses.dataclass(frozen=True)
class Shared:
    """The collaborators the scheduler's parts share (one of each per leadership term)."""

    cfg: SchedulerConfig
    lead: Leadership
    ledger: Ledger
    fleet: Fleet
    peers: Peers
    history: History
    telemetry: Telemetry
    changes: Changes
    clock: Callable[[], float]
    """Monotonic seconds: deadlines and waits."""
    wall: Callable[[], float]
    """Wall-clock seconds: what records and routes store."""


class Part:
    """A part of the scheduler: the shared collaborators, as attributes of the same names."""

    def __init__(self, *, shared: Shared) -> None:
        self.cfg = shared.cfg
        self.lead = shared.lead
        self.ledger = shared.ledger
        self.fleet = shared.fleet
        self.peers = shared.peers
        self.history = shared.history
        self.telemetry = shared.telemetry
        self.changes = shared.changes
        self.clock = shared.clock
        self.wall = shared.wall
