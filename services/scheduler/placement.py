"""Cells, routes and placement: which engine takes a new execution or a rerouted one.

Pure. The cell table is built from the lease-bound registrations (``keys.cell``) and the
lifecycle states (``keys.cell_state``) the cell agents write, overlaid with the transitions
the scheduler has under way (a cell it is moving counts as DRAINING, one it is returning as
RETURNING, before the agent confirms). Routes are the scheduler's own writes (it is their
only writer), so the table is exact on the leader.

Placement order, for launches and reroute destinations alike: standalone engines first
(most free slots first), then elastic cells in rollout by descending index. The same order
the paper gives for reroutes; used for launches too so that the cells that move to training
first (the core, then low-index satellites) carry the fewest executions when they go. With
the asynchronous policies the order takes the policy's plan instead: ``avoid`` (the cells
``PlanMoves`` names) goes last and ``spread`` fills the others least loaded first, so only
the cells about to move are kept empty and nothing else is packed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gyre.etcd.values import CellKind, CellRecord, CellState, Route, decode_cell_state
from services.scheduler.policy import CellView


class CellTable:
    """Registrations + states + the scheduler's own in-flight overlays + cells found dead."""

    def __init__(self) -> None:
        self.records: dict[str, CellRecord] = {}
        self.states: dict[str, CellState] = {}
        self.overlay: dict[str, CellState] = {}
        self.down: set[str] = set()
        """Cells whose engine a router reported failed and a probe confirmed dead, while
        their registration (lease) still lingers: FAILED to placement and the policy."""

    def refresh(self, registrations: Iterable[bytes], states: Mapping[str, bytes]) -> None:
        recs: dict[str, CellRecord] = {}
        for raw in registrations:
            try:
                rec = CellRecord.from_json(raw)
            except (ValueError, KeyError, TypeError):
                continue  # a malformed registration is ignored, not fatal
            recs[rec.cell_id] = rec
        self.records = recs
        self.states = {cid: decode_cell_state(states.get(cid)) for cid in recs}

    def state(self, cell_id: str) -> CellState:
        if cell_id in self.down:
            return CellState.FAILED
        return self.overlay.get(cell_id) or self.states.get(cell_id, CellState.STARTING)

    def views(self) -> tuple[CellView, ...]:
        return tuple(
            CellView(r.cell_id, r.kind, r.index, self.state(r.cell_id), r.slots)
            for r in sorted(
                self.records.values(), key=lambda r: (r.kind is CellKind.ELASTIC, r.index, r.cell_id)
            )
        )

    def get(self, cell_id: str) -> CellRecord | None:
        return self.records.get(cell_id)


class RouteTable:
    """Routes by execution, with per-cell counts (reservations included)."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}

    def put(self, route: Route) -> None:
        self.routes[route.execution_id] = route

    def drop(self, execution_id: str) -> None:
        self.routes.pop(execution_id, None)

    def on_cell(self, cell_id: str) -> list[Route]:
        return sorted((r for r in self.routes.values() if r.cell_id == cell_id), key=lambda r: r.execution_id)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.routes.values():
            out[r.cell_id] = out.get(r.cell_id, 0) + 1
        return out


def placement_order(
    cells: CellTable,
    counts: Mapping[str, int],
    exclude: Iterable[str] = (),
    avoid: Iterable[str] = (),
    spread: bool = False,
) -> list[tuple[CellRecord, int]]:
    """Rollout cells with free slots, in preference order, with their free slot counts.

    Standalone engines first (most free slots first); then elastic cells by descending index
    (packing: the cells that move to training first carry the fewest executions), or with
    ``spread`` by most free slots (least loaded first, higher index on a tie). Cells in
    ``avoid`` (the policy's ``PlanMoves``: they move to training next) come last, so they
    take work only when nothing else has room."""
    skip = set(exclude)
    free = [
        (r, r.slots - counts.get(r.cell_id, 0))
        for r in cells.records.values()
        if r.cell_id not in skip and cells.state(r.cell_id) is CellState.ROLLOUT and r.target
    ]
    free = [(r, f) for r, f in free if f > 0]
    standalone = sorted(
        (x for x in free if x[0].kind is CellKind.STANDALONE), key=lambda x: (-x[1], x[0].cell_id)
    )
    if spread:
        elastic = sorted(
            (x for x in free if x[0].kind is CellKind.ELASTIC), key=lambda x: (-x[1], -x[0].index)
        )
    else:
        elastic = sorted((x for x in free if x[0].kind is CellKind.ELASTIC), key=lambda x: -x[0].index)
    order = standalone + elastic
    planned = set(avoid)
    if planned:
        order = sorted(order, key=lambda x: x[0].cell_id in planned)  # stable
    return order


def pick_launch_cell(
    cells: CellTable, routes: RouteTable, avoid: Iterable[str] = (), spread: bool = False
) -> CellRecord | None:
    """The engine for a new execution, or None when no rollout slot is free."""
    order = placement_order(cells, routes.counts(), avoid=avoid, spread=spread)
    return order[0][0] if order else None


def pick_destinations(
    cells: CellTable,
    routes: RouteTable,
    source: str,
    n: int,
    version_of: Callable[[str], int] | None = None,
    avoid: Iterable[str] = (),
    spread: bool = False,
) -> list[CellRecord]:
    """Destinations for ``n`` executions leaving ``source`` (fewer if slots run out). With
    ``version_of``, engines serving the source's policy version come first (a continuation
    should run on the same weights); the placement order holds within each group."""
    counts = routes.counts()
    out: list[CellRecord] = []
    order = placement_order(cells, counts, exclude=[source], avoid=avoid, spread=spread)
    if version_of is not None:
        want = version_of(source)
        order = sorted(order, key=lambda x: version_of(x[0].cell_id) != want)  # stable
    for rec, free in order:
        while free > 0 and len(out) < n:
            out.append(rec)
            free -= 1
        if len(out) == n:
            break
    return out
