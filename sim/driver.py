"""Drives the simulated cluster with the scheduler's own policy code.

At every transition boundary (an execution closes, a group becomes ready, the trainer
claims work or publishes an update, a cell finishes a role switch, and when the supply
timer of the waterlevel policy expires) the driver builds a
``services.scheduler.policy.Snapshot`` from the cluster, calls ``policy.decide()`` and
applies the returned actions in order, until the policy only holds. Nothing in here
decides a role: that is the policy's job.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from services.scheduler import policy as P
from sim.cluster import Cluster, ExecState, Role
from sim.config import ScenarioConfig, SimConfig
from sim.events import EventLoop
from sim.metrics import RunResult, collect
from sim.workload import make_trace

MAX_ROUNDS = 8
"""decide() calls per boundary: actions are applied, then the policy is asked again."""

RECOMPUTE_WINDOW_S = 1800.0
"""Window of the measured recompute share (Pipeline.kv_recompute_share), simulated seconds:
long enough that the thrash which engaged Gyre's dispatch cut stays in it while the cut
works (over 600 s the cut engaged and released as the recompute came and went)."""

CONTEXT_EVERY_S = 10.0
"""How often the mean context of the open executions is measured (simulated seconds)."""


@dataclass
class PolicySpec:
    """Which policy to run and how (``training_cells`` for the static split)."""

    name: str
    training_cells: int = 0
    overprovision: float | None = None  # None: the scenario's

    placement: str | None = None  # None: the scenario's

    @property
    def label(self) -> str:
        where = f", {self.placement}" if self.placement else ""
        if self.name in ("static", "async-static", "async-static-lend"):
            return f"{self.name} T={self.training_cells}{where}"
        return self.name + where

    @property
    def is_async(self) -> bool:
        """Continuous dispatch under the staleness gate (needs the pipeline view)."""
        return self.name in P.ASYNC_POLICIES


@dataclass
class Sample:
    """One point of the allocation / waterlevel time series."""

    t: float
    rollout: int
    training: int
    switching: int
    waterlevel: int
    capacity: int
    ready: int
    version: int


@dataclass
class Driver:
    """One run: a scenario, a policy, a trace; ``run()`` returns its ``RunResult``."""

    cfg: SimConfig
    scenario: ScenarioConfig
    spec: PolicySpec
    record_every_s: float = 0.0
    events: list[tuple[float, str, str]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        sc = self.scenario
        pp = self.cfg.policy
        self.loop = EventLoop()
        self.profile = self.cfg.profiles[sc.profile]
        self.trace = make_trace(self.cfg, sc)
        self.cluster = Cluster(
            loop=self.loop,
            cost_cfg=self.cfg.cost,
            cells=sc.cluster.cells,
            standalone=sc.cluster.standalone_cells,
            slots=sc.cluster.slots_per_cell,
            batch_groups=sc.training.batch_groups,
            max_staleness=sc.training.max_staleness,
            placement=self._placement(),
            rate_window_s=pp.rate_window_s,
            stale_rule=sc.training.stale_rule,
            partial_max_versions=sc.training.partial_max_versions,
        )
        gyre = pp.gyre_config(pp.drain_grace_s)
        self.policy = P.make_policy(
            self.spec.name,
            fraction=pp.supply_fraction,
            interval_s=pp.supply_interval_s,
            training_cells=self.spec.training_cells,
            drain_grace_s=pp.drain_grace_s,
            gyre=gyre,
        )
        self.tracker = P.SupplyTracker(pp.supply_fraction)
        op = self.spec.overprovision
        if op is None:
            op = pp.colocated_overprovision if self.spec.name == "colocated" else sc.training.overprovision
        bg = sc.training.batch_groups
        self.groups_per_burst = max(bg, math.ceil(bg * (1 + op) - 1e-9))
        self.quota = self.groups_per_burst * self.profile.group_size
        self.extra_groups = self.groups_per_burst - bg
        self.show_tail = self.spec.name == "gyre" and pp.gyre_migrate
        cc = self.cfg.cost
        self._switch_s = cc.switch_to_train_s + cc.weight_sync_s + cc.switch_to_rollout_s
        """The switch round trip the live scheduler measures (Pipeline.switch_s): here its
        cost exactly (a satellite pulls the core's weights on the way in)."""
        kv = cc.kv_capacity_tokens
        self._kv_tokens = kv if math.isfinite(kv) else 0.0
        self._measure_kv = self.spec.name == "gyre"
        """Gyre reads the KV inputs (context, recompute share); the baselines get zeros."""
        self._context_at = -math.inf
        self._context_tokens = 0.0
        self._recompute: deque[tuple[float, float, float]] = deque()  # (t, recompute GPU-s, rollout cell-s)
        self._rollout_cell_s = 0.0
        self._recompute_share = 0.0
        self._recompute_peak = 0.0
        self.burst: P.BurstView | None = None
        self.next_task = 0
        self.update_times: list[float] = []
        self.done_s: float | None = None
        self.holds = 0
        self.decisions = 0
        self.decide_s: list[float] = []  # wall time of each decide() call (decide_ms_p50/p99: scale)
        self._wake_at = -1.0
        self._views: tuple[P.CellView, ...] = ()
        self._drained_since: float | None = None
        self._drain_wake_at = -1.0
        self._views_epoch = -1
        self._load_views: dict[tuple[str, Role, int], P.CellView] = {}
        self._in_boundary = False
        self._again = False
        self.cluster.on_boundary = self.boundary
        self.cluster.on_update = self._updated

    def _placement(self) -> str:
        """The spec's placement, else Gyre's own (spread, planned cells last: its PlanMoves
        lever), else the scenario's."""
        if self.spec.placement:
            return self.spec.placement
        if self.spec.name == "gyre" and self.cfg.policy.gyre_plan:
            return "least_loaded"
        return self.scenario.cluster.placement

    # -- snapshot ----------------------------------------------------------------------------

    def snapshot(self) -> P.Snapshot:
        cl = self.cluster
        now = self.loop.now
        if self.spec.is_async:  # with the per-cell load (views are immutable: reuse them)
            views = self._load_views
            out = []
            for c in cl.cells:
                key = (c.cid, c.role, len(c.execs))
                v = views.get(key)
                if v is None:
                    v = views[key] = P.CellView(
                        c.cid,
                        P.CellKind.STANDALONE if c.standalone else P.CellKind.ELASTIC,
                        -1 if c.standalone else c.index,
                        c.role,
                        c.slots,
                        key[2],
                    )
                out.append(v)
            cells = tuple(out)
        else:
            if self._views_epoch != cl.role_epoch:
                self._views = tuple(
                    P.CellView(
                        c.cid,
                        P.CellKind.STANDALONE if c.standalone else P.CellKind.ELASTIC,
                        -1 if c.standalone else c.index,
                        c.role,
                        c.slots,
                    )
                    for c in cl.cells
                )
                self._views_epoch = cl.role_epoch
            cells = self._views
        tr = cl.trainer
        supply = self.tracker.observe(now, len(tr.pool), tr.batch_groups, tr.needs, tr.batch_id)
        led = cl.ledger
        target = self.scenario.training.updates
        if tr.version >= target:
            next_quota = 0
        else:  # async: the gate bounds the dispatch, the task source does not
            next_quota = (1 << 30) if self.spec.is_async else self.quota
        # Since when W has been 0 (the live scheduler passes the same): lets the policy seal
        # a drained burst's partial batch instead of waiting for groups that will not come.
        if led.dispatched - led.finished > 0 or self.burst is None:
            self._drained_since = None
        elif self._drained_since is None:
            self._drained_since = now
        return P.Snapshot(
            now_s=now,
            ledger=P.LedgerCounts(led.dispatched, led.launched, led.finished),
            cells=cells,
            supply=supply,
            burst=self.burst,
            policy_version=tr.version,
            next_quota=next_quota,
            drained_since_s=self._drained_since,
            pipeline=self._pipeline() if self.spec.is_async else None,
            executions=self._tail() if self.show_tail else (),
        )

    def _pipeline(self) -> P.Pipeline:
        cl = self.cluster
        if self._measure_kv:
            self._sample_kv()
        tr = cl.trainer
        eta = tr.max_staleness
        lo = tr.version - eta - 1
        versions = tuple(
            P.VersionCounts(u, **asdict(vl))  # a counter missing on either side raises
            for u, vl in cl.versions.items()
            if u >= lo or vl.dispatched > vl.finished
        )
        rate, per_group = cl.ready_rate()
        return P.Pipeline(
            max_staleness=eta,
            group_size=self.profile.group_size,
            batch_groups=tr.batch_groups,
            extra_groups=self.extra_groups,
            published_version=cl.published,
            groups_dispatched=len(cl.groups),
            groups_cancelled=cl.cancelled_groups,
            groups_consumed=tr.consumed_groups,
            ready_groups=len(tr.pool),
            batch_assigned=tr.batch_groups - tr.needs,
            backlog_tokens=tr.work,
            ready_tokens=tr.pool_tokens,
            optimizing=tr.optimizing_until >= 0,
            train_rate_per_cell=tr.per_cell_rate,
            ready_rate=rate,
            tokens_per_group=per_group,
            switch_s=self._switch_s,
            kv_tokens_per_cell=self._kv_tokens,
            context_tokens=self._context_tokens,
            kv_recompute_share=self._recompute_share,
            kv_recompute_peak=self._recompute_peak if self._measure_kv else None,
            versions=versions,
            planned=tuple(sorted(cl.placement.avoid, key=lambda cid: self._cell(cid).index)),
        )

    def _sample_kv(self) -> None:
        """Every ``CONTEXT_EVERY_S`` of simulated time, as a live scheduler would sample them:
        the mean context of the launched, open executions (Pipeline.context_tokens) and the
        recompute share (:meth:`_measure_recompute`)."""
        now = self.loop.now
        if now - self._context_at < CONTEXT_EVERY_S:
            return
        self._measure_recompute(now, now - self._context_at if self._recompute else 0.0)
        self._context_at = now
        total = n = 0
        for groups in self.cluster.live.values():
            for g in groups.values():
                for ex in g.members:
                    if ex.cell is not None and ex.state is not ExecState.CLOSED:
                        total += ex.ctx
                        n += 1
        if n:
            self._context_tokens = total / n

    def _measure_recompute(self, now: float, dt: float) -> None:
        """The share of the rollout cells' time spent prefilling again what the KV evicted or
        preempted, over the last ``RECOMPUTE_WINDOW_S`` (Pipeline.kv_recompute_share; a live
        scheduler reads it from the engines' prefix-cache and preemption counters)."""
        cl = self.cluster
        self._rollout_cell_s += dt * sum(1 for c in cl.cells if c.role is Role.ROLLOUT)
        q = self._recompute
        q.append((now, cl.kv_recompute_gpu_s, self._rollout_cell_s))
        while len(q) > 2 and now - q[1][0] >= RECOMPUTE_WINDOW_S:
            q.popleft()
        _, r0, c0 = q[0]
        self._recompute_share = (
            (cl.kv_recompute_gpu_s - r0) / (self._rollout_cell_s - c0) if self._rollout_cell_s > c0 else 0.0
        )
        self._recompute_peak = max(self._recompute_peak, self._recompute_share)

    def _tail(self, limit: int = 256) -> tuple[P.ExecView, ...]:
        """Open executions of the oldest consumable version (the tail the batch waits on)."""
        cl = self.cluster
        tr = cl.trainer
        lo = P.staleness.oldest_usable(tr.version, tr.needs == 0, tr.max_staleness)
        live = cl.live.get(lo)
        vl = cl.versions.get(lo)
        if not live or vl is None or vl.dispatched - vl.finished > limit:
            return ()  # not the tail yet (or nothing left of it)
        now = self.loop.now
        out = []
        for g in live.values():
            for ex in g.members:
                if ex.cell is not None and ex.state is not ExecState.CLOSED:
                    out.append(
                        P.ExecView(str(ex.xid), ex.cell.cid, g.version, now - ex.launched_s, ex.reroutes)
                    )
                    if len(out) >= limit:
                        return tuple(out)
        return tuple(out)

    # -- actions -----------------------------------------------------------------------------

    def _cell(self, cid: str):
        return self.cluster._by_id[cid]

    def apply(self, a: P.Action) -> bool:
        """Applies one action; False when it changed nothing (a repeat of a level-triggered
        decision, e.g. publishing a version the engines already serve)."""
        cl = self.cluster
        if isinstance(a, P.MoveToTraining):
            return cl.move_to_training(self._cell(a.cell_id))
        if isinstance(a, P.ReturnToRollout):
            return cl.return_to_rollout(self._cell(a.cell_id))
        if isinstance(a, P.PublishPolicy):
            return cl.publish(a.version)
        if isinstance(a, P.DispatchBurst):
            self._dispatch(a)
            return True
        if isinstance(a, P.KeepInTraining):
            return False
        if isinstance(a, P.SealBatch):
            return cl.seal_batch(a.batch_id)
        if isinstance(a, P.Migrate):
            return cl.migrate(int(a.execution_id), a.cell_id)
        if isinstance(a, P.PlanMoves):
            return cl.plan_moves(a.cell_ids)
        raise TypeError(f"unknown action {a!r}")

    def _dispatch(self, a: P.DispatchBurst) -> None:
        n_groups = a.quota // self.profile.group_size
        tasks = list(range(self.next_task, self.next_task + n_groups))
        self.next_task += n_groups
        episodes = [self.trace.group(task, a.policy_version) for task in tasks]
        quota = n_groups * self.profile.group_size
        self.burst = P.BurstView(a.burst_id, quota, a.policy_version, a.policy_version + 1)
        self.cluster.dispatch(a.burst_id, a.policy_version, tasks, episodes)

    # -- boundaries --------------------------------------------------------------------------

    def boundary(self) -> None:
        """Asks the policy and applies its actions until it only holds."""
        if self._in_boundary:  # an action triggered another boundary: loop again after
            self._again = True
            return
        self._in_boundary = True
        try:
            for _ in range(MAX_ROUNDS):
                self._again = False
                snap = self.snapshot()
                t0 = time.perf_counter()
                actions = self.policy.decide(snap)
                self.decide_s.append(time.perf_counter() - t0)
                self.decisions += 1
                acted = False
                for a in actions:
                    if isinstance(a, P.Hold):
                        self.holds += 1
                        continue
                    if self.apply(a):
                        acted = True
                        self.events.append((self.loop.now, a.kind, a.reason))
                if not acted and not self._again:
                    break
            self._sample(snap)
            self._arm_supply_timer(snap)
            self._arm_drain_timer()
        finally:
            self._in_boundary = False

    def _arm_supply_timer(self, snap: P.Snapshot) -> None:
        """The supply condition must hold for interval_s: wake the policy when it has."""
        if snap.supply.held_since_s is None:
            return
        due = snap.supply.held_since_s + self.cfg.policy.supply_interval_s + 1e-6
        if due > self.loop.now and due != self._wake_at:
            self._wake_at = due
            self.loop.schedule(due, self.boundary)

    def _arm_drain_timer(self) -> None:
        """A drained burst counts after drain_grace_s: wake the policy then."""
        if self._drained_since is None:
            return
        due = self._drained_since + self.cfg.policy.drain_grace_s + 1e-6
        if due > self.loop.now and due != self._drain_wake_at:
            self._drain_wake_at = due
            self.loop.schedule(due, self.boundary)

    def _sample(self, snap: P.Snapshot) -> None:
        cl = self.cluster
        t = self.loop.now
        if self.samples and self.record_every_s > 0 and t - self.samples[-1].t < self.record_every_s:
            return
        roles = [c.role for c in cl.elastic]
        self.samples.append(
            Sample(
                t=t,
                rollout=sum(r is Role.ROLLOUT for r in roles),
                training=sum(r is Role.TRAINING for r in roles),
                switching=sum(r in (Role.DRAINING, Role.RETURNING) for r in roles),
                waterlevel=snap.ledger.waterlevel,
                capacity=cl.capacity(),
                ready=len(cl.trainer.pool),
                version=cl.trainer.version,
            )
        )

    def _updated(self, version: int) -> None:
        self.update_times.append(self.loop.now)
        if version >= self.scenario.training.updates:
            self.done_s = self.loop.now
            self.loop.stop()

    # -- run ---------------------------------------------------------------------------------

    def run(self) -> RunResult:
        wall = time.perf_counter()
        self.loop.schedule(0.0, self.boundary)
        self.loop.run(until=self.loop.now + self.scenario.training.horizon_s)
        end = self.done_s if self.done_s is not None else self.loop.now
        self.cluster.finish(end)
        return collect(self, end, time.perf_counter() - wall)


def run_policy(
    cfg: SimConfig, scenario: ScenarioConfig, spec: PolicySpec, record_every_s: float = 0.0
) -> RunResult:
    """Runs one policy on one scenario."""
    return Driver(cfg, scenario, spec, record_every_s=record_every_s).run()
