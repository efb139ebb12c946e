"""The packer's claim table: cells claim disjoint micro-steps (one at a time, or several in
one call), idempotently on a claim id; a claim is a lease under ``claim_ttl_s`` that the
cell's calls renew (``keep``), that expires back to the pool, or that returns at once when
its cell is gone; acknowledgements record micro-steps trained, all or nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound
from gyre.failpoints import failpoint
from gyre.ids import BatchId, CellId
from services.packer.batches import Batches
from services.packer.config import PackerConfig
from services.packer.journal import Journal
from services.packer.model import ClaimOutcome, ClaimResult, MicroStepView, check_cell, check_id
from services.packer.packing import Packing
from services.packer.records import Batch

log = logging.getLogger(__name__)

MAX_CLAIM_ID_CHARS = 128
MAX_CLAIMS_PER_CALL = 64  # ClaimMicroSteps
MAX_ACKS_PER_CALL = 256  # AckMicroSteps


def _nth_key(claim_id: str, k: int) -> str:
    """The idempotency key of the k-th micro-step of a batched claim (k = 0: the claim's own)."""
    return f"{claim_id}#{k}" if claim_id and k else claim_id


class Claims:
    """Claims, acknowledgements, lease renewal and expiry of micro-steps."""

    def __init__(
        self,
        *,
        cfg: PackerConfig,
        clock: Callable[[], float],
        journal: Journal,
        batches: Batches,
        packing: Packing,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.journal = journal
        self.state = journal.state
        self.batches = batches
        self.packing = packing

    def recovered(self, now: float) -> None:
        """After a replay: held claims get a fresh TTL (their cells may still be training)."""
        for ms in self.state.micro_steps.values():
            if ms.holder is not None:
                ms.deadline = now + self.cfg.claim_ttl_s

    # Claims ------------------------------------------------------------------------------

    async def claim(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str = ""
    ) -> ClaimResult:
        """Claims the next free micro-step of a batch, waiting up to ``wait_s`` for one.
        Idempotent on ``claim_id``: a retry answers the micro-step the first call claimed
        while the cell still holds it."""
        result = await self._claim_unsynced(cell_id, batch_id, version, wait_s, claim_id)
        await self.journal.sync()
        return result

    async def _claim_unsynced(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str
    ) -> ClaimResult:
        """:meth:`claim` up to the WAL flush: the caller syncs the log before it answers."""
        cell = check_cell(cell_id)
        if claim_id:
            check_id(claim_id, "claim_id", MAX_CLAIM_ID_CHARS)
        if batch_id < 0:
            raise InvalidArgument(f"batch_id must be >= 0, got {batch_id}")
        if version < 0:
            raise InvalidArgument(f"policy_version must be >= 0, got {version}")
        if not math.isfinite(wait_s) or wait_s < 0:
            raise InvalidArgument(f"wait_s must be a finite number >= 0, got {wait_s}")
        wait_s = min(wait_s, self.cfg.max_claim_wait_s)
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        result = self._try_claim(cell, batch_id, version, claim_id)
        while result.outcome is ClaimOutcome.WAIT and loop.time() < until:
            with self.batches.waiting(result.batch_id):  # a waiting claimer is demand
                await self.journal.wait_changed(until - loop.time())
                result = self._try_claim(cell, batch_id, version, claim_id)
        if result.outcome is ClaimOutcome.CLAIMED:
            # The claim in memory and the WAL buffer, not durable, the cell not told:
            failpoint("packer.claim.granted")
        return result

    def _try_claim(self, cell: CellId, batch_id: int, version: int, claim_id: str = "") -> ClaimResult:
        st = self.state
        if self.reap_expired():
            self.journal.after()
        batch = self.batches.get(batch_id)
        earlier = st.micro_steps.get(batch.claim_keys.get((cell, claim_id), "")) if claim_id else None
        if earlier is not None and earlier.holder == cell:  # a retry of a claim that went through
            self._touch(cell)
            return self._result(ClaimOutcome.CLAIMED, batch, self.packing.view(earlier, batch))
        if batch.done or (batch.closed and cell not in batch.participants):
            return self._result(ClaimOutcome.CLOSED, batch)
        self.batches.activate(batch, version)
        self._touch(cell)
        self.batches.pump({batch.id})
        ms = st.micro_steps[next(iter(batch.free))] if batch.free else None
        if ms is None:
            self.journal.after()
            return self._result(ClaimOutcome.CLOSED if batch.closed else ClaimOutcome.WAIT, batch)
        self.journal.commit(
            {"t": "claim", "ms": ms.id, "cell": cell, "v": version, **({"key": claim_id} if claim_id else {})}
        )
        ms.deadline = self.clock() + self.cfg.claim_ttl_s
        self.journal.after()
        return self._result(ClaimOutcome.CLAIMED, batch, self.packing.view(ms, batch))

    async def claim_many(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str, max_n: int
    ) -> tuple[ClaimResult, list[MicroStepView]]:
        """Claims up to ``max_n`` micro-steps of a batch in one go, waiting up to ``wait_s``
        only for the first; one WAL flush makes them all durable. Idempotent on
        ``claim_id``: the k-th micro-step is claimed under the key ``claim_id#k``, so a retry
        answers what the first call claimed (and tops it up from the free micro-steps).
        Returns the first claim's result (its outcome when none was claimed) and the views."""
        if claim_id:
            check_id(claim_id, "claim_id", MAX_CLAIM_ID_CHARS - 8)
        if not 1 <= max_n <= MAX_CLAIMS_PER_CALL:
            raise InvalidArgument(f"max_micro_steps must be in 1..{MAX_CLAIMS_PER_CALL}, got {max_n}")
        first = await self._claim_unsynced(cell_id, batch_id, version, wait_s, _nth_key(claim_id, 0))
        views = [first.micro_step] if first.micro_step is not None else []
        if views and max_n > 1:
            views += self._claim_more(CellId(cell_id), first.batch_id, version, claim_id, max_n)
        await self.journal.sync()  # one flush for the whole claim (and whatever else is queued)
        return first, views

    def _claim_more(
        self, cell: CellId, batch_id: int, version: int, claim_id: str, max_n: int
    ) -> list[MicroStepView]:
        """The 2nd..``max_n``-th micro-steps of a batched claim whose first went through (so
        the batch is open to the cell on ``version``): what ``_try_claim`` under the keys
        ``claim_id#k`` would give, one after the other, with the per-claim bookkeeping
        (reaping, the cell's lease renewal, pumping, waking waiters) done once for all. It
        stops while as many micro-steps are free as other claims wait for one: when a
        batch streams in, a cell that joined it (waiting) gets its share instead of
        watching one batched claim take every micro-step that became free."""
        st = self.state
        batch = self.batches.get(batch_id)
        views: list[MicroStepView] = []
        pumped = False
        deadline = self.clock() + self.cfg.claim_ttl_s
        for k in range(1, max_n):
            key = _nth_key(claim_id, k)
            earlier = st.micro_steps.get(batch.claim_keys.get((cell, key), "")) if claim_id else None
            if earlier is not None and earlier.holder == cell:  # a retry: answer what it claimed
                views.append(self.packing.view(earlier, batch))
                continue
            if not batch.free and not pumped:
                self.batches.pump({batch.id})  # a claimer is demand: partial bins go out
                pumped = True
            if len(batch.free) <= self.batches.waiting_on(batch.id):
                break  # leave one to each cell waiting for a micro-step (a satellite joining)
            ms = st.micro_steps[next(iter(batch.free))]
            self.journal.commit(
                {"t": "claim", "ms": ms.id, "cell": cell, "v": version, **({"key": key} if claim_id else {})}
            )
            ms.deadline = deadline
            views.append(self.packing.view(ms, batch))
        self._touch(cell)
        self.journal.after()
        return views

    def _result(self, outcome: ClaimOutcome, batch: Batch, view: MicroStepView | None = None) -> ClaimResult:
        return ClaimResult(outcome, BatchId(batch.id), batch.version or 0, self.cfg.claim_ttl_s, view)

    # Acknowledgements --------------------------------------------------------------------

    async def ack(self, cell_id: str, batch_id: int, micro_step_id: str) -> bool:
        """Records a micro-step trained; True when it had been acknowledged before."""
        return (await self.ack_many(cell_id, batch_id, [micro_step_id]))[0]

    async def ack_many(self, cell_id: str, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        """Records micro-steps trained, all or nothing, with one WAL flush; per micro-step,
        True when it had been acknowledged before."""
        cell = check_cell(cell_id)
        if not 1 <= len(micro_step_ids) <= MAX_ACKS_PER_CALL:
            raise InvalidArgument(
                f"acknowledge 1..{MAX_ACKS_PER_CALL} micro-steps, got {len(micro_step_ids)}"
            )
        if len(set(micro_step_ids)) != len(micro_step_ids):
            raise InvalidArgument("micro_step_ids repeat a micro-step")
        if self.reap_expired():
            self.journal.after()
        dups = [self._check_ack(cell, batch_id, m) for m in micro_step_ids]  # refuses before any commit
        if not all(dups):
            for m, dup in zip(micro_step_ids, dups, strict=True):
                if not dup:
                    # Held by this cell, or this cell's claim lapsed and nobody retook it: either
                    # way it is trained exactly once by accepting this ack.
                    self.journal.commit({"t": "ack", "ms": m, "cell": cell})
            self._touch(cell)
            self.journal.after()
        await self.journal.sync()
        return dups

    def _check_ack(self, cell: CellId, batch_id: int, micro_step_id: str) -> bool:
        """Raises when ``cell`` may not acknowledge the micro-step; True when it already did."""
        ms = self.state.micro_steps.get(micro_step_id)
        if ms is None or (batch_id and ms.batch_id != batch_id):
            raise NotFound(f"no micro-step {micro_step_id!r} in batch {batch_id or 'any'}")
        if ms.acked_by is not None:
            if ms.acked_by != cell:
                raise FailedPrecondition(f"micro-step {ms.id} was trained by {ms.acked_by}")
            return True
        if ms.holder is not None and ms.holder != cell:
            raise FailedPrecondition(
                f"micro-step {ms.id} is held by {ms.holder}, not {cell} (a lapsed claim was retaken)"
            )
        if ms.holder is None and ms.released_from != cell:
            raise FailedPrecondition(f"micro-step {ms.id} is not claimed by {cell}")
        return False

    # Leases ------------------------------------------------------------------------------

    async def keep(self, cell_id: str) -> int:
        """Renews a cell's claims; returns how many it holds."""
        cell = check_cell(cell_id)
        if self.reap_expired():
            self.journal.after()
        n = self._touch(cell)
        await self.journal.sync()
        return n

    async def release_cell(self, cell_id: str) -> int:
        """A cell is gone (its etcd registration vanished): its claims return to the pool
        now rather than after their TTL. Returns how many."""
        mine = [ms for ms in self.state.held.values() if ms.holder == cell_id]
        for ms in mine:
            log.info("claim returned: cell gone", extra={"cell_id": cell_id, "micro_step": ms.id})
            self.journal.commit({"t": "release", "ms": ms.id, "cell": cell_id})
        if mine:
            self.journal.after()
            await self.journal.sync()
        return len(mine)

    def reap_expired(self) -> int:
        """Returns the claims whose TTL ran out to the pool; how many (the caller signals the change)."""
        now = self.clock()
        expired = [ms for ms in self.state.held.values() if ms.deadline <= now]
        for ms in expired:
            log.info("claim expired", extra={"cell_id": ms.holder, "micro_step": ms.id})
            self.journal.commit({"t": "release", "ms": ms.id, "cell": ms.holder})
        return len(expired)

    def _touch(self, cell: CellId) -> int:
        deadline, n = self.clock() + self.cfg.claim_ttl_s, 0
        for ms in self.state.held.values():
            if ms.holder == cell:
                ms.deadline = deadline
                n += 1
        return n
