"""The packer's batches: which batch a request names, activation on the policy version of
its first claim, the pump that moves work forward after every change (ready groups into the
batch being filled, its segments packed, a full batch sealed and the next one opened), the
seal at burst end (fenced), and the optimizer-step bookkeeping: the core's attempts at a
batch (``open``) and its durable steps (``commit``). Also the demand of claimers waiting
for a micro-step, which lets partial bins go out.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound
from gyre.failpoints import failpoint
from gyre.fencing import FenceGuard
from gyre.ids import BatchId
from services.packer.config import PackerConfig
from services.packer.intake import Intake
from services.packer.journal import Journal
from services.packer.model import check_cell
from services.packer.packing import Packing
from services.packer.records import Batch
from services.packer.segments import split_segments

log = logging.getLogger(__name__)


class Batches:
    """Fills, seals, opens and commits batches; pumps work forward after every change."""

    def __init__(self, *, cfg: PackerConfig, journal: Journal, intake: Intake, packing: Packing) -> None:
        self.cfg = cfg
        self.journal = journal
        self.state = journal.state
        self.intake = intake
        self.packing = packing
        self.fence = FenceGuard()
        self._waiting: collections.Counter[int] = collections.Counter()  # batch -> waiting claimers

    def open_first(self) -> None:
        """Batch 1 exists from the start (a fresh log has none)."""
        if not self.state.batches:
            self.journal.commit({"t": "batch", "b": 1, "size": self.cfg.batch_size})

    def get(self, batch_id: int) -> Batch:
        """The batch ``batch_id`` names (0: the current one, open to joiners)."""
        st = self.state
        if batch_id == 0:
            return st.current_batch()
        batch = st.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"no batch {batch_id} (the batch being filled is {st.filling})")
        return batch

    def activate(self, batch: Batch, version: int) -> None:
        """Pins the batch to the claimer's policy version at its first claim; a claim on
        another version than the batch's is refused."""
        if batch.version is None:
            self.journal.commit({"t": "activate", "b": batch.id, "v": version})
            if version > self.state.policy_version:
                self.journal.commit({"t": "policy", "v": version})
        elif batch.version != version:
            raise FailedPrecondition(
                f"batch {batch.id} trains on policy version {batch.version}, not {version}"
            )

    # Demand ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def waiting(self, batch_id: BatchId) -> Iterator[None]:
        """A claimer waits for a micro-step of the batch: that is demand (partial bins go out)."""
        self._waiting[batch_id] += 1
        try:
            yield
        finally:
            self._waiting[batch_id] -= 1
            if self._waiting[batch_id] <= 0:
                del self._waiting[batch_id]

    def waiting_on(self, batch_id: int) -> int:
        """How many claimers wait for a micro-step of the batch."""
        return self._waiting.get(batch_id, 0)

    # The pump ----------------------------------------------------------------------------

    def pump(self, demand: set[BatchId] | None = None) -> None:
        """Moves work forward: stale ready groups out, ready groups into the active batch,
        sequences into micro-steps, full batches sealed."""
        st = self.state
        self.intake.resolve_due()
        batch = st.batches[st.filling]
        self.intake.drop_unusable(st.optimizing() or len(batch.groups) >= batch.size)
        if batch.active and not batch.sealed:
            while batch.needs > 0 and st.ready:
                self._assign(batch, next(iter(st.ready)))
            wanted = (demand is not None and batch.id in demand) or batch.id in self._waiting
            full = batch.needs == 0
            self.packing.pack(batch, flush=full or wanted)
            if full and not batch.pending:
                self._seal(batch)
        self._forget_old()

    def _assign(self, batch: Batch, gid: str) -> None:
        """A ready group joins the batch; its executions' turns are cut into trajectory
        segments here (services/packer/segments.py), once, and the event records them."""
        group = self.state.groups[gid]
        segs = {x: [list(s) for s in split_segments(e.turns)] for x, e in group.execs.items()}
        self.journal.commit({"t": "assign", "b": batch.id, "g": gid, "segs": segs})

    def _seal(self, batch: Batch) -> None:
        self.journal.commit({"t": "seal", "b": batch.id})
        self.journal.commit({"t": "batch", "b": batch.id + 1, "size": self.cfg.batch_size})
        # Sealed and the next batch opened in memory, not durable, no claimer told:
        failpoint("packer.batch.sealed")
        log.info(
            "batch sealed",
            extra={
                "batch_id": batch.id,
                "groups": len(batch.groups),
                "micro_steps": len(batch.micro_steps),
                "total_tokens": batch.total_loss_tokens,
            },
        )

    def _forget_old(self) -> None:
        """Drops the idempotency records of groups resolved ``dedupe_batches`` batches ago."""
        st = self.state
        old = []
        for gid, (resolved_in, _) in st.forgettable.items():
            if resolved_in > st.filling - self.cfg.dedupe_batches:
                break  # in resolution order: the rest are newer
            old.append(gid)
        if old:
            self.journal.commit({"t": "forget", "groups": old})

    # Commands ----------------------------------------------------------------------------

    async def seal(self, batch_id: int, epoch: int) -> Batch:
        """Seals a batch with the groups it has and the ready ones (burst end: no more groups
        will come for it). Fenced; idempotent. Groups assigned to a batch stay in it: the
        staleness rule applies to groups still waiting, not to a sealed batch's."""
        self.fence.check(epoch)
        st = self.state
        batch = self.get(batch_id or st.filling)
        if not batch.sealed:
            if not batch.groups and not st.ready:
                raise FailedPrecondition(f"batch {batch.id} has no groups to seal")
            # Whatever is ready goes in, even before a claim activated the batch.
            while batch.id == st.filling and batch.needs > 0 and st.ready:
                self._assign(batch, next(iter(st.ready)))
            self.packing.pack(batch, flush=True)
            self._seal(batch)
            self.journal.after()
        await self.journal.sync()
        return batch

    async def open_batch(self, cell_id: str, batch_id: int) -> Batch:
        """The core opens an attempt at ``batch_id``: its acks become leases until
        :meth:`commit`, and what an earlier attempt held or acked returns to the pool."""
        check_cell(cell_id)
        if batch_id <= 0:
            raise InvalidArgument(f"batch_id must be > 0, got {batch_id}")
        batch = self.get(batch_id)
        if batch.committed:
            raise FailedPrecondition(f"batch {batch.id} is committed")
        returned = sum(1 for m in batch.micro_steps if not m.committed and not m.free)
        self.journal.commit({"t": "open", "b": batch.id, "cell": cell_id})
        if returned:
            log.warning(
                "batch reopened: micro-steps of a failed attempt return to the pool",
                extra={"batch_id": batch.id, "attempt": batch.attempt, "returned": returned},
            )
        self.journal.after()
        await self.journal.sync()
        return batch

    async def commit(self, cell_id: str, batch_id: int) -> tuple[Batch, bool]:
        """The core's step of ``batch_id`` is durable: its micro-steps are trained for good.
        Returns (batch, duplicate)."""
        check_cell(cell_id)
        if batch_id <= 0:
            raise InvalidArgument(f"batch_id must be > 0, got {batch_id}")
        batch = self.get(batch_id)
        if batch.committed:
            await self.journal.sync()
            return batch, True
        if not batch.sealed or batch.acked != len(batch.micro_steps):
            raise FailedPrecondition(
                f"batch {batch.id} has {batch.acked} of {len(batch.micro_steps)} micro-steps acknowledged"
                + ("" if batch.sealed else " and is not sealed")
            )
        self.journal.commit({"t": "commit", "b": batch.id, "cell": cell_id})
        self.journal.after()
        await self.journal.sync()
        return batch, False

    # Queries -----------------------------------------------------------------------------

    def status(self, batch_id: int) -> dict[str, Any]:
        """A batch's state (GetBatch and the answers about batches), without the counters."""
        b = self.get(batch_id)
        return {
            "batch_id": b.id,
            "policy_version": b.version or 0,
            "batch_size": b.size,
            "groups_packed": len(b.groups),
            "micro_steps": len(b.micro_steps),
            "claimed": b.claimed,
            "acked": b.acked,
            "sealed": b.sealed,
            "total_tokens": b.total_loss_tokens,
            "closed": b.closed,
            "done": b.done,
            "active": b.active,
            "unclaimed": b.unclaimed,
            "participants": sorted(b.participants),
            "committed": b.committed,
            "attempt": b.attempt,
        }
