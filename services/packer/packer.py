"""The packer's controller: validates requests against the state, decides (readiness,
advantages, staleness, batch assignment, packing, claims, expiry), and commits each decision
as an event: applied in memory, appended to the WAL, made durable before the caller hears.

Every public operation runs its checks and its commits without awaiting in between, so
concurrent callers on the one event loop see each other's effects atomically (no two claims
can take the same micro-step). A refused request raises before its first commit and so
changes nothing. After every change the conservation invariant is rechecked; a violation
is a bug and stops the process (FatalError).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from gyre.errors import FailedPrecondition, FatalError, InvalidArgument, NotFound, ResourceExhausted
from gyre.failpoints import failpoint
from gyre.fencing import FenceGuard
from gyre.ids import BatchId, CellId, check_idempotency_key
from gyre.staleness import unconsumable
from services.packer.advantages import group_advantages, is_stale, reward_std
from services.packer.config import PackerConfig
from services.packer.model import (
    ClaimOutcome,
    ClaimResult,
    Finish,
    MicroStepView,
    PackedSequence,
    Turn,
    WireCache,
    check_cell,
    check_id,
)
from services.packer.packing import first_fit_decreasing
from services.packer.records import Batch, Event, Group, GroupState, MicroStep
from services.packer.segments import Segment, split_segments
from services.packer.state import PackerState
from services.packer.wal import EventLog

log = logging.getLogger(__name__)

MAX_CLAIM_ID_CHARS = 128
MAX_CLAIMS_PER_CALL = 64  # ClaimMicroSteps
MAX_ACKS_PER_CALL = 256  # AckMicroSteps


def _nth_key(claim_id: str, k: int) -> str:
    """The idempotency key of the k-th micro-step of a batched claim (k = 0: the claim's own)."""
    return f"{claim_id}#{k}" if claim_id and k else claim_id


LATE_TURN = "came after its finish report and its group's readiness"
"""The end of the message refusing a turn whose group was complete (the history checker reads
it in the router's ``turn_refused`` operations: a late turn of a group that trained is lost)."""


class Packer:
    """The trajectory buffer, packing buffer and claim table of one packer process."""

    def __init__(
        self,
        config: PackerConfig,
        log_: EventLog,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = True,
    ) -> None:
        self.cfg = config
        self.log = log_
        self.clock = clock
        self.strict = strict  # recheck conservation after every change (else: every reap)
        self.state = PackerState()
        self.fence = FenceGuard()
        self._wake = asyncio.Event()
        self._waiting: collections.Counter[int] = collections.Counter()  # batch -> waiting claimers
        self.changes = 0  # bumped on every change (supply watchers compare it)
        self.fatal: BaseException | None = None
        self._complete: dict[str, float] = {}  # all closed, in the grace period -> since
        self._ready_floor = float("-inf")  # no group becomes ready before (restart_grace_s)
        self._scanned: tuple[int, bool, int, str | None] | None = None  # see _pump
        self.turns_replaced = 0  # a retried model call's answer over its first try's (runtime count)
        self.late_turns = 0  # refused: their group was already ready (runtime count)
        self.skipped: list[int] = []  # WAL events set aside at recovery (see recover)
        # Wire forms of the sequences of ready groups (config pre_encode): claims answer
        # from them instead of building protos (services.packer.model.WireCache).
        self.wire = WireCache()

    # Start-up ----------------------------------------------------------------------------

    def recover(self, events: Iterable[Event]) -> int:
        """Replays the WAL; held claims get a fresh TTL (their cells may still be training).

        An event that no longer applies (it depends on a record the WAL quarantined as
        corrupt) is set aside with an error, and replay goes on; the invariants are then
        checked in full, and a state that is still inconsistent stops the process."""
        n = 0
        restart = False  # any record beyond a WAL header: this log held a run before
        self.skipped = []
        for k, ev in enumerate(events):
            restart = restart or ev.get("t") != "wal"
            try:
                self.state.apply(ev)
            except (KeyError, ValueError, TypeError, FatalError) as exc:
                self.skipped.append(k)
                log.error(
                    "packer WAL: an event does not apply (a record it depends on was lost); set aside",
                    extra={"event": k, "type": ev.get("t"), "error": repr(exc)},
                )
                continue
            n += 1
        if self.skipped:
            self.state.check(deep=True)
        now = self.clock()
        for ms in self.state.micro_steps.values():
            if ms.holder is not None:
                ms.deadline = now + self.cfg.claim_ttl_s
        for group in self.state.groups.values():
            if group.state is GroupState.COLLECTING and group.size and group.closed >= group.size:
                self._complete[group.id] = now  # the grace period restarts
        if restart:
            # A restart: the routers may hold turns queued while we were down, whose groups'
            # finish reports the scheduler may relay first; they get in before any group is
            # made ready (a later turn would be refused, and lost).
            self._ready_floor = now + self.cfg.restart_grace_s
        if not self.state.batches:
            self._commit({"t": "batch", "b": 1, "size": self.cfg.batch_size})
        self._after()
        return n

    # Commands ----------------------------------------------------------------------------

    async def record_turn(self, turn: Turn) -> bool:
        """Buffers one turn; True when it had been recorded before (idempotent).

        A turn whose idempotency key its execution already holds is a retry of that model
        call (sent again after its router died): it takes the first try's index; with the
        same content it is a duplicate, with other content it replaces the first try (the
        harness got only the retry's answer, and its next prompt continues that one)."""
        st = self.state
        replaces = False
        ex = st.execs.get(turn.execution_id) if turn.call_key else None
        if ex is not None and turn.call_key in ex.call_keys:
            first = ex.turns[ex.call_keys[turn.call_key]]
            if first.prompt != turn.prompt:
                raise FailedPrecondition(
                    f"idempotency key {turn.call_key!r} of {turn.execution_id} was recorded for "
                    f"another prompt (turn {first.turn_index})"
                )
            turn = dataclasses.replace(turn, turn_index=first.turn_index)
            replaces = st.seen_turns.get(turn.key) != turn.digest()
        digest = st.seen_turns.get(turn.key)
        if replaces:
            digest = None  # recorded below, over the first try
        if digest is not None:
            if digest != turn.digest():
                raise FailedPrecondition(
                    f"turn {turn.turn_index} of {turn.execution_id} was recorded with other content"
                )
            await self.log.sync()
            return True
        self._check_membership(turn.execution_id, turn.group_id)
        group = st.groups.get(turn.group_id)
        if turn.group_id in st.resolved or (group is not None and group.state is not GroupState.COLLECTING):
            self.late_turns += 1
            raise FailedPrecondition(
                f"group {turn.group_id} is already complete; turn {turn.turn_index} of "
                f"{turn.execution_id} {LATE_TURN}"
            )
        if not replaces and self._held() >= self.cfg.max_buffered_turns:
            raise ResourceExhausted(f"the packer holds {self._held()} turns (max_buffered_turns)")
        if replaces:
            self.turns_replaced += 1
            log.info(
                "a retried model call replaced its first try's turn",
                extra={"execution_id": turn.execution_id, "turn_index": turn.turn_index},
            )
        self._commit({"t": "turn", "turn": turn.to_json()})
        self._after()
        await self.log.sync()
        failpoint("packer.turn.durable")  # the turn in the WAL, the router not yet answered
        return False

    async def report_finish(self, finish: Finish) -> bool:
        """Closes an execution; True when it had been reported before (idempotent)."""
        st = self.state
        prev = st.finished.get(finish.execution_id)
        if prev is not None:
            if prev != finish:
                raise FailedPrecondition(
                    f"execution {finish.execution_id} was reported finished with other content"
                )
            await self.log.sync()
            return True
        self._check_membership(finish.execution_id, finish.group_id)
        if finish.group_id in st.resolved:
            raise FailedPrecondition(f"group {finish.group_id} is already complete")
        group = st.groups.get(finish.group_id)
        if group is not None:
            if group.size and group.size != finish.group_size:
                raise InvalidArgument(
                    f"group {finish.group_id} has group_size {group.size}, not {finish.group_size}"
                )
            if group.state is not GroupState.COLLECTING or group.closed >= finish.group_size:
                raise FailedPrecondition(
                    f"group {finish.group_id} already has its {group.size} closed executions"
                )
        self._commit({"t": "finish", "finish": finish.to_json()})
        group = st.groups[finish.group_id]
        if group.closed >= group.size:
            self._complete[group.id] = self.clock()
        self._after()
        await self.log.sync()
        failpoint("packer.finish.durable")  # the finish in the WAL, the scheduler not yet answered
        return False

    async def claim(
        self, cell_id: str, batch_id: int, version: int, wait_s: float, claim_id: str = ""
    ) -> ClaimResult:
        """Claims the next free micro-step of a batch, waiting up to ``wait_s`` for one.
        Idempotent on ``claim_id``: a retry answers the micro-step the first call claimed
        while the cell still holds it."""
        result = await self._claim_unsynced(cell_id, batch_id, version, wait_s, claim_id)
        await self.log.sync()
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
            waiting_on = result.batch_id
            self._waiting[waiting_on] += 1  # a waiting claimer is demand: partial bins go out
            try:
                await self.wait_changed(until - loop.time())
                result = self._try_claim(cell, batch_id, version, claim_id)
            finally:
                self._waiting[waiting_on] -= 1
                if self._waiting[waiting_on] <= 0:
                    del self._waiting[waiting_on]
        if result.outcome is ClaimOutcome.CLAIMED:
            # The claim in memory and the WAL buffer, not durable, the cell not told:
            failpoint("packer.claim.granted")
        return result

    def _try_claim(self, cell: CellId, batch_id: int, version: int, claim_id: str = "") -> ClaimResult:
        st = self.state
        if self._reap():
            self._after()
        batch = self._batch(batch_id)
        earlier = st.micro_steps.get(batch.claim_keys.get((cell, claim_id), "")) if claim_id else None
        if earlier is not None and earlier.holder == cell:  # a retry of a claim that went through
            self._touch(cell)
            return self._result(ClaimOutcome.CLAIMED, batch, self._view(earlier, batch))
        if batch.done or (batch.closed and cell not in batch.participants):
            return self._result(ClaimOutcome.CLOSED, batch)
        if batch.version is None:
            self._commit({"t": "activate", "b": batch.id, "v": version})
            if version > st.policy_version:
                self._commit({"t": "policy", "v": version})
        elif batch.version != version:
            raise FailedPrecondition(
                f"batch {batch.id} trains on policy version {batch.version}, not {version}"
            )
        self._touch(cell)
        demand = {batch.id}
        self._pump(demand)
        ms = st.micro_steps[next(iter(batch.free))] if batch.free else None
        if ms is None:
            self._after()
            return self._result(ClaimOutcome.CLOSED if batch.closed else ClaimOutcome.WAIT, batch)
        self._commit(
            {"t": "claim", "ms": ms.id, "cell": cell, "v": version, **({"key": claim_id} if claim_id else {})}
        )
        ms.deadline = self.clock() + self.cfg.claim_ttl_s
        self._after()
        return self._result(ClaimOutcome.CLAIMED, batch, self._view(ms, batch))

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
        await self.log.sync()  # one flush for the whole claim (and whatever else is queued)
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
        batch = self._batch(batch_id)
        views: list[MicroStepView] = []
        pumped = False
        deadline = self.clock() + self.cfg.claim_ttl_s
        for k in range(1, max_n):
            key = _nth_key(claim_id, k)
            earlier = st.micro_steps.get(batch.claim_keys.get((cell, key), "")) if claim_id else None
            if earlier is not None and earlier.holder == cell:  # a retry: answer what it claimed
                views.append(self._view(earlier, batch))
                continue
            if not batch.free and not pumped:
                self._pump({batch.id})  # a claimer is demand: partial bins go out
                pumped = True
            if len(batch.free) <= self._waiting.get(batch.id, 0):
                break  # leave one to each cell waiting for a micro-step (a satellite joining)
            ms = st.micro_steps[next(iter(batch.free))]
            self._commit(
                {"t": "claim", "ms": ms.id, "cell": cell, "v": version, **({"key": key} if claim_id else {})}
            )
            ms.deadline = deadline
            views.append(self._view(ms, batch))
        self._touch(cell)
        self._after()
        return views

    async def ack(self, cell_id: str, batch_id: int, micro_step_id: str) -> bool:
        """Records a micro-step trained; True when it had been acknowledged before."""
        return (await self.ack_many(cell_id, batch_id, [micro_step_id]))[0]

    async def ack_many(
        self, cell_id: str, batch_id: int, micro_step_ids: list[str], sync: bool = True
    ) -> list[bool]:
        """Records micro-steps trained, all or nothing, with one WAL flush; per micro-step,
        True when it had been acknowledged before. ``sync=False``: without the flush (the
        caller flushes with :meth:`sync` before it answers, e.g. with a claim after it)."""
        cell = check_cell(cell_id)
        if not 1 <= len(micro_step_ids) <= MAX_ACKS_PER_CALL:
            raise InvalidArgument(
                f"acknowledge 1..{MAX_ACKS_PER_CALL} micro-steps, got {len(micro_step_ids)}"
            )
        if len(set(micro_step_ids)) != len(micro_step_ids):
            raise InvalidArgument("micro_step_ids repeat a micro-step")
        if self._reap():
            self._after()
        dups = [self._check_ack(cell, batch_id, m) for m in micro_step_ids]  # refuses before any commit
        if not all(dups):
            for m, dup in zip(micro_step_ids, dups, strict=True):
                if not dup:
                    # Held by this cell, or this cell's claim lapsed and nobody retook it: either
                    # way it is trained exactly once by accepting this ack.
                    self._commit({"t": "ack", "ms": m, "cell": cell})
            self._touch(cell)
            self._after()
        if sync:
            await self.log.sync()
        return dups

    async def sync(self) -> None:
        """Makes everything changed so far durable (one WAL flush, shared with the others)."""
        await self.log.sync()

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

    async def open_batch(self, cell_id: str, batch_id: int) -> Batch:
        """The core opens an attempt at ``batch_id``: its acks become leases until
        :meth:`commit`, and what an earlier attempt held or acked returns to the pool."""
        check_cell(cell_id)
        if batch_id <= 0:
            raise InvalidArgument(f"batch_id must be > 0, got {batch_id}")
        batch = self._batch(batch_id)
        if batch.committed:
            raise FailedPrecondition(f"batch {batch.id} is committed")
        returned = sum(1 for m in batch.micro_steps if not m.committed and not m.free)
        self._commit({"t": "open", "b": batch.id, "cell": cell_id})
        if returned:
            log.warning(
                "batch reopened: micro-steps of a failed attempt return to the pool",
                extra={"batch_id": batch.id, "attempt": batch.attempt, "returned": returned},
            )
        self._after()
        await self.log.sync()
        return batch

    async def commit(self, cell_id: str, batch_id: int) -> tuple[Batch, bool]:
        """The core's step of ``batch_id`` is durable: its micro-steps are trained for good.
        Returns (batch, duplicate)."""
        check_cell(cell_id)
        if batch_id <= 0:
            raise InvalidArgument(f"batch_id must be > 0, got {batch_id}")
        batch = self._batch(batch_id)
        if batch.committed:
            await self.log.sync()
            return batch, True
        if not batch.sealed or batch.acked != len(batch.micro_steps):
            raise FailedPrecondition(
                f"batch {batch.id} has {batch.acked} of {len(batch.micro_steps)} micro-steps acknowledged"
                + ("" if batch.sealed else " and is not sealed")
            )
        self._commit({"t": "commit", "b": batch.id, "cell": cell_id})
        self._after()
        await self.log.sync()
        return batch, False

    async def keep(self, cell_id: str) -> int:
        """Renews a cell's claims; returns how many it holds."""
        cell = check_cell(cell_id)
        if self._reap():
            self._after()
        n = self._touch(cell)
        await self.log.sync()
        return n

    async def seal(self, batch_id: int, epoch: int) -> Batch:
        """Seals a batch with the groups it has and the ready ones (burst end: no more groups
        will come for it). Fenced; idempotent. Groups assigned to a batch stay in it: the
        staleness rule applies to groups still waiting, not to a sealed batch's."""
        self.fence.check(epoch)
        st = self.state
        batch = self._batch(batch_id or st.filling)
        if not batch.sealed:
            if not batch.groups and not st.ready:
                raise FailedPrecondition(f"batch {batch.id} has no groups to seal")
            # Whatever is ready goes in, even before a claim activated the batch.
            while batch.id == st.filling and batch.needs > 0 and st.ready:
                self._assign(batch, next(iter(st.ready)))
            self._pack(batch, flush=True)
            self._seal(batch)
            self._after()
        await self.log.sync()
        return batch

    async def release_cell(self, cell_id: str) -> int:
        """A cell is gone (its etcd registration vanished): its claims return to the pool
        now rather than after their TTL. Returns how many."""
        mine = [ms for ms in self.state.held.values() if ms.holder == cell_id]
        for ms in mine:
            log.info("claim returned: cell gone", extra={"cell_id": cell_id, "micro_step": ms.id})
            self._commit({"t": "release", "ms": ms.id, "cell": cell_id})
        if mine:
            self._after()
            await self.log.sync()
        return len(mine)

    async def observe_policy(self, version: int) -> None:
        """A newer policy version (from etcd): stale ready groups are dropped."""
        if version > self.state.policy_version:
            self._commit({"t": "policy", "v": version})
            self._after()
            await self.log.sync()

    async def reap(self) -> int:
        """Periodic work: returns expired claims to the pool (how many) and makes groups
        whose grace period has passed ready."""
        n = self._reap()
        if n or self._complete:
            self._after()
            await self.log.sync()
        self.wire.keep(self.state.execs)  # executions trained or dropped: their bytes go
        return n

    async def run_reaper(self) -> None:
        """A supervised task: expiry of claims, the invariants' recount when they are not
        checked after every change (``strict``), and the fatal-error watch."""
        while True:
            await asyncio.sleep(self.cfg.reap_interval_s)
            if not self.strict and self.fatal is None:
                try:
                    self.state.check()
                except FatalError as exc:
                    self.fatal = exc
            if self.fatal is not None:
                raise FatalError(f"packer invariant broken: {self.fatal}")
            await self.reap()

    # Queries -----------------------------------------------------------------------------

    def trajectory(self, execution_id: str, call_key: str = "") -> tuple[Turn | None, int]:
        """Where an execution's token sequence stands (GetTrajectory): the turn a new model
        call of it continues (None: there is none) and the index that call's turn takes. A
        call whose idempotency key the execution holds is a retry of that call: it continues
        the turn before its first try's, and takes the first try's index."""
        check_id(execution_id, "execution_id")
        if call_key:
            check_idempotency_key(call_key)
        ex = self.state.execs.get(execution_id)
        if ex is None or not ex.turns:
            return None, 0
        index = ex.call_keys.get(call_key) if call_key else None
        if index is None:
            index = max(ex.turns) + 1
        before = [i for i in ex.turns if i < index]
        return (ex.turns[max(before)] if before else None), index

    def batch_status(self, batch_id: int) -> dict[str, Any]:
        b = self._batch(batch_id)
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
            "counters": self.counters(),
        }

    def counters(self) -> dict[str, Any]:
        return {**self.state.counters(), "late_turns": self.late_turns, "turns_replaced": self.turns_replaced}

    def supply(self) -> dict[str, Any]:
        """The training supply of the batch open to joiners (the current one): groups ready
        and not yet fully claimed, i.e. its groups with unclaimed turns plus, while it is
        being filled, the ready groups waiting for it; capped by what it still needs (its
        size less the groups already fully claimed; once sealed, its groups with unclaimed
        turns). This is what another training cell could still take a share of."""
        st = self.state
        batch = st.current_batch()
        open_groups = len(st.groups_with_unclaimed_work(batch))
        if batch.sealed:
            needs = open_groups
        else:
            needs = batch.size - (len(batch.groups) - open_groups)
        waiting = len(st.ready) if batch.id == st.filling and not batch.sealed else 0
        return {
            "ready_groups": min(open_groups + waiting, needs),
            "batch_needs": needs,
            "batch_id": batch.id,
            "dropped": dict(st.dropped),
            "batch_active": batch.active,
            "unclaimed_micro_steps": sum(b.unclaimed for b in st.batches.values() if not b.done),
            "ready_unassigned": len(st.ready),
            "counters": self.counters(),
            "ready_tokens": float(sum(st.group_tokens(st.groups[g]) for g in st.ready)),
            "backlog_tokens": float(st.backlog_tokens()),
            "tokens_trained": float(st.tokens_trained),
            "optimizing": st.optimizing(),
            "batch_assigned": len(batch.groups),
            "groups_ready_total": st.groups_ready_total,
            "groups_filtered": st.groups_filtered,
        }

    async def wait_changed(self, timeout_s: float | None) -> None:
        """Returns at the next change, or after ``timeout_s``."""
        wake = self._wake
        try:
            await asyncio.wait_for(wake.wait(), timeout_s)
        except TimeoutError:
            pass

    # Decisions ---------------------------------------------------------------------------

    def _resolve(self, group: Group) -> None:
        """A group whose executions have all closed becomes ready, or is dropped (and why)."""
        if group.state is not GroupState.COLLECTING or not group.size or group.closed < group.size:
            return
        cfg = self.cfg
        members = {x: e for x, e in group.execs.items() if e.finish is not None}
        drop_x = {x: "unfinished" for x, e in group.execs.items() if e.finish is None}
        failed = [x for x, e in members.items() if e.finish is not None and not e.finish.status.ok]
        if failed:
            if cfg.failed_member_rule == "drop_group":
                return self._drop(group, "failed_group")
            drop_x.update({x: "failed_execution" for x in failed})
            if len(members) - len(failed) < cfg.min_group_members:
                return self._drop(group, "failed_group")
        kept = {x: e for x, e in members.items() if x not in drop_x}
        if not any(e.turns for e in kept.values()):
            return self._drop(group, "empty")
        rewards = {x: e.finish.reward for x, e in kept.items() if e.finish is not None}
        if any(abs(r) > cfg.max_abs_reward for r in rewards.values()):
            # Only a WAL written before rewards were bounded holds these: their statistics
            # overflow, so the group goes and the packer stays up (no crash loop on replay).
            return self._drop(group, "invalid_reward")
        if cfg.drop_zero_variance and reward_std(list(rewards.values())) <= cfg.zero_variance_tol:
            return self._drop(group, "zero_variance")
        oldest = min(
            t.oldest_version(e.finish.policy_version)
            for e in kept.values()
            if e.finish is not None
            for t in e.turns.values()
        )
        if is_stale(self._age_of(group, oldest), self.state.policy_version, cfg.max_staleness):
            return self._drop(group, "stale")
        adv = group_advantages(rewards, cfg.advantage_std_normalize, cfg.advantage_eps)
        if not all(math.isfinite(a) for a in adv.values()):
            return self._drop(group, "invalid_reward")  # never with bounded rewards; a last guard
        self._commit({"t": "ready", "g": group.id, "adv": adv, "oldest": oldest, "drop_x": drop_x})
        if cfg.pre_encode:
            # Encoded now, while rollouts arrive, rather than on the claim path: the same
            # segments the group's assignment will cut (split_segments of the same turns).
            for x in adv:
                turns = self.state.execs[x].turns
                for indexes in split_segments(turns):
                    self.wire.put(self._sequence(x, indexes))

    def _drop(self, group: Group, reason: str) -> None:
        log.info("group dropped", extra={"group_id": group.id, "reason": reason, "turns": group.turns})
        self._commit({"t": "drop", "g": group.id, "reason": reason})

    def _age_of(self, group: Group, oldest: int) -> int:
        """The version staleness is judged by: the oldest token's (cancel rule), or the
        group's stamp (partial rule: a restamped group keeps its older tokens)."""
        return self.state.stamp(group) if self.cfg.stale_rule == "partial" else oldest

    def _pump(self, demand: set[BatchId] | None = None) -> None:
        """Moves work forward: stale ready groups out, ready groups into the active batch,
        sequences into micro-steps, full batches sealed."""
        st, cfg = self.state, self.cfg
        now = self.clock()
        for gid, since in list(self._complete.items()) if now >= self._ready_floor else ():
            if now - since >= cfg.ready_grace_s:
                del self._complete[gid]
                self._resolve(st.groups[gid])
        batch = st.batches[st.filling]
        full = st.optimizing() or len(batch.groups) >= batch.size
        # Whether a ready group is stale or unconsumable depends only on its own versions
        # (fixed once it is ready) and on (policy version, batch full): scan again only when
        # those changed or a group became ready since (it joins st.ready at the end). The
        # scan was O(ready groups x members) on every claim and change.
        for gid in list(st.ready) if self._scan_key(full) != self._scanned else ():
            group = st.groups[gid]
            if is_stale(self._age_of(group, group.oldest_version), st.policy_version, cfg.max_staleness):
                self._drop(group, "stale")
            elif unconsumable(st.stamp(group), st.policy_version, full, cfg.max_staleness):
                # The scheduler's cancel-early rule (gyre.staleness): no batch within eta can
                # take it; its open members are being cancelled, its ready copy goes too.
                self._drop(group, "unconsumable")
        self._scanned = self._scan_key(full)
        if batch.active and not batch.sealed:
            while batch.needs > 0 and st.ready:
                self._assign(batch, next(iter(st.ready)))
            wanted = (demand is not None and batch.id in demand) or batch.id in self._waiting
            full = batch.needs == 0
            self._pack(batch, flush=full or wanted)
            if full and not batch.pending:
                self._seal(batch)
        self._forget_old()

    def _scan_key(self, full: bool) -> tuple[int, bool, int, str | None]:
        """What the ready groups' staleness depends on besides their own versions: the policy
        version, the filling batch's fullness, and the ready set (new groups join at its end)."""
        st = self.state
        return st.policy_version, full, len(st.ready), next(reversed(st.ready), None)

    def _forget_old(self) -> None:
        """Drops the idempotency records of groups resolved ``dedupe_batches`` batches ago."""
        st = self.state
        old = []
        for gid, (resolved_in, _) in st.forgettable.items():
            if resolved_in > st.filling - self.cfg.dedupe_batches:
                break  # in resolution order: the rest are newer
            old.append(gid)
        if old:
            self._commit({"t": "forget", "groups": old})

    def _assign(self, batch: Batch, gid: str) -> None:
        """A ready group joins the batch; its executions' turns are cut into trajectory
        segments here (services/packer/segments.py), once, and the event records them."""
        group = self.state.groups[gid]
        segs = {x: [list(s) for s in split_segments(e.turns)] for x, e in group.execs.items()}
        self._commit({"t": "assign", "b": batch.id, "g": gid, "segs": segs})

    def _pack(self, batch: Batch, flush: bool) -> None:
        """First-fit decreasing over the batch's unpacked segments (each costs all its tokens
        once); emits bins that are full enough (or every bin when ``flush``); the rest wait
        for more sequences."""
        if not batch.pending:
            return
        st, budget = self.state, self.cfg.micro_step_token_budget
        sizes = {ref: st.segment_tokens(ref) for ref in batch.pending}
        bins = first_fit_decreasing([(ref, sizes[ref]) for ref in batch.pending], budget)
        threshold = self.cfg.emit_fill_fraction * budget
        emitted = len(batch.micro_steps)
        for refs in bins:
            if flush or sum(sizes[r] for r in refs) >= threshold:
                self._commit(
                    {
                        "t": "emit",
                        "b": batch.id,
                        "ms": f"b{batch.id}-m{emitted}",
                        "seqs": [[x, i] for x, i in refs],
                    }
                )
                emitted += 1

    def _seal(self, batch: Batch) -> None:
        self._commit({"t": "seal", "b": batch.id})
        self._commit({"t": "batch", "b": batch.id + 1, "size": self.cfg.batch_size})
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

    def _reap(self) -> int:
        now = self.clock()
        expired = [ms for ms in self.state.held.values() if ms.deadline <= now]
        for ms in expired:
            log.info("claim expired", extra={"cell_id": ms.holder, "micro_step": ms.id})
            self._commit({"t": "release", "ms": ms.id, "cell": ms.holder})
        return len(expired)

    def _touch(self, cell: CellId) -> int:
        deadline, n = self.clock() + self.cfg.claim_ttl_s, 0
        for ms in self.state.held.values():
            if ms.holder == cell:
                ms.deadline = deadline
                n += 1
        return n

    # Plumbing ----------------------------------------------------------------------------

    def _commit(self, ev: Event) -> None:
        self.state.apply(ev)
        self.log.append(ev)

    def _after(self) -> None:
        """After every change: move work forward, check invariants, wake waiters."""
        self._pump()
        if self.strict:
            try:
                self.state.check()
            except FatalError as exc:
                self.fatal = exc
                raise
        self.changes += 1
        self._wake.set()
        self._wake = asyncio.Event()

    def _check_membership(self, execution_id: str, group_id: str) -> None:
        st = self.state
        known = st.execs.get(execution_id)
        owner = known.group_id if known is not None else None
        if owner is None and execution_id in st.finished:
            owner = st.finished[execution_id].group_id
        if owner is not None and owner != group_id:
            raise InvalidArgument(f"execution {execution_id} belongs to group {owner}, not {group_id}")

    def _held(self) -> int:
        st = self.state
        return st.produced - st.consumed - sum(st.dropped.values())

    def _batch(self, batch_id: int) -> Batch:
        st = self.state
        if batch_id == 0:
            return st.current_batch()
        batch = st.batches.get(batch_id)
        if batch is None:
            raise NotFound(f"no batch {batch_id} (the batch being filled is {st.filling})")
        return batch

    def _result(self, outcome: ClaimOutcome, batch: Batch, view: MicroStepView | None = None) -> ClaimResult:
        return ClaimResult(outcome, BatchId(batch.id), batch.version or 0, self.cfg.claim_ttl_s, view)

    def _view(self, ms: MicroStep, batch: Batch) -> MicroStepView:
        st = self.state
        seqs = tuple(self._sequence(x, st.execs[x].segments[i]) for x, i in ms.seqs)
        return MicroStepView(
            ms.id, BatchId(batch.id), batch.version or 0, seqs, ms.loss_tokens, ms.packed_tokens
        )

    def _sequence(self, execution_id: str, indexes: tuple[int, ...]) -> PackedSequence:
        """The packed sequence of one segment (turn ``indexes`` of a ready execution)."""
        ex = self.state.execs[execution_id]
        segment = Segment(tuple(ex.turns[i] for i in indexes))
        fallback = ex.finish.policy_version if ex.finish is not None else 0
        advantage = self.state.groups[ex.group_id].advantages[execution_id]
        return PackedSequence(segment, advantage, segment.oldest_version(fallback))
