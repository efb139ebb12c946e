"""The simulated cluster: cells with engines and a streaming trainer, executions, the ledger,
and the GPU-second accounts. It owns the mechanism (what happens when a cell moves, how a
request is rerouted, how training consumes groups); the decisions come from the scheduler's
policy through ``sim.driver``.

Engines use a fluid decode model: every active sequence of an engine gains one token per
step and the step time is the cost model's (bytes read), integrated exactly between events
(``DecodeRate``). Prefill and weight loads stall the engine's decode (they are queued GPU
work on the same device). An engine holds at most ``CostConfig.kv_capacity_tokens`` of KV, as
vLLM's block manager does: a turn is admitted only when its context fits beside the running
sequences' (else it waits, first in first out); the prefixes of executions waiting on a tool
stay cached until the space is needed (least recently used first; an evicted prefix is
prefilled again on the next turn); and when the running sequences' growth fills the KV, the
youngest is preempted and recomputed on readmission (vLLM's recompute preemption).
Training consumes ready groups first-in first-out at the summed throughput of the cells that
have joined the stream. The cells, their engines and the execution records are in
``sim.engine``; this module is the mechanism that moves work between them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gyre.staleness import goes_on, restamp_version
from services.scheduler.policy import staleness
from sim.config import CostConfig
from sim.cost import CostModel
from sim.engine import CATEGORIES as CATEGORIES  # re-exported: the accounts' categories
from sim.engine import EPS, Cell, Engine, Execution, Group, VersionLedger
from sim.engine import ExecState as ExecState
from sim.engine import Role as Role
from sim.events import EventLoop
from sim.placement import make_placement
from sim.workload import Episode


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


@dataclass
class Ledger:
    """Cumulative D / L / F over the whole run (W counts every open execution)."""

    dispatched: int = 0
    launched: int = 0
    finished: int = 0


class Cluster:
    """The world the policy acts on. Public methods are the mechanism behind each action."""

    def __init__(
        self,
        loop: EventLoop,
        cost_cfg: CostConfig,
        cells: int,
        standalone: int,
        slots: int,
        batch_groups: int,
        max_staleness: int,
        placement: str = "scheduler",
        rate_window_s: float = 600.0,
        stale_rule: str = "cancel",
        partial_max_versions: int | None = None,
    ) -> None:
        self.loop = loop
        self.cost = CostModel(cost_cfg)
        self.cc = cost_cfg
        self.cells: list[Cell] = [Cell(f"cell-{i}", i, False, slots, self.cost) for i in range(cells)]
        self.cells += [Cell(f"standalone-{j}", -1, True, slots, self.cost) for j in range(standalone)]
        self.trainer = Trainer(self.cost, batch_groups, max_staleness)
        self.ledger = Ledger()
        self.queue: deque[Execution] = deque()
        self.homeless: deque[Execution] = deque()  # launched, lost their engine, wait for a slot
        self.executions: list[Execution] = []
        self.groups: list[Group] = []
        self.published = 0
        self.on_boundary = lambda: None  # set by the driver
        self.on_update = lambda version: None
        # counters
        self.role_switches = 0
        self.switch_s = 0.0
        self.reroutes = 0
        self.reroute_recompute_tokens = 0
        self.reroute_gpu_s = 0.0  # GPU-s that reroutes cost: prefix recompute or KV handoff
        self.kv_handoffs = 0
        self.preemptions = 0  # running sequences preempted when the KV filled (recomputed)
        self.kv_evictions = 0  # cached prefixes of tool-waiting executions evicted (recomputed)
        self.kv_recompute_tokens = 0  # prefix tokens prefilled again after either
        self.kv_recompute_gpu_s = 0.0  # the GPU-s of those prefills
        self.publishes = 0
        self.sealed_batches = 0
        self.elastic = [c for c in self.cells if not c.standalone]
        self._by_id = {c.cid: c for c in self.cells}
        self.placement = make_placement(placement, self.cells)
        self.role_epoch = 0  # bumped on every role change (lets views be cached)
        # overlapping bursts: the per-version ledger, live groups, the cancel-early rule
        self.versions: dict[int, VersionLedger] = {}
        self.live: dict[int, dict[int, Group]] = {}  # version -> unconsumed, uncancelled groups
        self.stale_rule = stale_rule
        self.partial_max_versions = partial_max_versions
        self.cancelled_groups = 0
        self.cancelled_executions = 0
        self.restamped_groups = 0
        self.migrations = 0
        self.ready_log: deque[tuple[float, float]] = deque()  # (time, training work) of ready groups
        self.ready_log_tokens = 0.0
        self.rate_window_s = rate_window_s
        self.trainer.on_consumed = self._consumed

    # -- executions --------------------------------------------------------------------------

    def dispatch(self, burst: int, version: int, tasks: list[int], episodes: list[list[Episode]]) -> None:
        t = self.loop.now
        vl = self.versions.setdefault(version, VersionLedger())
        live = self.live.setdefault(version, {})
        for task, eps in zip(tasks, episodes):
            g = Group(len(self.groups), task, burst, version, len(eps), dispatched_version=version)
            g.length = sum(ep.total_output for ep in eps)
            self.groups.append(g)
            live[g.gid] = g
            vl.groups += 1
            for ep in eps:
                ex = Execution(len(self.executions), g, ep, dispatched_s=t)
                g.members.append(ex)
                self.executions.append(ex)
                self.queue.append(ex)
                self.ledger.dispatched += 1
                vl.dispatched += 1
        self.fill()

    def fill(self) -> None:
        """Places homeless executions, then launches queued ones, into free rollout slots."""
        homeless, queue = self.homeless, self.queue
        if not homeless and not queue:
            return
        for c in self.placement.picks():
            if homeless:
                self._place(homeless.popleft(), c)
                continue
            while queue and queue[0].state is ExecState.CLOSED:  # cancelled while queued
                queue.popleft()
            if not queue:
                return
            ex = queue.popleft()
            self.versions[ex.group.version].launched += 1
            ex.state = ExecState.SANDBOX
            ex.cell = c
            c.execs[ex.xid] = ex
            ex.launched_s = self.loop.now
            self.ledger.launched += 1
            self.loop.schedule(self.loop.now + ex.ep.sandbox_s, self._turn_arrives, ex)

    def _turn_arrives(self, ex: Execution) -> None:
        if ex.state is ExecState.CLOSED:  # cancelled meanwhile
            return
        c = ex.cell
        if c is None:  # homeless: it will be resumed when placed
            ex.state = ExecState.GPU
            return
        ex.state = ExecState.GPU
        c.account(self.loop.now)
        prompt = ex.ep.prompt_tokens[ex.turn]
        ex.ctx += prompt
        ex.fresh = prompt
        ex.remaining = ex.ep.output_tokens[ex.turn]
        self._admit_or_wait(c, ex)

    def _admit_or_wait(self, c: Cell, ex: Execution) -> None:
        """Admits ``ex``'s turn on ``c`` if its context fits the KV (behind any earlier
        waiter), else queues it."""
        eng = c.engine
        if eng.bounded and (eng.waiting or not eng.fits(ex.ctx)):
            ex.waiting = True
            eng.waiting.append(ex)
            return
        self._admit(c, ex)
        self._reschedule(c)

    def _admit(self, c: Cell, ex: Execution) -> None:
        """Prefills what ``ex``'s KV on ``c`` lacks (the new tokens after a cached prefix; the
        whole context after a reroute, an eviction or a preemption) and starts its decode."""
        eng = c.engine
        prefix = ex.ctx - ex.fresh
        hit = eng.uncache(ex) or not eng.bounded
        if ex.recompute:  # rerouted: its KV is on another engine
            p = self.cost.prefill_s(ex.ctx, 0)
            self.reroute_recompute_tokens += prefix
            self.reroute_gpu_s += p - self.cost.prefill_s(ex.fresh, prefix)
            ex.recompute = False
        elif not hit and prefix > 0:  # evicted while on a tool, or preempted
            p = self.cost.prefill_s(ex.ctx, 0)
            self.kv_recompute_tokens += prefix
            self.kv_recompute_gpu_s += p - self.cost.prefill_s(ex.fresh, prefix)
        else:
            p = self.cost.prefill_s(ex.fresh, prefix)
        eng.add_stall("prefill", p)
        ex.fresh = 0
        eng.join(ex)
        if eng.bounded:
            self.kv_evictions += eng.trim()

    def _admit_waiting(self, c: Cell) -> None:
        """Admits queued turns, first come first served, while they fit."""
        eng = c.engine
        while eng.waiting and eng.fits(eng.waiting[0].ctx):
            ex = eng.waiting.popleft()
            ex.waiting = False
            self._admit(c, ex)

    def _preempt(self, c: Cell) -> None:
        """The running sequences' KV reached the capacity: preempts the youngest (the last
        admitted) until the rest fit, as vLLM's recompute preemption does. A preempted
        sequence keeps its generated tokens as context, loses its KV and goes to the front of
        the queue; its readmission prefills the whole context again."""
        eng = c.engine
        first = True
        while len(eng.active) > 1 and (first or eng.running_tokens() > eng.cap):
            first = False
            ex = next(reversed(eng.active.values()))
            n = eng.leave(ex)
            if n:
                self._generated(ex, n, eng.version)
            ex.ctx += n
            ex.remaining -= n
            ex.waiting = True
            eng.waiting.appendleft(ex)
            self.preemptions += 1

    def _reschedule(self, c: Cell) -> None:
        """Schedules the engine's next finish (the decode time to the next finish, inlined: the hot path)."""
        eng = c.engine
        eng.gen += 1
        fv = eng.next_finish_v()
        if fv is None:
            return
        n = len(eng.active)
        rate = eng.rate
        if rate is None:
            eng.rate_base = eng.v
            rate = eng.rate = self.cost.decode_rate(n, eng.a + n * eng.v)
        full = False  # the next event is the KV filling up, not a finish
        if eng.bounded and n > 1:
            v_full = (eng.cap - eng.a) / n  # running_tokens() reaches the capacity
            if v_full < fv:
                fv = max(v_full, eng.v)
                full = True
        base = eng.rate_base
        t = self.loop.now + (eng.stall_total if eng.stalls else 0.0) + rate.time(eng.v - base, fv - base)
        self.loop.schedule(t, self._engine_event, c, eng.gen, full)

    def _engine_event(self, c: Cell, gen: int, full: bool = False) -> None:
        eng = c.engine
        if gen != eng.gen or c.mode != "rollout":
            return
        c.account(self.loop.now)
        if full:
            self._preempt(c)
        else:
            version = eng.version
            for ex in eng.take_finished():  # V snaps to the first finish: float slack
                eng.remove(ex)
                n = ex.remaining
                self._generated(ex, n, version)
                ex.ctx += n
                ex.remaining = 0
                if eng.bounded and ex.turn < ex.ep.turns - 1:
                    eng.cache(ex)
                self._turn_done(ex)
            if eng.bounded:
                self._admit_waiting(c)
                self.kv_evictions += eng.trim()
        self._reschedule(c)

    def _generated(self, ex: Execution, n: int, version: int) -> None:
        gv = ex.group.gen_by_version
        gv[version] = gv.get(version, 0) + n
        if ex.cell is not None:
            ex.cell.engine.tokens += n

    def _turn_done(self, ex: Execution) -> None:
        t = self.loop.now
        last = ex.turn >= ex.ep.turns - 1
        if last:
            ex.state = ExecState.REWARD
            self.loop.schedule(t + ex.ep.reward_s, self._close, ex)
        else:
            ex.state = ExecState.TOOL
            delay = ex.ep.tool_s[ex.turn]
            ex.turn += 1
            self.loop.schedule(t + delay, self._turn_arrives, ex)

    def _close(self, ex: Execution) -> None:
        if ex.state is ExecState.CLOSED:  # cancelled meanwhile
            return
        t = self.loop.now
        ex.state = ExecState.CLOSED
        ex.closed_s = t
        if ex.cell is not None:
            del ex.cell.execs[ex.xid]
            ex.cell.engine.uncache(ex)
            ex.cell = None
        elif ex in self.homeless:  # closed (tool or reward done) while waiting for a slot
            self.homeless.remove(ex)
        self.ledger.finished += 1
        g = ex.group
        vl = self.versions[g.version]
        vl.finished += 1
        g.closed += 1
        g.tokens += ex.ctx
        g.work += self.cost.train_work_tokens(ex.ctx)
        if g.closed == g.size:
            g.ready_s = t
            vl.ready += 1
            self.ready_log.append((t, g.work))
            self.ready_log_tokens += g.work
            self.trainer_progress()
            self.trainer.pool.append(g)
            self.trainer.pool_tokens += g.work
            self._trainer_kick()
        self.fill()
        self.on_boundary()

    # -- rerouting ---------------------------------------------------------------------------

    def _drain(self, src: Cell) -> None:
        """Moves every execution routed to ``src`` elsewhere (continuations)."""
        t = self.loop.now
        src.account(t)
        eng = src.engine
        moving = sorted(src.execs.values(), key=lambda e: e.xid)
        for ex in moving:
            self._detach(src, ex)
            self.reroutes += 1
            ex.reroutes += 1
            dst = self.placement.pick()
            if dst is None:
                self.homeless.append(ex)
            else:
                self._place(ex, dst)
        eng.heap.clear()
        eng.stalls.clear()
        eng.stall_total = 0.0
        eng.waiting.clear()
        eng.cached.clear()
        eng.cached_total = 0
        eng.rate = None
        eng.gen += 1

    def _detach(self, src: Cell, ex: Execution) -> None:
        """Takes ``ex`` off ``src`` (its request cancelled at the engine: the tokens
        generated so far count and become context the destination continues from)."""
        eng = src.engine
        if ex.xid in eng.active:
            n = eng.leave(ex)
            if n:
                self._generated(ex, n, eng.version)
            ex.ctx += n
            ex.remaining -= n
        self._unqueue(eng, ex)
        del src.execs[ex.xid]
        ex.cell = None

    @staticmethod
    def _unqueue(eng: Engine, ex: Execution) -> None:
        """Takes ``ex`` out of ``eng``'s admission queue and prefix cache (it leaves)."""
        if ex.waiting:
            eng.waiting.remove(ex)
            ex.waiting = False
        eng.uncache(ex)

    def _place(self, ex: Execution, dst: Cell) -> None:
        t = self.loop.now
        ex.cell = dst
        dst.execs[ex.xid] = ex
        dst.account(t)
        if self.cc.kv_handoff and ex.ctx > 0:
            handoff_s = self.cost.kv_handoff_s(ex.ctx)
            dst.engine.add_stall("prefill", handoff_s)
            self.kv_handoffs += 1
            self.reroute_gpu_s += handoff_s
            dst.engine.cache(ex)  # the moved KV is there, as a cached prefix
        elif ex.ctx > 0:
            ex.recompute = True
        if ex.state is ExecState.GPU:
            if ex.remaining > 0:  # continuation of the cancelled request
                self._admit_or_wait(dst, ex)
            else:  # was homeless before its turn arrived
                self._turn_arrives(ex)

    # -- roles -------------------------------------------------------------------------------

    def _set_role(self, c: Cell, role: Role) -> None:
        c.role = role
        self.role_epoch += 1
        self.placement.role_changed(c)

    def _after(self, c: Cell, mode: str, seconds: float, then: Callable[[Cell, int], None]) -> None:
        """``c`` spends ``seconds`` in ``mode``, then ``then`` runs (a no-op if anything
        newer happened to ``c`` meanwhile: its generation moved on)."""
        c.set_mode(self.loop.now, mode)
        c.gen += 1
        self.loop.schedule(self.loop.now + seconds, then, c, c.gen)

    def _switch(self, c: Cell, seconds: float, then: Callable[[Cell, int], None]) -> None:
        """A role switch of ``seconds`` (counted), then ``then``."""
        self.role_switches += 1
        self.switch_s += seconds
        self._after(c, "role_switch", seconds, then)

    def move_to_training(self, c: Cell) -> bool:
        if c.role is not Role.ROLLOUT:
            return False
        self._set_role(c, Role.DRAINING)  # first: no destination may be the source
        self._drain(c)
        self._switch(c, self.cc.switch_to_train_s, self._switched_to_training)
        self.fill()
        return True

    def _switched_to_training(self, c: Cell, gen: int) -> None:
        if gen != c.gen:
            return
        self._set_role(c, Role.TRAINING)
        if c.return_after_switch:
            c.return_after_switch = False
            self.return_to_rollout(c)
            return
        if c.index > 0 and self.cc.weight_sync_s > 0:  # satellites pull the core's weights
            self._after(c, "weight_sync", self.cc.weight_sync_s, self._join)
        else:
            self._join(c, c.gen)
        self.on_boundary()

    def _join(self, c: Cell, gen: int) -> None:
        if gen != c.gen or c.role is not Role.TRAINING:
            return
        self.trainer_progress()
        c.joined = True
        self.trainer.members.append(c)
        c.set_mode(self.loop.now, "idle_train")
        self._trainer_kick()

    def return_to_rollout(self, c: Cell) -> bool:
        if c.role is Role.DRAINING:
            changed = not c.return_after_switch
            c.return_after_switch = True
            return changed
        if c.role is not Role.TRAINING:
            return False
        self.trainer_progress()
        if c.joined:
            self.trainer.members.remove(c)
            c.joined = False
        self._set_role(c, Role.RETURNING)
        self._switch(c, self.cc.switch_to_rollout_s, self._switched_to_rollout)
        self._trainer_kick()
        return True

    def _switched_to_rollout(self, c: Cell, gen: int) -> None:
        if gen != c.gen:
            return
        self._set_role(c, Role.ROLLOUT)
        c.engine.version = self.published
        c.set_mode(self.loop.now, "rollout")
        self.fill()
        self.on_boundary()

    def publish(self, version: int) -> bool:
        """Loads ``version`` on every rollout engine (a stall of weight_sync_s each)."""
        if version <= self.published:
            return False
        t = self.loop.now
        self.published = version
        self.publishes += 1
        for c in self.cells:
            if c.role is Role.ROLLOUT:
                c.account(t)
                c.engine.add_stall("weight_sync", self.cc.weight_sync_s)
                c.engine.version = version
                self._reschedule(c)
        return True

    # -- training ----------------------------------------------------------------------------

    def trainer_progress(self) -> None:
        self.trainer.progress(self.loop.now)

    def _trainer_kick(self) -> None:
        """Re-evaluates the stream after any change: assigns work, sets members' modes, and
        schedules the next trainer event."""
        tr = self.trainer
        t = self.loop.now
        tr.progress(t)
        tr.assign()
        self.cancel_unconsumable()
        for c in tr.members:
            busy = tr.work > EPS if tr.optimizing_until < 0 else c in tr.opt_members
            mode = "train" if busy else "idle_train"
            if c.mode != mode:
                c.set_mode(t, mode)
        tr.gen += 1
        if tr.optimizing_until >= 0:
            self.loop.schedule(tr.optimizing_until, self._trainer_event, tr.gen)
        elif tr.members and tr.work > EPS:
            dt = tr.work / (tr.per_cell_rate * len(tr.members))
            self.loop.schedule(t + dt, self._trainer_event, tr.gen)
        elif tr.members and tr.needs == 0 and tr.work <= EPS:
            self._start_optimizer()

    def _start_optimizer(self) -> None:
        tr = self.trainer
        tr.optimizing_until = self.loop.now + self.cc.train_step_fixed_s
        tr.opt_members = list(tr.members)  # the joining window closes here
        for c in tr.members:
            if c.mode != "train":
                c.set_mode(self.loop.now, "train")
        tr.gen += 1
        self.loop.schedule(tr.optimizing_until, self._trainer_event, tr.gen)

    def _trainer_event(self, gen: int) -> None:
        tr = self.trainer
        if gen != tr.gen:
            return
        t = self.loop.now
        if tr.optimizing_until >= 0:
            if t + EPS >= tr.optimizing_until:
                tr.optimizing_until = -1.0
                tr.opt_members = []
                tr.t_last = t
                tr.version += 1
                tr.batch_id += 1
                tr.needs = tr.batch_groups
                tr.work = 0.0
                self.cancel_unconsumable()
                tr.purge_stale()
                self._trainer_kick()
                self.on_update(tr.version)
                self.on_boundary()
            return
        tr.progress(t)
        # The event was scheduled for the work to run out: whatever float residue is left
        # (the clock's resolution at large t can be coarser than the remaining work) is done.
        tr.work = 0.0
        self._trainer_kick()
        self.on_boundary()  # the unassigned supply changed

    def seal_batch(self, batch_id: int) -> bool:
        """Closes the current batch with the groups it has: those already claimed plus the
        ready ones waiting in the pool (a drained burst: no more will come). The optimizer
        step follows once they are trained."""
        tr = self.trainer
        if tr.batch_id != batch_id or tr.needs <= 0:
            return False
        fresh = sum(1 for g in tr.pool if tr.version - g.version <= tr.max_staleness)
        if fresh >= tr.needs:
            return False  # the batch fills from what is ready: nothing to seal
        if fresh == 0 and tr.needs >= tr.batch_groups:
            return False  # an empty batch is not sealed: no update without data
        self.sealed_batches += 1
        tr.needs = fresh
        self._trainer_kick()
        return True

    # -- overlapping bursts: cancel early, migrate, planned moves ---------------------------

    def _consumed(self, g: Group) -> None:
        self.live.get(g.version, {}).pop(g.gid, None)
        vl = self.versions.setdefault(g.version, VersionLedger())
        vl.consumed += 1
        vl.ready -= 1

    def cancel_unconsumable(self) -> int:
        """The rule for unconsumable groups (gyre.staleness), the same for every policy: every
        group that no batch within the staleness bound can take any more is cancelled now (its
        ready copy leaves the pool, its open members are stopped, their slots freed), or, under
        the partial rule, a group with a member started is restamped and goes on. Returns the
        groups cancelled."""
        tr = self.trainer
        lo = staleness.oldest_usable(tr.version, tr.needs == 0, tr.max_staleness)
        gone = [u for u in self.live if u < lo]
        n = 0
        for u in gone:
            for g in list(self.live.pop(u).values()):
                started = any(ex.launched_s >= 0 for ex in g.members)
                new = restamp_version(tr.version, tr.needs == 0, tr.max_staleness)
                moved = new - g.dispatched_version
                if g.closed < g.size and goes_on(self.stale_rule, started, moved, self.partial_max_versions):
                    self._restamp(g, new)
                    continue
                self._cancel_group(g)
                n += 1
        if n:
            self.fill()
        return n

    def _restamp(self, g: Group, version: int) -> None:
        """Moves an open group to ``version`` in the per-version ledger (the partial rule)."""
        old = self.versions[g.version]
        new = self.versions.setdefault(version, VersionLedger())
        launched = sum(1 for ex in g.members if ex.launched_s >= 0)
        for vl, sign in ((old, -1), (new, 1)):
            vl.groups += sign
            vl.dispatched += sign * g.size
            vl.launched += sign * launched
            vl.finished += sign * g.closed
        g.version = version
        self.live.setdefault(version, {})[g.gid] = g
        self.restamped_groups += 1

    def _cancel_group(self, g: Group) -> None:
        tr = self.trainer
        g.cancelled = True
        vl = self.versions[g.version]
        vl.cancelled += 1
        self.cancelled_groups += 1
        if g.closed == g.size:  # ready, in the pool
            if g in tr.pool:
                tr.pool.remove(g)
                tr.pool_tokens -= g.work
            vl.ready -= 1
            return
        for ex in g.members:
            if ex.state is not ExecState.CLOSED:
                self._cancel_exec(ex)

    def _cancel_exec(self, ex: Execution) -> None:
        t = self.loop.now
        vl = self.versions[ex.group.version]
        if ex.state is ExecState.QUEUED:  # counts as launched and closed at once (F <= L)
            self.ledger.launched += 1
            vl.launched += 1
        elif ex.cell is not None:
            c = ex.cell
            c.account(t)
            eng = c.engine
            if ex.xid in eng.active:
                n = eng.leave(ex)
                if n:
                    self._generated(ex, n, eng.version)
                ex.ctx += n
            self._unqueue(eng, ex)
            del c.execs[ex.xid]
            ex.cell = None
            if eng.bounded:
                self._admit_waiting(c)
            self._reschedule(c)
        else:
            try:
                self.homeless.remove(ex)
            except ValueError:
                pass
        ex.state = ExecState.CLOSED
        ex.cancelled = True
        ex.closed_s = t
        ex.token += 1
        self.ledger.finished += 1
        vl.finished += 1
        self.cancelled_executions += 1

    def migrate(self, xid: int, cid: str) -> bool:
        """Moves one live execution to rollout cell ``cid`` as a continuation (the reroute a
        draining cell uses, KV handoff where enabled). False when it cannot (closed, not
        routed, same cell, destination not in rollout or full)."""
        if not 0 <= xid < len(self.executions):
            return False
        ex = self.executions[xid]
        src = ex.cell
        dst = self._by_id.get(cid)
        if (
            ex.state is ExecState.CLOSED
            or src is None
            or dst is None
            or dst is src
            or dst.role is not Role.ROLLOUT
            or dst.free <= 0
        ):
            return False
        src.account(self.loop.now)
        self._detach(src, ex)
        self.migrations += 1
        ex.reroutes += 1
        self._place(ex, dst)
        if src.engine.bounded:
            self._admit_waiting(src)
        self._reschedule(src)
        return True

    def plan_moves(self, cids: tuple[str, ...]) -> bool:
        """Placement keeps the planned cells free while other rollout cells have room."""
        new = frozenset(cids)
        if new == self.placement.avoid:
            return False
        self.placement.avoid = new
        return True

    def ready_rate(self) -> tuple[float, float]:
        """(ready groups per second, training work per ready group in 6N-equivalent tokens) over
        the last ``rate_window_s``
        (the live scheduler measures over its ``rate_window_s`` too); before a whole window
        has passed, over the time since the start."""
        log = self.ready_log
        now = self.loop.now
        while log and log[0][0] < now - self.rate_window_s:
            self.ready_log_tokens -= log.popleft()[1]
        if not log:
            return 0.0, 0.0
        tokens = self.ready_log_tokens / len(log)
        span = min(self.rate_window_s, now)
        if span <= 0:
            return 0.0, tokens
        return len(log) / span, tokens

    # -- views -------------------------------------------------------------------------------

    def capacity(self) -> int:
        return sum(c.slots for c in self.cells if c.role is Role.ROLLOUT)

    def finish(self, t: float) -> None:
        """Closes the accounts at time t."""
        for c in self.cells:
            c.account(t)
