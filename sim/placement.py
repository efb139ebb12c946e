"""Where a launched or rerouted execution goes: the scheduler's own placement code
(``services.scheduler.placement.placement_order``) over the simulated cell table, or the
"least loaded" alternative the benchmark compares it with."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from gyre.etcd.values import CellRecord
from services.scheduler import placement as SP
from services.scheduler.policy import CellKind

if TYPE_CHECKING:
    from sim.engine import Cell


class Placement(Protocol):
    avoid: frozenset[str]
    """Cells planned to move next (PlanMoves): used only when no other cell has room."""

    def pick(self, exclude: Cell | None = None) -> Cell | None:
        """The rollout cell that takes the next execution (None: no free slot)."""

    def role_changed(self, cell: Cell) -> None:
        """Tells the placement that ``cell`` changed role."""

    def picks(self) -> Iterator[Cell]:
        """Successive picks, lazily: the caller routes each execution before it asks for the
        next cell (the same cells as calling ``pick()`` each time)."""


class SchedulerPlacement:
    """Calls the live scheduler's ``placement_order`` (standalone engines first, most free
    slots first; then elastic rollout cells by descending index, filling each)."""

    name = "scheduler"

    def __init__(self, cells: Sequence[Cell]) -> None:
        self.avoid: frozenset[str] = frozenset()
        self._cells = {c.cid: c for c in cells}
        self._table = SP.CellTable()
        self._table.records = {
            c.cid: CellRecord(
                c.cid,
                CellKind.STANDALONE if c.standalone else CellKind.ELASTIC,
                -1 if c.standalone else c.index,
                c.slots,
                target=f"sim:{c.cid}",
            )
            for c in cells
        }
        self._table.states = {c.cid: c.role for c in cells}

    def role_changed(self, cell: Cell) -> None:
        self._table.states[cell.cid] = cell.role

    def pick(self, exclude: Cell | None = None) -> Cell | None:
        counts = {cid: len(c.execs) for cid, c in self._cells.items()}
        order = SP.placement_order(
            self._table, counts, exclude=[exclude.cid] if exclude else [], avoid=self.avoid
        )
        return self._cells[order[0][0].cell_id] if order else None

    def picks(self) -> Iterator[Cell]:
        """One ``placement_order`` call for many launches: it ranks elastic cells by index
        alone (filling each), so walking the order with its free counts yields what
        successive picks would. Standalone engines are ranked by free slots, which every
        launch changes: with more than one of them, pick one at a time."""
        counts = {cid: len(c.execs) for cid, c in self._cells.items()}
        order = SP.placement_order(self._table, counts, avoid=self.avoid)
        if sum(rec.kind is CellKind.STANDALONE for rec, _ in order) > 1:
            yield from _one_at_a_time(self)
            return
        for rec, free in order:
            cell = self._cells[rec.cell_id]
            for _ in range(free):
                yield cell


class LeastLoadedPlacement:
    """The alternative: the rollout engine with the most free slots (standalone first on a
    tie, then the higher index), which spreads decode load and reroute prefills."""

    name = "least_loaded"

    def __init__(self, cells: Sequence[Cell]) -> None:
        self.avoid: frozenset[str] = frozenset()
        self._cells = list(cells)

    def role_changed(self, cell: Cell) -> None:
        return None

    def picks(self) -> Iterator[Cell]:
        return _one_at_a_time(self)

    def pick(self, exclude: Cell | None = None) -> Cell | None:
        best = None
        best_key: tuple[bool, int, bool, int] | None = None
        avoid = self.avoid
        for c in self._cells:
            f = c.free
            if f <= 0 or c is exclude:
                continue
            key = (c.cid not in avoid, f, c.standalone, c.index)
            if best_key is None or key > best_key:
                best, best_key = c, key
        return best


def _one_at_a_time(p: Placement) -> Iterator[Cell]:
    while (c := p.pick()) is not None:
        yield c


def make_placement(name: str, cells: Sequence[Cell]) -> Placement:
    if name == "scheduler":
        return SchedulerPlacement(cells)
    if name == "least_loaded":
        return LeastLoadedPlacement(cells)
    raise ValueError(f"unknown placement {name!r}")
