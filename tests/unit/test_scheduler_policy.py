"""Invariants of the waterlevel policy and the ledger, over random histories (hypothesis).

Random sequences of dispatch / launch / finish / duplicate finish / timeout / cell
registration and loss / time passing / supply changes / transitions completing, with the
policy deciding after every step. Checked at every step: D = Q + R + F and W >= 0; a cell
never moves to training when capacity after the move < W; the training set is always a
prefix of the elastic cells; no move before the supply condition held for interval_s (but
for the core of a drained burst, which trains on whatever is ready); at most one move at a
time. Plus example-based checks of burst end and the two baselines.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gyre.etcd.values import token_sha256
from gyre.execution import ExecutionStatus
from services.scheduler.ledger import Ledger, Task, validate_finish
from services.scheduler.policy import (
    BurstView,
    CellKind,
    CellState,
    CellView,
    ColocatedSyncPolicy,
    DispatchBurst,
    Hold,
    KeepInTraining,
    LedgerCounts,
    MoveToTraining,
    PublishPolicy,
    ReturnToRollout,
    SealBatch,
    Snapshot,
    StaticSplitConfig,
    StaticSplitPolicy,
    Supply,
    SupplyTracker,
    WaterlevelConfig,
    WaterlevelPolicy,
    capacity,
    is_prefix,
    make_policy,
    training_set,
)

# Common steps are listed several times so that they are drawn more often than rare ones.
_NAMES = (
    ["dispatch"]
    + ["launch"] * 3
    + ["finish"] * 3
    + ["register"] * 2
    + ["tick"] * 3
    + ["supply"] * 2
    + ["settle"] * 2
    + ["dup_finish", "timeout", "lose", "publish"]
)
OPS = st.tuples(st.sampled_from(_NAMES), st.integers(0, 16))


MOVES: list[int] = []
"""Moves per generated history (to show the property test is not vacuous)."""


class World:
    """A tiny cluster driven by the real Ledger and the real policy."""

    def __init__(self, fraction: float, interval_s: float, group_size: int = 2) -> None:
        self.policy = WaterlevelPolicy(WaterlevelConfig(fraction, interval_s))
        self.tracker = SupplyTracker(fraction)
        self.ledger = Ledger()
        self.cells: dict[str, CellView] = {}
        self.next_index = 0
        self.now = 0.0
        self.ready = 0
        self.batch_size = 4
        self.version = 0
        self.group_size = group_size
        self.supply = self.tracker.observe(0.0, 0, self.batch_size, self.batch_size)
        self.moves = 0
        self.drained_since: float | None = None
        MOVES.append(0)

    def snapshot(self) -> Snapshot:
        b = self.ledger.current_burst
        burst = None if b is None else BurstView(b.burst_id, b.quota, b.policy_version, b.target_version)
        counts = self.ledger.counts()
        if counts.waterlevel > 0:
            self.drained_since = None
        elif self.drained_since is None:
            self.drained_since = self.now
        return Snapshot(
            self.now,
            counts,
            tuple(self.cells.values()),
            self.supply,
            burst,
            self.version,
            6,
            self.drained_since,
        )

    def step(self, op: str, arg) -> None:
        led = self.ledger
        if op == "dispatch":
            arg = 1 + arg % 6
            tasks = [Task(f"task{i}") for i in range(arg)]
            led.apply_burst(led.plan_burst(tasks, self.group_size, self.version, 1, self.now))
        elif op == "launch":
            for _ in range(arg):
                nxt = led.next_queued()
                if nxt is None:
                    break
                rec = led.plan_launch(
                    nxt[0], nxt[1], token_sha256(f"tok{nxt[1]}-{nxt[0].burst_id}"), "h", self.now
                )
                led.apply(rec, self.now + 10.0)
        elif op in ("finish", "dup_finish"):
            running = (
                led.running_ids() if op == "finish" else [e for e, r in led.records.items() if r.state.final]
            )
            if running:
                eid = running[arg % len(running)]
                out = led.plan_finish(
                    eid, validate_finish(ExecutionStatus.COMPLETED, 0.5, "k", 0.0, 1.0), self.now
                )
                if out.duplicate:
                    assert op == "dup_finish"
                else:
                    led.apply(out.record)
        elif op == "timeout":
            self.now += arg
            for rec in led.plan_timeouts(self.now):
                led.apply(rec)
        elif op == "register":
            arg = max(1, arg)
            cid = f"cell-{len(self.cells) + 100 + self.next_index}"
            has_core = any(c.is_core for c in self.cells.values())
            if not has_core and self.next_index > 0:  # the core restarts with its index
                self.cells[cid] = CellView(cid, CellKind.ELASTIC, 0, CellState.ROLLOUT, arg)
            elif arg % 3 == 0:
                self.cells[cid] = CellView(cid, CellKind.STANDALONE, -1, CellState.ROLLOUT, arg)
            else:
                self.cells[cid] = CellView(cid, CellKind.ELASTIC, self.next_index, CellState.ROLLOUT, arg)
                self.next_index += 1
        elif op == "lose":
            if self.cells:
                cid = sorted(self.cells)[arg % len(self.cells)]
                del self.cells[cid]
        elif op == "tick":
            self.now += arg / 4.0
        elif op == "supply":
            self.ready = arg
        elif op == "settle":
            # A transition in flight completes.
            for c in list(self.cells.values()):
                if c.state is CellState.DRAINING:
                    self.cells[c.cell_id] = dataclasses.replace(c, state=CellState.TRAINING)
                elif c.state is CellState.RETURNING:
                    self.cells[c.cell_id] = dataclasses.replace(c, state=CellState.ROLLOUT)
        elif op == "publish":
            if training_set(self.cells.values()):
                self.version += 1
        self.supply = self.tracker.observe(self.now, self.ready, self.batch_size, self.batch_size)
        self.ledger.check_invariants()

    def decide_and_apply(self) -> None:
        snap = self.snapshot()
        actions = self.policy.decide(snap)
        moves = [a for a in actions if isinstance(a, MoveToTraining)]
        assert len(moves) <= 1, actions
        for a in actions:
            if isinstance(a, MoveToTraining):
                cell = self.cells[a.cell_id]
                # The three checks, recomputed independently of the policy.
                assert cell.state is CellState.ROLLOUT and cell.elastic
                assert capacity(snap.cells) - cell.slots >= snap.ledger.waterlevel, a.reason
                sup, cfg = snap.supply, self.policy.config
                held = (
                    sup.ready_groups >= cfg.fraction * sup.batch_size
                    and sup.held_since_s is not None
                    and snap.now_s - sup.held_since_s >= cfg.interval_s
                )
                if not held:
                    # Only the core of a drained burst trains on whatever is ready (no more will come).
                    assert snap.drained_for(cfg.drain_grace_s) and cell.is_core, a.reason
                    assert sup.ready_groups > 0 and "drained" in a.reason
                assert not any(
                    c.state in (CellState.DRAINING, CellState.RETURNING) for c in snap.cells if c.elastic
                )
                self.cells[a.cell_id] = dataclasses.replace(cell, state=CellState.DRAINING)
                self.moves += 1
                MOVES[-1] += 1
            elif isinstance(a, ReturnToRollout):
                c = self.cells[a.cell_id]
                self.cells[a.cell_id] = dataclasses.replace(c, state=CellState.RETURNING)
            elif isinstance(a, DispatchBurst):
                tasks = [Task(f"t{i}") for i in range(a.quota // self.group_size)]
                self.ledger.apply_burst(
                    self.ledger.plan_burst(tasks, self.group_size, a.policy_version, 1, self.now)
                )

    def check(self) -> None:
        self.ledger.check_invariants()
        c = self.ledger.counts()
        assert c.dispatched == c.queued + c.running + c.finished
        assert c.waterlevel >= 0
        assert is_prefix(list(self.cells.values())), self.cells


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=st.lists(st.integers(1, 16), min_size=0, max_size=6),
    ready=st.integers(0, 4),
    ops=st.lists(OPS, min_size=20, max_size=100),
    fraction=st.sampled_from([0.25, 0.5, 1.0]),
    interval=st.sampled_from([0.0, 2.0, 5.0]),
)
def test_policy_invariants_over_random_histories(initial, ready, ops, fraction, interval):
    w = World(fraction, interval)
    for slots in initial:
        w.step("register", slots)
    w.step("supply", ready)
    for op, arg in ops:
        w.step(op, arg)  # a loss or restart may break the prefix; the policy repairs it
        w.decide_and_apply()
        w.check()
    event(f"moves: {min(w.moves, 3)}")


def test_random_histories_do_move_cells():
    """Guards against a vacuous property test: some generated histories move cells."""
    MOVES.clear()
    test_policy_invariants_over_random_histories()
    assert sum(1 for m in MOVES if m > 0) >= 10, MOVES


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=60))
def test_ledger_matches_a_simple_model(ops):
    """The ledger's counts equal a model's: every execution closes once, duplicates change nothing."""
    w = World(0.5, 0.0)
    closed: set[str] = set()
    launched: set[str] = set()
    dispatched = 0
    for op, arg in ops:
        before = {e: r.state for e, r in w.ledger.records.items()}
        w.step(op, arg)
        after = w.ledger.records
        launched |= {e for e in after}
        for e, r in after.items():
            if r.state.final:
                if e in closed:
                    assert before.get(e) is r.state  # a closed execution never changes
                closed.add(e)
        if op == "dispatch":
            dispatched += (1 + arg % 6) * w.group_size
        c = w.ledger.counts()
        assert (c.dispatched, c.launched, c.finished) == (dispatched, len(launched), len(closed))


def _cells(*states: CellState, slots: int = 8, standalone: int = 0) -> tuple[CellView, ...]:
    out = [CellView(f"cell-{i}", CellKind.ELASTIC, i, s, slots) for i, s in enumerate(states)]
    if standalone:
        out.append(CellView("sa-0", CellKind.STANDALONE, -1, CellState.ROLLOUT, standalone))
    return tuple(out)


def _snap(cells, d=60, lc=50, f=19, ready=5, held_since=0.0, now=6.0, version=0, next_quota=60) -> Snapshot:
    return Snapshot(
        now,
        LedgerCounts(d, lc, f),
        cells,
        Supply(ready, 8, 8, 1, held_since),
        BurstView(1, 60, 0, 1),
        version,
        next_quota,
    )


def test_move_reason_names_both_checks():
    cells = _cells(CellState.ROLLOUT, CellState.ROLLOUT, standalone=40)
    actions = WaterlevelPolicy(WaterlevelConfig(0.5, 5.0)).decide(_snap(cells))
    assert actions == [
        MoveToTraining(
            "cell-0", "moved cell-0 to training: capacity 48 >= W 41, supply 0.62 >= 0.5 for 6.0 s"
        )
    ]


def test_no_move_when_capacity_after_move_below_w():
    cells = _cells(CellState.ROLLOUT, CellState.ROLLOUT, standalone=32)
    actions = WaterlevelPolicy().decide(_snap(cells))  # 48 - 8 = 40 < 41
    assert len(actions) == 1 and isinstance(actions[0], Hold)
    assert "capacity 40 < W 41" in actions[0].reason


def test_no_move_before_interval():
    cells = _cells(CellState.ROLLOUT, standalone=64)
    actions = WaterlevelPolicy(WaterlevelConfig(0.5, 5.0)).decide(_snap(cells, held_since=2.0))
    assert isinstance(actions[0], Hold) and "< 5.0 s" in actions[0].reason


def test_satellite_waits_for_core_and_one_at_a_time():
    p = WaterlevelPolicy(WaterlevelConfig(0.5, 0.0))
    draining = _cells(CellState.DRAINING, CellState.ROLLOUT, standalone=64)
    assert isinstance(p.decide(_snap(draining))[0], Hold)
    trained_core = _cells(CellState.TRAINING, CellState.ROLLOUT, standalone=64)
    assert p.decide(_snap(trained_core)) == [
        MoveToTraining(
            "cell-1", "moved cell-1 to training: capacity 64 >= W 41, supply 0.62 >= 0.5 for 6.0 s"
        )
    ]
    no_core = tuple(c for c in _cells(CellState.ROLLOUT, CellState.ROLLOUT, standalone=64) if c.index != 0)
    assert isinstance(p.decide(_snap(no_core))[0], Hold)


def test_burst_end_returns_satellites_and_keeps_core_only_if_checks_pass():
    p = WaterlevelPolicy(WaterlevelConfig(0.5, 0.0))
    cells = _cells(CellState.TRAINING, CellState.TRAINING, CellState.ROLLOUT, standalone=64)
    # Plenty of capacity: 64 + 8 (cell-1 returning) + 8 >= W 3 + 60.
    acts = p.decide(_snap(cells, d=60, lc=60, f=57, version=1))
    kinds = [type(a) for a in acts]
    assert kinds == [ReturnToRollout, PublishPolicy, KeepInTraining, DispatchBurst]
    assert acts[0].cell_id == "cell-1" and acts[2].cell_id == "cell-0"
    assert acts[3].burst_id == 2 and acts[3].policy_version == 1
    # Not enough room for the next burst's executions without the core: it returns too.
    acts = p.decide(_snap(cells, d=60, lc=60, f=57, version=1, next_quota=100))
    assert [type(a) for a in acts] == [ReturnToRollout, PublishPolicy, ReturnToRollout, DispatchBurst]
    assert "capacity 80 < W 103" in acts[2].reason
    # No supply for the next batch: the core returns.
    acts = p.decide(_snap(cells, d=60, lc=60, f=57, version=1, ready=0, held_since=None))
    assert isinstance(acts[2], ReturnToRollout) and "supply" in acts[2].reason


def test_colocated_waits_for_barrier_then_trains_all():
    p = ColocatedSyncPolicy()
    cells = _cells(CellState.ROLLOUT, CellState.ROLLOUT)
    assert isinstance(p.decide(_snap(cells))[0], Hold)
    acts = p.decide(_snap(cells, d=60, lc=60, f=60))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["cell-0", "cell-1"]
    trained = _cells(CellState.TRAINING, CellState.TRAINING)
    acts = p.decide(_snap(trained, d=60, lc=60, f=60, version=1))
    assert [type(a) for a in acts] == [ReturnToRollout, ReturnToRollout, PublishPolicy, DispatchBurst]


def test_static_split_keeps_fixed_roles():
    p = StaticSplitPolicy(StaticSplitConfig(training_cells=1))
    cells = _cells(CellState.ROLLOUT, CellState.TRAINING)
    acts = p.decide(_snap(cells))
    assert [(type(a), a.cell_id) for a in acts] == [(MoveToTraining, "cell-0"), (ReturnToRollout, "cell-1")]
    assert make_policy("static", training_cells=2).name == "static"


def test_first_burst_and_exhausted_source():
    p = WaterlevelPolicy()
    s = Snapshot(0.0, LedgerCounts(), _cells(CellState.ROLLOUT), Supply(), None, 0, 16)
    assert p.decide(s) == [DispatchBurst(1, 16, 0, "first burst: 16 executions at policy v0")]
    assert p.decide(dataclasses.replace(s, next_quota=0)) == []


def test_drained_burst_seals_once_then_waits_for_the_update():
    p = WaterlevelPolicy(WaterlevelConfig(0.5, 0.0, drain_grace_s=1.0))
    training = _cells(CellState.TRAINING, CellState.TRAINING, standalone=16)
    drained = dict(d=20, lc=20, f=20)
    snap = dataclasses.replace(
        _snap(training, **drained, ready=0), drained_since_s=4.0, supply=Supply(0, 8, 6, 1, None)
    )  # batch 1 holds 2 of 8 groups
    assert [type(a) for a in p.decide(snap)] == [SealBatch]
    # Sealed: the packer fills batch 2 (nothing assigned); the cells still train batch 1.
    after = dataclasses.replace(snap, supply=Supply(0, 8, 8, 2, None))
    assert not any(isinstance(a, DispatchBurst) for a in p.decide(after))
    # Nobody training and nothing trainable: go on with the next burst.
    idle = dataclasses.replace(after, cells=_cells(CellState.ROLLOUT, CellState.ROLLOUT, standalone=16))
    assert [type(a) for a in p.decide(idle)] == [DispatchBurst]
