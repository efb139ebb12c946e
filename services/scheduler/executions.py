"""Executions: what harnesses do (acquire, heartbeat, finish) and what the leader does to
executions on its own (time-outs), each as plan -> fenced write -> apply, so memory never
runs ahead of etcd.

A launch reserves the next queued execution and a free slot under the fleet's placement
lock, then writes outside it (launches overlap their etcd round trips); a close is
serialized per execution and compares the record's revision. After an unknown or refused
write, what etcd holds is adopted (:meth:`Executions.resolve`).

An acquire with an idempotency key is idempotent across leaders: the launch stores the
key's SHA-256 and derives the token from the key (:func:`~services.scheduler.ledger.derive_token`),
so a retry, here or at a new leader after a failover, hands back the same execution and
token. Acquires with one key run one at a time, so a retry racing its first attempt
launches nothing twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Iterable

from gyre.errors import Conflict, FailedPrecondition, Unauthenticated, Unavailable
from gyre.etcd.values import Route, token_sha256
from gyre.evolve import evolve
from gyre.execution import ExecutionStatus
from gyre.failpoints import failpoint
from services.scheduler.harness_gate import HarnessGate
from services.scheduler.ledger import (
    Burst,
    ExecutionRecord,
    FinishOutcome,
    derive_token,
    validate_acquire_key,
    validate_finish,
)
from services.scheduler.parts import Part, Shared
from services.scheduler.placement import pick_launch_cell
from services.scheduler.relay import FinishRelay


@dataclasses.dataclass(frozen=True)
class Launched:
    """An execution handed to a harness (the token exists only here and in its hands)."""

    record: ExecutionRecord
    token: str
    task_json: str
    route: Route


@dataclasses.dataclass(frozen=True)
class Acquired:
    """The answer to an acquire: an execution, or none with a hint."""

    launched: Launched | None
    exhausted: bool = False
    """Nothing is queued (the burst is used up)."""
    retry_after_s: float = 0.0


class Executions(Part):
    """Launches, heartbeats and closes of executions."""

    def __init__(self, *, shared: Shared, harnesses: HarnessGate, relay: FinishRelay) -> None:
        super().__init__(shared=shared)
        self.harnesses = harnesses
        self.relay = relay
        self._locks: dict[str, asyncio.Lock] = {}
        self._acquiring: dict[str, asyncio.Lock] = {}  # sha256(acquire key) -> its acquires, one at a time

    def _deadline(self) -> float:
        return self.clock() + self.cfg.heartbeat_deadline_s

    # Rebuild ------------------------------------------------------------------------------

    def rebuild(self, execs: Iterable[ExecutionRecord], routes: Iterable[Route]) -> None:
        """Loads the records and routes a new leader read (running ones get a full deadline
        from now: heartbeats that went to the old leader, or nowhere during the gap, time
        nothing out; records of archived bursts are skipped).
        Routes without an open execution (a crash between writes cannot leave one, but an
        operator can) are left out of the table and left in etcd for inspection."""
        deadline = self._deadline()
        for rec in sorted(execs, key=lambda r: (r.burst_id, r.seq)):
            self.ledger.load(rec, deadline)
        self.harnesses.recount(r.harness_id for r in self.ledger.records.values() if not r.state.final)
        self.fleet.reset_routes(routes, self._open)
        for rec in self.ledger.records.values():
            if rec.state.final:
                self.relay.report(rec)

    def _open(self, execution_id: str) -> bool:
        rec = self.ledger.records.get(execution_id)
        return rec is not None and not rec.state.final

    async def reload_routes(self) -> None:
        """Re-reads every route from etcd (after a lost CAS), keeping open executions only;
        launches in flight (not in etcd yet) keep their slots."""
        self.fleet.reset_routes(await self.lead.store.read_routes(), self._open, keep_pending=True)

    # Launch -------------------------------------------------------------------------------

    async def acquire(self, harness_id: str, wait_s: float, key: str = "") -> Acquired:
        """Launches the next queued execution on a free slot for the authenticated harness
        ``harness_id``, waiting up to ``wait_s``. Over the harness's rate or in-flight limit:
        ResourceExhausted, nothing launched. With an idempotency ``key``: the execution an
        earlier acquire with it launched, if any (FAILED_PRECONDITION once it is closed)."""
        self.lead.require()
        validate_acquire_key(key)
        self.harnesses.admit_acquire(harness_id)
        if not key:
            return await self._acquire(harness_id, wait_s, "")
        key_sha = token_sha256(key)
        lock = self._acquiring.setdefault(key_sha, asyncio.Lock())
        try:
            async with lock:
                again = self._reacquire(harness_id, key, key_sha)
                if again is not None:
                    return Acquired(again)
                return await self._acquire(harness_id, wait_s, key)
        finally:
            if not lock.locked() and self._acquiring.get(key_sha) is lock:
                del self._acquiring[key_sha]

    def _reacquire(self, harness_id: str, key: str, key_sha: str) -> Launched | None:
        """The execution launched earlier with this acquire key, handed back (None: none)."""
        rec = self.ledger.acquired_with(key_sha)
        if rec is None:
            return None
        self.harnesses.check_owner(rec.harness_id, harness_id)
        if rec.state.final:
            raise FailedPrecondition(
                f"{rec.execution_id}, acquired with this key, is already closed ({rec.state.value})"
            )
        token = derive_token(key, rec.execution_id)
        route = self.fleet.routes.routes.get(rec.execution_id)
        if token_sha256(token) != rec.token_sha256 or route is None:
            raise FailedPrecondition(f"{rec.execution_id} cannot be handed out again")
        burst = self.ledger.bursts[rec.burst_id]
        return Launched(rec, token, burst.member(rec.seq)[2].task_json, route)

    async def _acquire(self, harness_id: str, wait_s: float, key: str) -> Acquired:
        deadline = self.clock() + min(wait_s, self.cfg.max_wait_s)
        while True:
            self.lead.require()
            got = await self._try_launch(harness_id, key)
            if got is not None:
                return Acquired(got)
            left = deadline - self.clock()
            if left <= 0:
                return Acquired(None, self.ledger.next_queued() is None, self.cfg.reconcile_s * 2)
            await self.changes.wait(min(left, 0.5))

    async def _try_launch(self, harness_id: str, key: str = "") -> Launched | None:
        """Picks (under the placement lock) the next queued execution and a free slot,
        reserves both, then writes outside the lock. A reserved route counts against its
        cell's slots (mod_revision 0 = pending)."""
        fleet = self.fleet
        async with fleet.placement_lock:
            nxt = self.ledger.next_queued()
            if nxt is None:
                return None
            cell = pick_launch_cell(fleet.cells, fleet.routes, fleet.planned, fleet.spread)
            if cell is None:
                return None
            burst, seq = nxt
            self.harnesses.check_inflight(harness_id)
            token = derive_token(key, burst.member(seq)[0]) if key else secrets.token_urlsafe(32)
            rec = self.ledger.plan_launch(
                burst,
                seq,
                token_sha256(token),
                harness_id[:128],
                self.wall(),
                token_sha256(key) if key else "",
            )
            route = Route(
                rec.execution_id,
                cell.cell_id,
                cell.target,
                rec.token_sha256,
                rec.group_id,
                burst.burst_id,
                burst.policy_version,
                expires_s=rec.launched_s + self.cfg.execution_token_ttl_s,
            )
            self.harnesses.launched(rec.harness_id)  # counted from the reservation on
            self.ledger.reserve(rec.execution_id)
            fleet.routes.put(route)
        # Shielded: a harness that hangs up mid-launch must not leave memory behind etcd (the
        # execution then runs unheld and times out).
        ok = await asyncio.shield(self._land_launch(rec, route, burst, seq))
        if not ok:
            return None
        return Launched(
            self.ledger.records[rec.execution_id],
            token,
            burst.member(seq)[2].task_json,
            fleet.routes.routes[rec.execution_id],
        )

    async def _land_launch(self, rec: ExecutionRecord, route: Route, burst: Burst, seq: int) -> bool:
        self.history.invoke("launch", self.lead.epoch, execution_id=rec.execution_id, burst_id=rec.burst_id)
        try:
            rev = await self.lead.fenced(self.lead.store.launch(rec, route))
        except BaseException as exc:
            self.fleet.routes.drop(rec.execution_id)
            self.ledger.unreserve(burst, seq)
            self.harnesses.closed(rec.harness_id)
            if isinstance(exc, (Conflict, Unavailable)):
                # Conflict: launched by an earlier attempt whose answer was lost. Unavailable:
                # the outcome is unknown. Either way, adopt what etcd holds.
                await self.resolve(rec)
                adopted = self.ledger.records.get(rec.execution_id)
                if adopted is not None and not adopted.state.final:
                    self.harnesses.launched(adopted.harness_id)
                if (
                    isinstance(exc, Unavailable)
                    and adopted is not None
                    and adopted.revision
                    and _same_record(adopted, rec)
                ):
                    # Our launch landed and its answer was lost: it is ours to record (the
                    # harness's retry with its acquire key gets this execution back).
                    self._record_launch(rec, route, adopted.revision)
                if isinstance(exc, Conflict):
                    return False
            raise
        failpoint("scheduler.launch.landed")  # in etcd, not yet in memory nor the history
        self.ledger.apply(evolve(rec, revision=rev), self._deadline())
        self.fleet.routes.put(evolve(route, epoch=1, mod_revision=rev))
        self._record_launch(rec, route, rev)
        self.telemetry.gauges()
        return True

    def _record_launch(self, rec: ExecutionRecord, route: Route, rev: int) -> None:
        self.history.append(
            "launch",
            self.lead.epoch,
            rev=rev,
            execution_id=rec.execution_id,
            burst_id=rec.burst_id,
            cell_id=route.cell_id,
        )

    async def resolve(self, rec: ExecutionRecord) -> None:
        """After an unknown or refused write: adopt what etcd holds for this execution."""
        try:
            stored = await self.lead.store.read_execution(rec.burst_id, rec.execution_id)
        except Unavailable:
            return
        if stored is not None:
            self.ledger.load(stored, self._deadline())
            if stored.state.final:
                self.fleet.routes.drop(stored.execution_id)
            elif stored.execution_id not in self.fleet.routes.routes:
                await self.reload_routes()  # a launch we did not see land: adopt its route

    # Heartbeat and finish -----------------------------------------------------------------

    def _authorize(self, execution_id: str, token: str, harness: str | None) -> ExecutionRecord:
        """The token must hold the execution, be unexpired, and (with authentication on)
        belong to the harness that acquired it."""
        rec = self.ledger.authorize(execution_id, token)
        self.harnesses.check_owner(rec.harness_id, harness)
        if not rec.state.final and self.wall() > rec.launched_s + self.cfg.execution_token_ttl_s:
            raise Unauthenticated(f"the token of {execution_id} expired")
        return rec

    async def heartbeat(
        self, execution_id: str, token: str, harness: str | None = None
    ) -> tuple[float, ExecutionStatus]:
        """Pushes the execution's deadline (memory only); returns seconds left and its state."""
        self.lead.require()
        rec = self._authorize(execution_id, token, harness)
        left = self.ledger.heartbeat(execution_id, self.clock(), self.cfg.heartbeat_deadline_s)
        return left, self.ledger.records[rec.execution_id].state

    async def finish(
        self,
        execution_id: str,
        token: str,
        status: ExecutionStatus,
        reward: float,
        key: str,
        harness: str | None = None,
    ) -> FinishOutcome:
        """Closes an execution once; a repeat returns the first outcome (duplicate=True)."""
        self.lead.require()
        self._authorize(execution_id, token, harness)
        finish = validate_finish(status, reward, key, self.cfg.reward_min, self.cfg.reward_max)
        async with self._lock_of(execution_id):
            out = self.ledger.plan_finish(execution_id, finish, self.wall())
            if out.duplicate:
                return out
            if not await asyncio.shield(self._close(out.record)):  # a hang-up does not half-close
                return FinishOutcome(self.ledger.records[execution_id], True)
            return out

    async def time_out_overdue(self) -> None:
        """Closes, as TIMED_OUT, running executions whose heartbeat deadline passed."""
        for rec in self.ledger.plan_timeouts(self.clock()):
            async with self._lock_of(rec.execution_id):
                if self.ledger.records[rec.execution_id].state is ExecutionStatus.RUNNING:
                    await self._close(rec)

    async def cancel(self, execution_ids: Iterable[str], reason: str) -> list[str]:
        """Closes these executions as CANCELLED (the scheduler's cancel rule): running ones
        lose their route (the router aborts their calls, their harness's next heartbeat or
        finish answers CANCELLED); queued ones are withdrawn before launch. Returns the ids
        closed now (already closed or unknown ones are skipped)."""
        self.lead.require()
        done = []
        for eid in execution_ids:
            async with self._lock_of(eid):
                rec = self.ledger.plan_cancel(eid, self.wall())
                if rec is not None and await asyncio.shield(self._close(rec)):
                    done.append(eid)
        if done:
            self.telemetry.emit(
                "cancelled",
                f"cancelled {len(done)} executions: {reason}",
                execution_id=done[0] if len(done) == 1 else "",
            )
        return done

    async def restamp(self, execution_ids: Iterable[str], version: int) -> list[str]:
        """Restamps these running executions with ``version`` (the partial rule: their group
        goes on; a close reports the new stamp to the packer). Returns the ids restamped now
        (closed, queued or already restamped ones are skipped: a queued member takes its
        group's stamp at launch)."""
        self.lead.require()
        done = []
        for eid in execution_ids:
            async with self._lock_of(eid):
                rec = self.ledger.plan_restamp(eid, version)
                if rec is None:
                    continue
                try:
                    rev = await self.lead.fenced(self.lead.store.restamp(rec, rec.revision))
                except (Conflict, Unavailable):
                    await self.resolve(rec)  # closed meanwhile, or our write's fate unknown: adopt etcd's
                    continue
                self.ledger.apply(evolve(rec, revision=rev))
                done.append(eid)
        return done

    def _lock_of(self, execution_id: str) -> asyncio.Lock:
        """Closes of one execution are serialized; different executions close in parallel
        (their records are independent keys)."""
        lock = self._locks.get(execution_id)
        if lock is None:
            lock = self._locks[execution_id] = asyncio.Lock()
        return lock

    async def _close(self, closed: ExecutionRecord) -> bool:
        """Persists a close, then applies it; False when another close got there first."""
        old = self.ledger.records.get(closed.execution_id)  # None: a queued one withdrawn
        self.history.invoke("close", self.lead.epoch, execution_id=closed.execution_id)
        try:
            rev = await self.lead.fenced(self.lead.store.close(closed, old.revision if old else 0))
        except (Conflict, Unavailable):
            await self.resolve(closed)
            now = self.ledger.records.get(closed.execution_id)
            if now is not None and now.state.final and now.revision and _same_record(now, closed):
                rev = now.revision  # our write landed, its answer was lost: it is our close
            elif now is not None and now.state.final:
                self._locks.pop(closed.execution_id, None)
                if old is not None:
                    self.harnesses.closed(closed.harness_id)
                return False
            else:
                raise
        self.ledger.apply(evolve(closed, revision=rev))
        self.fleet.routes.drop(closed.execution_id)  # the route is gone from etcd too: the token is revoked
        if old is None:  # withdrawn from the queue: it left the queue without a launch
            self.history.append(
                "launch",
                self.lead.epoch,
                rev=rev,
                execution_id=closed.execution_id,
                burst_id=closed.burst_id,
                cell_id="",
                withdrawn=True,
            )
        else:
            self.harnesses.closed(closed.harness_id)
        self.history.append(
            "close",
            self.lead.epoch,
            rev=rev,
            execution_id=closed.execution_id,
            status=closed.state.value,
            reward=closed.reward,
        )
        self.relay.report(closed)
        if closed.state is ExecutionStatus.TIMED_OUT:
            self.telemetry.emit(
                "timed_out",
                f"{closed.execution_id} timed out: no heartbeat for {self.cfg.heartbeat_deadline_s:.1f} s",
                execution_id=closed.execution_id,
            )
        self._locks.pop(closed.execution_id, None)
        self.telemetry.gauges()
        await self.changes.notify()
        return True


def _same_record(stored: ExecutionRecord, ours: ExecutionRecord) -> bool:
    """True when etcd holds exactly the record we tried to write, a launch or a close (an etcd
    outage can apply a write and lose its answer): then it is ours to record (and a close's
    to relay to the packer and count)."""
    return dataclasses.replace(stored, revision=0) == dataclasses.replace(ours, revision=0)
