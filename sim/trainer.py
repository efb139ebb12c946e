"""The streaming trainer's batch (:class:`Trainer`): the ready groups waiting for it, the
batch being filled and trained, the version, and what it consumed and dropped. What moves it
through simulated time (joins, the optimizer step, the events) is ``sim.training``."""

from __future__ import annotations

from collections import deque

from sim.cost import CostModel
from sim.engine import EPS, Cell, Group


class Trainer:
    """The streaming training of the current batch: FIFO consumption of assigned groups by
    the joined cells, then one optimizer step of fixed cost, then the version goes up."""

    def __init__(self, cost: CostModel, batch_groups: int, max_staleness: int) -> None:
        self.cost = cost
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.batch_id = 1
        self.version = 0
        self.needs = batch_groups
        self.pool: deque[Group] = deque()  # ready, unassigned
        self.work = 0.0  # tokens assigned to the batch, not yet trained
        self.members: list[Cell] = []
        self.opt_members: list[Cell] = []
        self.optimizing_until = -1.0
        self.t_last = 0.0
        self.gen = 0
        self.dropped_groups = 0
        self.consumed_groups = 0
        self.consumed_tokens = 0
        self.lag_tokens: dict[int, int] = {}  # lag -> generated tokens consumed with that lag
        self.per_cell_rate = cost.train_tokens_per_cell_s()
        self.pool_tokens = 0.0  # training work (6N-equivalent tokens) of the groups in the pool
        self.on_consumed = lambda g: None  # set by the cluster

    @property
    def busy(self) -> bool:
        return self.optimizing_until >= 0 or self.work > EPS

    def progress(self, t: float) -> None:
        dt = t - self.t_last
        self.t_last = t
        if dt > 0 and self.work > 0 and self.optimizing_until < 0 and self.members:
            self.work = max(0.0, self.work - dt * self.per_cell_rate * len(self.members))

    def assign(self) -> None:
        """Moves groups from the pool into the batch while members exist and it needs them.
        One group is in progress at a time (the next is claimed when its work is done), so
        the pool keeps showing the unassigned supply."""
        while (
            self.members and self.needs > 0 and self.work <= EPS and self.optimizing_until < 0 and self.pool
        ):
            g = self.pool.popleft()
            self.pool_tokens -= g.work
            if self.version - g.version > self.max_staleness:
                self.dropped_groups += 1
                continue
            g.consumed = True
            self.on_consumed(g)
            self.needs -= 1
            self.work += g.work
            self.consumed_groups += 1
            self.consumed_tokens += g.tokens
            for v, n in g.gen_by_version.items():
                lag = self.version - v
                self.lag_tokens[lag] = self.lag_tokens.get(lag, 0) + n

    def purge_stale(self) -> None:
        keep = deque(g for g in self.pool if self.version - g.version <= self.max_staleness)
        self.dropped_groups += len(self.pool) - len(keep)
        self.pool = keep
        self.pool_tokens = float(sum(g.work for g in keep))
