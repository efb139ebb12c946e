"""The scheduler leader's state and its harness-facing operations (acquire, heartbeat,
finish), the control loop that applies the policy's actions, and the rebuild on takeover.

Domain logic lives in :mod:`ledger`, :mod:`policy` and :mod:`placement` (pure); this module
sequences them with persistence (:mod:`store`, every write fenced) and the peers
(:mod:`peers`). It never imports grpc. Every change follows plan -> fenced write -> apply,
so memory never runs ahead of etcd; a write refused for a stale epoch marks the process
deposed, and the process exits (a supervisor restarts it as a standby).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from gyre.errors import (
    Conflict,
    FailedPrecondition,
    FatalError,
    GyreError,
    StaleEpoch,
    Unauthenticated,
    Unavailable,
)
from services.scheduler.config import SchedulerConfig
from gyre.apikeys import KeyFile
from services.scheduler.events import EventLog, Metrics
from services.scheduler.harness_gate import HarnessGate
from services.scheduler.history import History
from services.scheduler.ledger import (
    ExecState,
    ExecutionRecord,
    FinishOutcome,
    Ledger,
    derive_token,
    sha256_hex,
    validate_acquire_key,
    validate_finish,
)
from services.scheduler.peers import FinishReport, Peers, SupplyUpdate
from services.scheduler.placement import CellTable, RouteRecord, RouteTable, pick_launch_cell
from services.scheduler.policy import (
    BurstView,
    CellState,
    DispatchBurst,
    Hold,
    KeepInTraining,
    MoveToTraining,
    Policy,
    PublishPolicy,
    ReturnToRollout,
    SealBatch,
    Snapshot,
    SupplyTracker,
    capacity,
    make_policy,
)
from services.scheduler.relay import FinishRelay
from services.scheduler.tasks import TaskSource
from services.scheduler.transitions import TransitionRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Launched:
    """An execution handed to a harness (the token exists only here and in its hands)."""

    record: ExecutionRecord
    token: str
    task_json: str
    route: RouteRecord


class Scheduler:
    """One scheduler process's view; acts only while it leads (``epoch`` set)."""

    def __init__(
        self,
        config: SchedulerConfig,
        store: Any,
        peers: Peers,
        tasks: TaskSource,
        events: EventLog | None = None,
        metrics: Metrics | None = None,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config
        self.store = store
        self.peers = peers
        self.tasks = tasks
        self.events = events or EventLog(config.events_kept)
        self.metrics = metrics
        self.policy = policy or make_policy(
            config.policy, fraction=config.fraction, interval_s=config.interval_s,
            training_cells=config.static_training_cells, drain_grace_s=config.drain_grace_s,
        )
        self.clock = clock
        self.wall = wall
        self.ledger = Ledger()
        self.cells = CellTable()
        self.routes = RouteTable()
        self.tracker = SupplyTracker(config.fraction)
        self.supply_raw = SupplyUpdate(0, config.batch_size, 0)
        self.supply = self.tracker.observe(clock(), 0, config.batch_size, 0)
        self.policy_version = 0
        self.policy_source = ""
        self.published = 0
        self.router_targets: list[str] = []
        self.epoch = 0
        self.deposed = asyncio.Event()
        self.reroutes = 0
        self.to_training = 0
        self.to_rollout = 0
        self._launch_lock = asyncio.Lock()
        self._exec_locks: dict[str, asyncio.Lock] = {}
        self._changed = asyncio.Condition()
        self.relay = FinishRelay(peers, on_refused=self._report_refused)
        self._acquiring: dict[str, asyncio.Lock] = {}  # sha256(acquire key) -> its acquires, one at a time
        self._registrations: list[bytes] = []
        self._states: dict[str, bytes] = {}
        self.transitions = TransitionRunner(self)
        self.leader_target = ""
        self._missing_since: dict[str, float] = {}
        self._drained_since: float | None = None
        self._sealed: set[int] = set()
        self.history = History(config.history_file)
        self.harnesses = HarnessGate(
            KeyFile.load(config.harness_keys_file) if config.harness_keys_file else None,
            require_key=config.harness_require_key, max_inflight=config.harness_max_inflight,
            rate_per_s=config.harness_acquire_rate_per_s, burst=config.harness_acquire_burst,
            trust_unauthenticated=config.tls.insecure and not config.harness_keys_file, clock=clock,
        )

    # Leadership ---------------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.epoch > 0 and not self.deposed.is_set()

    def require_leader(self) -> None:
        """UNAVAILABLE (naming the leader when known) unless this process leads; StaleEpoch
        once deposed (the harness edge answers UNAVAILABLE too). Nothing was changed."""
        if self.deposed.is_set():
            raise StaleEpoch("this scheduler was deposed")
        if self.epoch <= 0:
            where = f"; the leader is at {self.leader_target}" if self.leader_target else ""
            raise Unavailable(f"not the scheduler leader{where}")

    def mark_deposed(self, exc: BaseException) -> None:
        if not self.deposed.is_set():
            log.error("deposed: %s", exc)
            self.deposed.set()

    async def _fenced(self, aw: Any) -> Any:
        """Awaits a store write; a stale epoch marks us deposed and propagates."""
        try:
            return await aw
        except StaleEpoch as exc:
            self.mark_deposed(exc)
            raise

    async def take_over(self, epoch: int) -> None:
        """Rebuilds from etcd as the new leader: bursts, executions, routes, transitions."""
        loaded = await self.store.load()
        bursts, routes, transitions = loaded.bursts, loaded.routes, loaded.transitions
        ledger = Ledger()
        ledger.archived = loaded.summary
        for b in bursts:
            ledger.apply_burst(b)
        # Every running execution gets a full deadline from now: heartbeats that went to the
        # old leader, or nowhere during the gap, time nothing out.
        deadline = self.clock() + self.cfg.heartbeat_deadline_s
        for rec in sorted(loaded.executions, key=lambda r: (r.burst_id, r.seq)):
            ledger.load(rec, deadline)
        self.ledger = ledger
        self.harnesses.recount(r.harness_id for r in ledger.records.values() if not r.state.final)
        # Routes without an open execution (a crash between writes cannot leave one, but an
        # operator can) are left out of the table and left in etcd for inspection.
        self.routes = RouteTable()
        for r in routes:
            rec = ledger.records.get(r.execution_id)
            if rec is not None and not rec.state.final:
                self.routes.put(r)
        policy = await self.store.read_policy()
        if policy:
            self._set_policy(policy)
        self.published = self.policy_version
        self.epoch = epoch
        c = ledger.counts()
        self.history.append("leader", epoch, rev=epoch, dispatched=c.dispatched, launched=c.launched,
                            finished=c.finished)
        self.emit("leader",
                f"elected leader at epoch {epoch}: rebuilt {len(bursts)} bursts "
                f"({ledger.archived.bursts} archived), "
                f"D {c.dispatched} L {c.launched} F {c.finished}, {len(self.routes.routes)} routes, "
                f"{len(transitions)} transitions to resume")
        for rec in ledger.records.values():
            if rec.state.final:  # (archived bursts were all settled: not resent)
                self.relay.submit(self._report(rec))
        for cell_id, body in transitions.items():
            self.transitions.resume(cell_id, body)
        if self.policy_version > 0:
            # The old leader may have died mid-publication: engines still behind catch up
            # (cells already serving the version are skipped).
            self.transitions.publish(self.policy_version)
        await self._notify()

    async def reload_routes(self) -> None:
        """Re-reads every route from etcd (after a lost CAS), keeping open executions only."""
        table = RouteTable()
        for r in await self.store.read_routes():
            rec = self.ledger.records.get(r.execution_id)
            if rec is not None and not rec.state.final:
                table.put(r)
        for r in self.routes.routes.values():  # launches in flight (not in etcd yet) still hold slots
            if r.mod_revision == 0 and r.execution_id not in table.routes:
                table.put(r)
        self.routes = table

    # Inputs from watches ------------------------------------------------------------------

    def on_cells(self, items: Mapping[bytes, Any]) -> None:
        self._registrations = [kv.value for kv in items.values()]
        self.cells.refresh(self._registrations, self._states)
        self._settle_overlays()
        self._wake()

    def on_cell_states(self, items: Mapping[bytes, Any]) -> None:
        self._states = {kv.key.decode().rsplit("/", 1)[-1]: kv.value for kv in items.values()}
        self.cells.refresh(self._registrations, self._states)
        self._settle_overlays()
        self._wake()

    def on_policy(self, items: Mapping[bytes, Any]) -> None:
        for kv in items.values():
            try:
                self._set_policy(json.loads(kv.value))
            except (ValueError, TypeError):
                log.warning("malformed policy key ignored")
        self._wake()

    def on_routers(self, items: Mapping[bytes, Any]) -> None:
        targets = []
        for kv in items.values():
            try:
                targets.append(str(json.loads(kv.value)["target"]))
            except (ValueError, KeyError, TypeError):
                continue
        self.router_targets = sorted(set(targets))

    def on_leader(self, items: Mapping[bytes, Any]) -> None:
        for kv in items.values():
            try:
                self.leader_target = str(json.loads(kv.value).get("target", ""))
            except (ValueError, TypeError, AttributeError):
                self.leader_target = ""
            if self.epoch > 0 and getattr(kv, "create_revision", 0) > self.epoch:
                # A newer leader's key (ours lapsed): stop before the next write finds out.
                # (An older revision is only a lagging watch: ignored.)
                self.mark_deposed(StaleEpoch(f"the leader key now has epoch {kv.create_revision}"))
        if not items:
            self.leader_target = ""

    def _set_policy(self, body: Mapping[str, Any]) -> None:
        version = int(body.get("version", 0))
        if version > self.policy_version:
            self.policy_version = version
            self.policy_source = str(body.get("source_target", ""))
            self.emit("policy_version", f"policy v{version} published by {self.policy_source or '?'}")

    def _settle_overlays(self) -> None:
        for cid, want in list(self.cells.overlay.items()):
            if self.cells.states.get(cid) is want and not self.transitions.running(cid):
                del self.cells.overlay[cid]

    def all_router_targets(self) -> list[str]:
        targets = list(self.router_targets)
        if self.cfg.router_target and self.cfg.router_target not in targets:
            targets.append(self.cfg.router_target)
        return targets

    # Harness API --------------------------------------------------------------------------

    async def acquire(self, harness_id: str, wait_s: float, key: str = "") -> tuple[Launched | None, bool, float]:
        """Launches the next queued execution on a free slot for the authenticated harness
        ``harness_id``, waiting up to ``wait_s``. Returns (launched or None, burst
        exhausted, retry-after hint). Over the harness's rate or in-flight limit:
        ResourceExhausted, nothing launched.

        With an idempotency ``key``, an execution already launched with it (by this leader
        or an earlier one) is returned again, with the same token; acquires with one key
        run one at a time, so a retry racing its first attempt launches nothing twice."""
        self.require_leader()
        validate_acquire_key(key)
        self.harnesses.admit_acquire(harness_id)
        if not key:
            return await self._acquire(harness_id, wait_s, "")
        key_sha = sha256_hex(key)
        lock = self._acquiring.setdefault(key_sha, asyncio.Lock())
        try:
            async with lock:
                again = self._reacquire(harness_id, key, key_sha)
                if again is not None:
                    return again, False, 0.0
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
            raise FailedPrecondition(f"{rec.execution_id}, acquired with this key, is already closed "
                                     f"({rec.state.value})")
        token = derive_token(key, rec.execution_id)
        route = self.routes.routes.get(rec.execution_id)
        if sha256_hex(token) != rec.token_sha256 or route is None:
            raise FailedPrecondition(f"{rec.execution_id} cannot be handed out again")
        burst = self.ledger.bursts[rec.burst_id]
        return Launched(rec, token, burst.member(rec.seq)[2].task_json, route)

    async def _acquire(self, harness_id: str, wait_s: float, key: str) -> tuple[Launched | None, bool, float]:
        deadline = self.clock() + min(wait_s, self.cfg.max_wait_s)
        while True:
            self.require_leader()
            got = await self._try_launch(harness_id, key)
            if got is not None:
                return got, False, 0.0
            left = deadline - self.clock()
            if left <= 0:
                exhausted = self.ledger.next_queued() is None
                return None, exhausted, self.cfg.reconcile_s * 2
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass

    async def _try_launch(self, harness_id: str, key: str = "") -> Launched | None:
        """Picks (under the launch lock) the next queued execution and a free slot, reserves
        both, then writes outside the lock, so launches overlap their etcd round trips. A
        reserved route counts against its cell's slots (mod_revision 0 = pending)."""
        async with self._launch_lock:
            nxt = self.ledger.next_queued()
            if nxt is None:
                return None
            cell = pick_launch_cell(self.cells, self.routes)
            if cell is None:
                return None
            burst, seq = nxt
            self.harnesses.check_inflight(harness_id)
            eid = burst.member(seq)[0]
            token = derive_token(key, eid) if key else secrets.token_urlsafe(32)
            rec = self.ledger.plan_launch(burst, seq, sha256_hex(token), harness_id[:128], self.wall(),
                                          sha256_hex(key) if key else "")
            route = RouteRecord(rec.execution_id, cell.cell_id, cell.target, rec.token_sha256, rec.group_id,
                                burst.burst_id, burst.policy_version,
                                expires_s=rec.launched_s + self.cfg.execution_token_ttl_s)
            self.harnesses.launched(rec.harness_id)  # counted from the reservation on
            self.ledger.reserve(rec.execution_id)
            self.routes.put(route)
        # Shielded: a harness that hangs up mid-launch must not leave memory behind etcd (the
        # execution then runs unheld and times out).
        ok = await asyncio.shield(self._land_launch(rec, route, burst, seq))
        if not ok:
            return None
        return Launched(self.ledger.records[rec.execution_id], token, burst.member(seq)[2].task_json,
                        self.routes.routes[rec.execution_id])

    async def _land_launch(self, rec: ExecutionRecord, route: RouteRecord, burst: Any, seq: int) -> bool:
        try:
            rev = await self._fenced(self.store.launch(rec, route))
        except BaseException as exc:
            self.routes.drop(rec.execution_id)
            self.ledger.unreserve(burst, seq)
            self.harnesses.closed(rec.harness_id)
            if isinstance(exc, (Conflict, Unavailable)):
                # Conflict: launched by an earlier attempt whose answer was lost. Unavailable:
                # the outcome is unknown. Either way, adopt what etcd holds.
                await self._resolve(rec)
                adopted = self.ledger.records.get(rec.execution_id)
                if adopted is not None and not adopted.state.final:
                    self.harnesses.launched(adopted.harness_id)
                if isinstance(exc, Conflict):
                    return False
            raise
        self.ledger.apply(dataclasses.replace(rec, revision=rev),
                self.clock() + self.cfg.heartbeat_deadline_s)
        self.routes.put(dataclasses.replace(route, epoch=1, mod_revision=rev))
        self.history.append("launch", self.epoch, rev=rev, execution_id=rec.execution_id, burst_id=rec.burst_id,
                            cell_id=route.cell_id)
        self._gauges()
        return True

    async def _resolve(self, rec: ExecutionRecord) -> None:
        """After an unknown or refused write: adopt what etcd holds for this execution."""
        try:
            stored = await self.store.read_execution(rec.burst_id, rec.execution_id)
        except Unavailable:
            return
        if stored is not None:
            self.ledger.load(stored, self.clock() + self.cfg.heartbeat_deadline_s)
            if stored.state.final:
                self.routes.drop(stored.execution_id)
            elif stored.execution_id not in self.routes.routes:
                await self.reload_routes()  # a launch we did not see land: adopt its route

    def _authorize(self, execution_id: str, token: str, harness: str | None) -> ExecutionRecord:
        """The token must hold the execution, be unexpired, and (with authentication on)
        belong to the harness that acquired it."""
        rec = self.ledger.authorize(execution_id, token)
        self.harnesses.check_owner(rec.harness_id, harness)
        if not rec.state.final and self.wall() > rec.launched_s + self.cfg.execution_token_ttl_s:
            raise Unauthenticated(f"the token of {execution_id} expired")
        return rec

    async def heartbeat(self, execution_id: str, token: str, harness: str | None = None) -> tuple[float, ExecState]:
        self.require_leader()
        rec = self._authorize(execution_id, token, harness)
        left = self.ledger.heartbeat(execution_id, self.clock(), self.cfg.heartbeat_deadline_s)
        return left, self.ledger.records[rec.execution_id].state

    async def finish(self, execution_id: str, token: str, status: ExecState, reward: float,
            key: str, harness: str | None = None) -> FinishOutcome:
        """Closes an execution once; a repeat returns the first outcome (duplicate=True)."""
        self.require_leader()
        self._authorize(execution_id, token, harness)
        finish = validate_finish(status, reward, key, self.cfg.reward_min, self.cfg.reward_max)
        async with self._lock_of(execution_id):
            out = self.ledger.plan_finish(execution_id, finish, self.wall())
            if out.duplicate:
                return out
            if not await asyncio.shield(self._close(out.record)):  # a hang-up does not half-close
                return FinishOutcome(self.ledger.records[execution_id], True)
            return out

    def _lock_of(self, execution_id: str) -> asyncio.Lock:
        """Closes of one execution are serialized; different executions close in parallel
        (their records are independent keys)."""
        lock = self._exec_locks.get(execution_id)
        if lock is None:
            lock = self._exec_locks[execution_id] = asyncio.Lock()
        return lock

    async def _close(self, closed: ExecutionRecord) -> bool:
        """Persists a close, then applies it; False when another close got there first."""
        old = self.ledger.records[closed.execution_id]
        try:
            rev = await self._fenced(self.store.close(closed, old.revision))
        except (Conflict, Unavailable):
            await self._resolve(closed)
            if self.ledger.records[closed.execution_id].state.final:
                self._exec_locks.pop(closed.execution_id, None)
                self.harnesses.closed(closed.harness_id)
                return False
            raise
        self.ledger.apply(dataclasses.replace(closed, revision=rev))
        self.routes.drop(closed.execution_id)  # the route is gone from etcd too: the token is revoked
        self.harnesses.closed(closed.harness_id)
        self.history.append("close", self.epoch, rev=rev, execution_id=closed.execution_id,
                            status=closed.state.value, reward=closed.reward)
        self.relay.submit(self._report(closed))
        if closed.state is ExecState.TIMED_OUT:
            self.emit("timed_out", f"{closed.execution_id} timed out: no heartbeat for {self.cfg.heartbeat_deadline_s:.1f} s",
                      execution_id=closed.execution_id)
        self._exec_locks.pop(closed.execution_id, None)
        self._gauges()
        await self._notify()
        return True

    def _report(self, rec: ExecutionRecord) -> FinishReport:
        burst = self.ledger.bursts[rec.burst_id]
        return FinishReport(rec.execution_id, rec.group_id, burst.group_size, rec.state, rec.reward,
                rec.policy_version)

    # Loops --------------------------------------------------------------------------------

    async def report_loop(self) -> None:
        """Forwards finish reports to the packer (services/scheduler/relay.py): each is
        retried until acknowledged or refused, none waits on another."""
        await self.relay.run()

    def _report_refused(self, report: FinishReport, exc: Exception) -> None:
        self.history.append("report_refused", self.epoch, execution_id=report.execution_id,
                            group_id=report.group_id, error=str(exc)[:200])
        self.emit("report_refused", f"the packer refused the finish report of {report.execution_id}: {exc}",
                  execution_id=report.execution_id)

    async def supply_loop(self) -> None:
        """Follows the packer's supply signal (reconnecting)."""
        if not self.cfg.packer_target:
            await asyncio.Event().wait()
        backoff = 0.2
        while True:
            try:
                async for upd in self.peers.watch_supply():
                    self.supply_raw = upd
                    backoff = 0.2
                    self._wake()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("supply stream interrupted; reconnecting", extra={"error": repr(exc)})
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def control_loop(self) -> None:
        """Level-triggered: reconcile every ``reconcile_s`` (sooner when woken); survives
        any error but a lost leadership."""
        while True:
            if self.deposed.is_set():
                raise FatalError("deposed: a newer scheduler leader exists")
            try:
                await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except StaleEpoch as exc:
                self.mark_deposed(exc)
                raise FatalError(f"deposed: {exc}") from exc
            except Exception:
                log.exception("reconcile failed; retrying next tick")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), self.cfg.reconcile_s)
                except asyncio.TimeoutError:
                    pass

    async def reconcile_once(self) -> None:
        if not self.leading:
            return
        for rec in self.ledger.plan_timeouts(self.clock()):
            async with self._lock_of(rec.execution_id):
                if self.ledger.records[rec.execution_id].state is ExecState.RUNNING:
                    await self._close(rec)
        self._rescue_orphans()
        self._finish_stranded_moves()
        await self._archive_closed()
        snap = self.snapshot()
        for action in self.policy.decide(snap):
            await self.apply(action, snap)
        self._gauges()

    async def _archive_closed(self) -> None:
        """Archives closed bursts, oldest first (services/scheduler/ledger.py): memory,
        etcd space and the next takeover stay bounded by the live bursts."""
        before = self.wall() - self.cfg.archive_grace_s
        while (burst := self.ledger.archivable(self.relay.unsettled, before)) is not None:
            summary = self.ledger.plan_archive(burst)
            try:
                rev = await self._fenced(self.store.archive(summary, self.ledger.archived.revision))
            except Conflict as exc:  # only a leader writes it: a stale view, rebuilt at the next takeover
                log.warning("archive refused: %s", exc)
                return
            self.ledger.apply_archive(dataclasses.replace(summary, revision=rev))
            self.history.append("archive", self.epoch, rev=rev, burst_id=burst.burst_id, executions=burst.quota)
            self.emit("archive", f"archived burst {burst.burst_id}: {burst.quota} executions closed; "
                      f"{summary.bursts} bursts, {summary.executions} executions archived in all")

    def _finish_stranded_moves(self) -> None:
        """A cell an agent reports DRAINING or RETURNING with no transition of ours running
        (a move that failed, or a leader that died before recording it) would hold every
        later move: bring it back to rollout."""
        for cid in self.cells.records:
            # Overlay first: our last command's outcome beats a watch that has not caught up.
            state = self.cells.state(cid)
            if state in (CellState.DRAINING, CellState.RETURNING) and not self.transitions.running(cid):
                self.emit("stranded", f"{cid} was left {state.value} with no move in progress: back to rollout",
                          cell_id=cid)
                self.transitions.start(cid, CellState.ROLLOUT, f"stranded in {state.value}")

    def _rescue_orphans(self) -> None:
        """Routes to a cell whose registration is gone (its lease lapsed) for longer than
        ``orphan_grace_s`` are moved to live engines."""
        now = self.clock()
        routed = self.routes.counts()
        for cid in list(self._missing_since):
            if cid not in routed or cid in self.cells.records:
                del self._missing_since[cid]
        for cid in routed:
            if cid in self.cells.records:
                continue
            since = self._missing_since.setdefault(cid, now)
            if now - since >= self.cfg.orphan_grace_s and not self.transitions.running(cid):
                self.transitions.rescue(cid)

    def snapshot(self) -> Snapshot:
        raw = self.supply_raw
        self.supply = self.tracker.observe(self.clock(), raw.ready_groups, self.cfg.batch_size,
                raw.batch_needs, raw.batch_id)
        b = self.ledger.current_burst
        burst = None if b is None else BurstView(b.burst_id, b.quota, b.policy_version, b.target_version)
        counts = self.ledger.counts()
        if counts.waterlevel > 0:
            self._drained_since = None
        elif self._drained_since is None:
            self._drained_since = self.clock()
        return Snapshot(self.clock(), counts, self.cells.views(), self.supply, burst,
                        self.policy_version, self.next_quota(), self._drained_since)

    def next_quota(self) -> int:
        if self.cfg.max_bursts and self.ledger.bursts_total >= self.cfg.max_bursts:
            return 0
        tasks = self.tasks.take(self._tasks_taken(), self.cfg.groups_per_burst())
        return len(tasks) * self.cfg.group_size

    def _tasks_taken(self) -> int:
        return self.ledger.tasks_taken

    async def apply(self, action: Any, snap: Snapshot) -> None:
        gauges = dict(waterlevel=snap.ledger.waterlevel, capacity=capacity(snap.cells),
                ready_groups=snap.supply.ready_groups)
        if isinstance(action, Hold):
            self.emit("hold", action.reason, cell_id=action.cell_id, **gauges)
        elif isinstance(action, DispatchBurst):
            await self._dispatch(action, gauges)
        elif isinstance(action, MoveToTraining):
            if not self.transitions.running(action.cell_id):
                self.emit(action.kind, action.reason, cell_id=action.cell_id, **gauges)
                self.to_training += 1
                self.transitions.start(action.cell_id, CellState.TRAINING, action.reason)
        elif isinstance(action, ReturnToRollout):
            if not self.transitions.running(action.cell_id):
                self.emit(action.kind, action.reason, cell_id=action.cell_id, **gauges)
                self.to_rollout += 1
                self.transitions.start(action.cell_id, CellState.ROLLOUT, action.reason)
        elif isinstance(action, KeepInTraining):
            self.emit(action.kind, action.reason, cell_id=action.cell_id, **gauges)
            self.transitions.rejoin(action.cell_id)
        elif isinstance(action, SealBatch):
            if action.batch_id not in self._sealed:
                try:
                    await self.peers.seal_batch(self.epoch, action.batch_id)
                except GyreError as exc:  # e.g. no group assigned yet: the next tick retries
                    log.info("seal refused: %s", exc)
                    return
                self._sealed.add(action.batch_id)
                self.emit(action.kind, action.reason, **gauges)
        elif isinstance(action, PublishPolicy):
            if action.version > self.published:
                self.published = action.version
                self.emit(action.kind, action.reason, cell_id=action.source_cell_id, **gauges)
                self.transitions.publish(action.version)

    async def _dispatch(self, action: DispatchBurst, gauges: dict[str, int]) -> None:
        tasks = self.tasks.take(self._tasks_taken(), self.cfg.groups_per_burst())
        if not tasks:
            return
        burst = self.ledger.plan_burst(tasks, self.cfg.group_size, self.policy_version,
                self.cfg.batches_per_burst, self.wall())
        try:
            rev = await self._fenced(self.store.dispatch(burst))
        except Conflict:
            return  # dispatched by an earlier attempt; the next rebuild or tick picks it up
        self.ledger.apply_burst(burst)
        self.history.append("dispatch", self.epoch, rev=rev, burst_id=burst.burst_id, quota=burst.quota,
                            policy_version=burst.policy_version)
        self.emit(action.kind,
                f"dispatched burst {burst.burst_id}: {burst.quota} executions "
                f"({len(tasks)} groups of {burst.group_size}) at policy v{burst.policy_version}", **gauges)
        await self._notify()

    # Helpers ------------------------------------------------------------------------------

    def emit(self, kind: str, message: str, **kw: Any) -> None:
        if "waterlevel" not in kw:
            kw["waterlevel"] = self.ledger.counts().waterlevel
            kw["capacity"] = capacity(self.cells.views())
            kw["ready_groups"] = self.supply.ready_groups
        self.events.emit(kind, message, **kw)
        if self.metrics is not None and kind != "hold":
            self.metrics.events.labels(kind).inc()

    def _wake(self) -> None:
        try:
            asyncio.get_running_loop().create_task(self._notify())
        except RuntimeError:
            pass

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        c = self.ledger.counts()
        views = self.cells.views()
        m.waterlevel.set(c.waterlevel)
        m.queued.set(c.queued)
        m.running.set(c.running)
        m.dispatched.set(c.dispatched)
        m.finished.set(c.finished)
        m.capacity.set(capacity(views))
        m.supply.set(self.supply.ready_groups)
        m.supply_fraction.set(self.supply.fraction)
        m.leader.set(1 if self.leading else 0)
        m.policy_version.set(self.policy_version)
        for st in CellState:
            m.roles.labels(st.value).set(sum(1 for v in views if v.state is st))

    def status(self) -> dict[str, Any]:
        """GetStatus as plain data (the servicer converts it)."""
        b = self.ledger.current_burst
        c = self.ledger.counts(b.burst_id) if b else self.ledger.counts()
        counts = self.routes.counts()
        views = self.cells.views()
        bursts_done = self.ledger.archived.bursts + sum(
            1 for bid in self.ledger.bursts if self.ledger.bursts[bid].target_version <= self.policy_version)
        return {
            "epoch": self.epoch, "burst_id": b.burst_id if b else 0, "ledger": c,
            "finished_by_status": self.ledger.finished_by_status(),
            "total": self.ledger.counts(), "capacity": capacity(views), "ready_groups": self.supply.ready_groups,
            "batch_size": self.cfg.batch_size, "policy_version": self.policy_version,
            "cells": [(v, self.cells.get(v.cell_id), counts.get(v.cell_id, 0)) for v in views],
            "reroutes": self.reroutes, "bursts_completed": bursts_done,
            "to_training": self.to_training, "to_rollout": self.to_rollout,
            "burst_by_status": self.ledger.finished_by_status(b.burst_id if b else None),
            "policy": self.policy.name, "leader": self.leading,
        }
