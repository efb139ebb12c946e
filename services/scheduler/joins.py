"""Training cells joining the trainer's batches: ``JoinBatch`` (the current batch, the
prefix size, the core's address) after a cell's move to training, and again after each new
version for a cell that stays in training (continuous dispatch), retried with backoff while
the cell trains and no move of it runs. Owns the join loops (one per cell at a time) and the
cells this leader term has joined; :class:`~services.scheduler.transitions.TransitionRunner`
starts the joins and cancels them with its other background work."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from gyre.backoff import Backoff
from gyre.errors import GyreError
from services.scheduler.fleet import CellGone
from services.scheduler.parts import Part, Shared
from services.scheduler.policy import CellState, training_set
from services.scheduler.publication import Publication
from services.scheduler.supply import SupplyFollower


class BatchJoins(Part):
    """JoinBatch for training cells, one loop per cell at a time."""

    def __init__(
        self,
        *,
        shared: Shared,
        publication: Publication,
        supply: SupplyFollower,
        moving: Callable[[str], bool],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        super().__init__(shared=shared)
        self.publication = publication
        self.supply = supply
        self._moving = moving
        """True while a transition of the cell runs (its join then stops)."""
        self._spawn = spawn
        """Runs a join in the background, with the transitions' other background work."""
        self._joins: dict[str, asyncio.Task[None]] = {}
        self._joined: set[str] = set()
        """Cells whose JoinBatch succeeded in this leader term."""

    def joined(self, cell_id: str) -> bool:
        return cell_id in self._joined

    def forget(self) -> None:
        self._joined.clear()

    def rejoin(self, cell_id: str) -> None:
        joining = self._joins.get(cell_id)
        if joining is None or joining.done():
            self.start(cell_id)

    def start(self, cell_id: str, after: asyncio.Task[None] | None = None) -> None:
        """Joins the cell (after ``after``, the move to training that calls it, finishes)."""
        self._joins[cell_id] = self._spawn(self._join(cell_id, after))

    async def _join_batch(self, cell_id: str, batch_id: int, version: int, prefix: int, core: str) -> bool:
        return await self.peers.join_batch(
            self.fleet.target(cell_id), self.lead.epoch, batch_id, version, prefix, core
        )

    async def _join(self, cell_id: str, after: asyncio.Task[None] | None = None) -> None:
        """JoinBatch(current batch) until the cell joins one, or leaves training (or the
        cluster), or a transition starts for it. A refusal (window closed, previous batch
        still stepping, no trainer) is retried with backoff: the next batch may take it. So
        is a cell that does not answer while it stays registered (a partition longer than a
        few command deadlines): giving up would leave it training without a batch, and
        nothing would train, publish or rejoin it again."""
        if after is not None:  # the move to training that spawned us finishes first
            await asyncio.wait([after])
        fleet, emit = self.fleet, self.telemetry.emit
        backoff, told = Backoff(0.5, 5.0), set()  # (event, batch) already emitted

        def once(event: str, batch_id: int, message: str) -> None:
            if (event, batch_id) not in told:
                told.add((event, batch_id))
                emit(event, message, cell_id=cell_id)

        while not self.lead.deposed.is_set():
            if fleet.cells.state(cell_id) is not CellState.TRAINING or self._moving(cell_id):
                return
            try:
                batch_id = await self.peers.current_batch()
            except GyreError:
                batch_id = self.supply.raw.batch_id
            views = fleet.cells.views()
            # Cells join in prefix order, so when cell i joins the prefix is [core .. i].
            rec = fleet.cells.get(cell_id)
            prefix = rec.index + 1 if rec is not None and rec.index >= 0 else len(training_set(views))
            core = next((fleet.cells.get(v.cell_id) for v in views if v.is_core), None)
            core_target = core.target if core is not None else ""
            version = self.publication.version
            try:
                joined = await fleet.call(
                    cell_id,
                    functools.partial(
                        self._join_batch, cell_id, batch_id, version, max(prefix, 1), core_target
                    ),
                    attempts=5,
                )
            except CellGone:
                emit(
                    "join_failed",
                    f"{cell_id} left the cluster before joining batch {batch_id}",
                    cell_id=cell_id,
                )
                return
            except GyreError as exc:  # unreachable, or refused: again while it trains
                once("join_failed", batch_id, f"{cell_id} could not join batch {batch_id}: {exc}; retrying")
                await backoff.sleep()
                continue
            if joined:
                self._joined.add(cell_id)
                emit(
                    "joined_batch",
                    f"{cell_id} joined batch {batch_id} (prefix {prefix}, v{version})",
                    cell_id=cell_id,
                )
                return
            once(
                "join_missed",
                batch_id,
                f"{cell_id} missed batch {batch_id} (prefix {prefix}, v{version}); retrying",
            )
            await backoff.sleep()
