"""The asynchronous policies as pure functions: the staleness gate and the cancel-early rule,
W_eta (the waterlevel of overlapping bursts) and its invariant, Gyre's decisions over random
snapshots (hypothesis), and the async static baselines."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policy import (
    AsyncStaticConfig,
    AsyncStaticLendPolicy,
    AsyncStaticPolicy,
    CellKind,
    CellState,
    CellView,
    DispatchBurst,
    ExecView,
    GyreConfig,
    GyrePolicy,
    Hold,
    LedgerCounts,
    Migrate,
    MoveToTraining,
    Pipeline,
    PlanMoves,
    PublishPolicy,
    ReturnToRollout,
    Snapshot,
    Supply,
    VersionCounts,
    capacity,
    is_prefix,
    make_policy,
    staleness,
    training_set,
)
from services.scheduler.policy.gyre import rate_target
from testkit.policy_rig import cells as _cells
from testkit.policy_rig import eta1_pipeline as _eta1_pipeline
from testkit.policy_rig import heavy_pipeline as _heavy_pipeline
from testkit.policy_rig import snap as _snap

# Staleness ---------------------------------------------------------------------------------


def test_gate_is_areal_plus_overprovision():
    assert staleness.gate(0, 1, 256, 64) == 2 * 256 + 64
    assert staleness.gate(3, 0, 10) == 40
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=10,
        extra_groups=2,
        groups_dispatched=25,
        groups_cancelled=3,
    )
    assert staleness.dispatch_room(p, 0) == 22 - 22
    assert staleness.dispatch_room(p, 1) == 32 - 22
    # eta = 0 and the batch full: a group stamped now could never be consumed; no dispatch
    # (else each cancellation would free room for a group cancelled next).
    p0 = Pipeline(max_staleness=0, group_size=4, batch_groups=10, batch_assigned=10, groups_dispatched=5)
    assert staleness.dispatch_room(p0, 0) == 0
    assert staleness.dispatch_room(Pipeline(**{**p0.__dict__, "batch_assigned": 9}), 0) == 5


@given(u=st.integers(0, 20), v=st.integers(0, 25), eta=st.integers(0, 4), full=st.booleans())
def test_cancel_early_exactly_when_no_batch_within_eta_can_take_it(u, v, eta, full):
    """A group stamped u is unconsumable iff no batch k >= v (k > v when batch v is full)
    has k - u <= eta."""
    first_open_batch = v + 1 if full else v
    can = any(staleness.consumable(u, k, eta) for k in range(first_open_batch, first_open_batch + eta + 2))
    assert staleness.unconsumable(u, v, full, eta) == (not can and u <= first_open_batch)
    assert (u < staleness.oldest_usable(v, full, eta)) == staleness.unconsumable(u, v, full, eta)


# W_eta -------------------------------------------------------------------------------------

VERSION = st.builds(
    lambda v, g, d, lf, fin, ready, cons, canc: VersionCounts(
        v, g, d, min(d, lf), min(min(d, lf), fin), ready, cons, canc
    ),
    st.integers(0, 6),
    st.integers(0, 40),
    st.integers(0, 160),
    st.integers(0, 160),
    st.integers(0, 160),
    st.integers(0, 10),
    st.integers(0, 10),
    st.integers(0, 10),
)


@st.composite
def pipelines(draw):
    versions = draw(st.lists(VERSION, max_size=5, unique_by=lambda vc: vc.version))
    return Pipeline(
        max_staleness=draw(st.integers(0, 3)),
        group_size=draw(st.integers(1, 8)),
        batch_groups=draw(st.integers(1, 40)),
        extra_groups=draw(st.integers(0, 10)),
        ready_groups=draw(st.integers(0, 60)),
        batch_assigned=draw(st.integers(0, 40)),
        versions=tuple(sorted(versions, key=lambda vc: vc.version)),
    )


@given(p=pipelines(), v=st.integers(0, 8))
def test_w_eta_is_bounded_by_usable_and_needed_work(p, v):
    w = staleness.waterlevel(p, v)
    seed_w = sum(vc.open for vc in p.versions)
    assert 0 <= w <= staleness.usable_open(p.versions, v, p.max_staleness) <= seed_w
    assert w <= staleness.groups_needed(p) * p.group_size
    # eta = 0, nothing ready, nothing assigned, one version: the seed's W (capped by one batch).
    if p.max_staleness == 0 and p.ready_groups == 0 and p.batch_assigned == 0 and len(p.versions) == 1:
        vc = p.versions[0]
        if vc.version == v:
            assert w == min(vc.open, p.batch_groups * p.group_size)


@given(p=pipelines(), v=st.integers(0, 8), which=st.integers(0, 4))
def test_w_eta_never_rises_when_work_closes_or_becomes_ready(p, v, which):
    if not p.versions:
        return
    vc = p.versions[which % len(p.versions)]
    if vc.finished >= vc.launched:
        return
    closed = VersionCounts(
        vc.version,
        vc.groups,
        vc.dispatched,
        vc.launched,
        vc.finished + 1,
        vc.ready,
        vc.consumed,
        vc.cancelled,
    )
    after = Pipeline(**{**p.__dict__, "versions": tuple(closed if x is vc else x for x in p.versions)})
    assert staleness.waterlevel(after, v) <= staleness.waterlevel(p, v)
    readied = Pipeline(**{**after.__dict__, "ready_groups": after.ready_groups + 1})
    assert staleness.waterlevel(readied, v) <= staleness.waterlevel(after, v)


# Gyre over random snapshots -----------------------------------------------------------------

STATES = [CellState.ROLLOUT] * 4 + [CellState.TRAINING] * 3 + [CellState.DRAINING, CellState.RETURNING]


@st.composite
def gyre_snapshots(draw):
    n = draw(st.integers(1, 12))
    slots = draw(st.integers(1, 16))
    k = draw(st.integers(0, n))  # training prefix
    cells = []
    for i in range(n):
        state = (
            draw(st.sampled_from(STATES))
            if i < k
            else draw(
                st.sampled_from(
                    [CellState.ROLLOUT] * 5 + [CellState.RETURNING, CellState.DRAINING, CellState.FAILED]
                )
            )
        )
        if i < k and state is CellState.RETURNING:
            state = CellState.TRAINING
        load = draw(st.integers(0, slots)) if state is CellState.ROLLOUT else 0
        cells.append(CellView(f"c{i}", CellKind.ELASTIC, i, state, slots, load))
    if draw(st.booleans()):
        cells.append(
            CellView("s0", CellKind.STANDALONE, -1, CellState.ROLLOUT, slots, draw(st.integers(0, slots)))
        )
    p = draw(pipelines())
    v = draw(st.integers(0, 8))
    p = Pipeline(
        **{
            **p.__dict__,
            "published_version": draw(st.integers(0, v)),
            "groups_dispatched": draw(st.integers(0, 400)),
            "train_rate_per_cell": draw(st.sampled_from([0.0, 1000.0, 7600.0])),
            "ready_rate": draw(st.floats(0, 5)),
            "tokens_per_group": draw(st.floats(0, 1e5)),
            "backlog_tokens": draw(st.floats(0, 1e6)),
            "optimizing": draw(st.booleans()),
            "planned": tuple(
                draw(st.lists(st.sampled_from([c.cell_id for c in cells]), max_size=3, unique=True))
            ),
        }
    )
    rollout = [c for c in cells if c.state is CellState.ROLLOUT and c.load > 0]
    execs = (
        tuple(
            ExecView(
                f"x{j}",
                draw(st.sampled_from(rollout)).cell_id,
                v,
                draw(st.floats(0, 500)),
                draw(st.integers(0, 1)),
            )
            for j in range(draw(st.integers(0, 6)))
        )
        if rollout
        else ()
    )
    needs = max(0, p.batch_groups - p.batch_assigned)
    supply = Supply(min(p.ready_groups, needs), p.batch_groups, needs, v + 1)
    d = sum(vc.dispatched for vc in p.versions)
    f = sum(vc.finished for vc in p.versions)
    lf = sum(vc.launched for vc in p.versions)
    snap = Snapshot(
        draw(st.floats(0, 1e5)),
        LedgerCounts(d, lf, f),
        tuple(cells),
        supply,
        None,
        v,
        draw(st.sampled_from([0, 1 << 30])),
        None,
        p,
        execs,
    )
    return snap


CONFIGS = st.builds(
    GyreConfig,
    rates=st.booleans(),
    keep=st.booleans(),
    plan=st.booleans(),
    migrate=st.booleans(),
    hysteresis=st.sampled_from([0.0, 0.2, 1.0]),
    saturated_share=st.sampled_from([0.6, 1.0]),
    breathe=st.booleans(),
    parallel_moves=st.sampled_from([0.0, 1 / 32, 0.25, 1.0]),
)


@settings(max_examples=400, deadline=None)
@given(s=gyre_snapshots(), cfg=CONFIGS)
def test_gyre_invariants_on_random_snapshots(s, cfg):
    p = s.pipeline
    acts = GyrePolicy(cfg).decide(s)
    moves = [a for a in acts if isinstance(a, MoveToTraining)]
    w = staleness.waterlevel(p, s.policy_version)
    by_id = {c.cell_id: c for c in s.cells}
    elastic = s.elastic()
    prefix_ok = is_prefix(s.cells)
    policy = GyrePolicy(cfg)
    draining = [x for x in elastic if x.state is CellState.DRAINING]
    assert len(moves) <= max(0, policy.max_moves(len(elastic)) - len(draining))
    assert len({m.cell_id for m in moves}) == len(moves)
    plans = [a.cell_ids for a in acts if isinstance(a, PlanMoves)]
    planned = plans[-1] if plans else p.planned
    # Invariant: committed usable work stays covered by what the moves leave in rollout,
    # except by a breathing core coming back to a batch's worth of ready groups (the trainer
    # is then the next step).
    core_back = any(
        cfg.breathe and by_id[m.cell_id].is_core and p.ready_groups >= policy.breathe_in_groups(p)
        for m in moves
    )
    assert capacity(s.cells) - sum(by_id[m.cell_id].slots for m in moves) >= w or core_back or not moves
    for m in moves:
        assert by_id[m.cell_id].state is CellState.ROLLOUT
    # The prefix grows by the lowest-index cells not training.
    if prefix_ok and moves:
        moved = {m.cell_id for m in moves}
        after = tuple(
            CellView(
                x.cell_id, x.kind, x.index, CellState.DRAINING if x.cell_id in moved else x.state, x.slots
            )
            for x in s.cells
        )
        assert is_prefix(after)
    for a in acts:
        if (
            isinstance(a, ReturnToRollout)
            and prefix_ok
            and training_set(s.cells)
            and training_set(s.cells)[0].is_core
        ):
            # The core leaves only to breathe: nothing to train, and W_eta waits for slots.
            assert not by_id[a.cell_id].is_core or (
                cfg.breathe
                and GyrePolicy(cfg).core_may_leave(
                    s, [c for c in elastic if c.state is not CellState.FAILED], w
                )
            )
        if isinstance(a, DispatchBurst):
            assert a.quota % p.group_size == 0
            assert a.quota // p.group_size <= staleness.dispatch_room(p, s.policy_version)
            assert a.policy_version == s.policy_version
        if isinstance(a, PublishPolicy):
            assert a.version == s.policy_version > p.published_version
        if isinstance(a, Migrate):
            dst = by_id[a.cell_id]
            src = next(e for e in s.executions if e.execution_id == a.execution_id).cell_id
            assert dst.state is CellState.ROLLOUT and a.cell_id not in planned and a.cell_id != src
            assert dst.load < by_id[src].load
        if isinstance(a, PlanMoves):
            assert all(
                by_id[c].state is CellState.ROLLOUT
                or by_id[c].state is CellState.FAILED
                or by_id[c].state is CellState.STARTING
                for c in a.cell_ids
            )


@pytest.mark.parametrize("policy", ["gyre", "async-static"])
def test_groups_the_packer_filtered_leave_the_gate_and_are_replaced(policy):
    """The demo's stall: the policy learned, burst 12's 4 groups all earned reward 1 and the
    packer dropped them for zero variance. They stayed in the gate (68 dispatched, 8
    cancelled > gate 57 at v11), so nothing was dispatched again: no batch 12, waterlevel 0
    until the time budget ran out. Filtered groups leave the gate like cancelled ones."""
    p = Pipeline(
        max_staleness=2,
        group_size=4,
        batch_groups=4,
        extra_groups=1,
        published_version=11,
        groups_dispatched=68,
        groups_cancelled=8,
    )
    cells = _cells([CellState.TRAINING, CellState.ROLLOUT, CellState.ROLLOUT], slots=8)
    stalled = make_policy(policy).decide(_snap(cells, p, v=11, quota=1 << 30))
    assert not [a for a in stalled if isinstance(a, DispatchBurst)]  # the gate is full ...
    filtered = Pipeline(**{**p.__dict__, "groups_filtered": 12})
    assert staleness.dispatch_room(filtered, 11) == 57 - (68 - 8 - 12)
    (dispatch,) = [
        a
        for a in make_policy(policy).decide(_snap(cells, filtered, v=11, quota=1 << 30))
        if isinstance(a, DispatchBurst)
    ]
    assert dispatch.quota == 9 * 4  # ... until the filtered groups leave it


def test_rate_target_keeps_up_with_arrivals_and_drains_the_queue_within_the_horizon():
    # Arrivals 0.1 groups/s x 5e4 tokens = 5e3 tok/s; queue 2.5e5 backlog + 5 x 5e4 ready =
    # 5e5 tokens over 100 s = 5e3 tok/s; at 1000 tok/s per cell: 10 cells.
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=20,
        batch_assigned=5,
        ready_groups=5,
        backlog_tokens=2.5e5,
        train_rate_per_cell=1000.0,
        ready_rate=0.1,
        tokens_per_group=5e4,
    )
    t, why = rate_target(p, horizon_s=100.0)
    assert t == 10, why
    # The next batch's supply already there: a longer queue, more cells.
    more = Pipeline(**{**p.__dict__, "ready_groups": 25})
    assert rate_target(more, 100.0)[0] > t
    # A longer horizon: fewer cells (no surge to chase the end of a batch).
    assert rate_target(p, 1000.0)[0] < t
    # Nothing to train and nothing arriving: the core alone.
    idle = Pipeline(**{**p.__dict__, "ready_groups": 0, "ready_rate": 0.0, "backlog_tokens": 0.0})
    assert rate_target(idle, 100.0)[0] == 1


def test_rate_target_does_not_surge_when_a_dispatch_wave_lands_at_the_end_of_a_batch():
    # B64 trace, seed 1: one group missing, a wave of 170 ready groups (the next batch's) of
    # 6e4 tokens, 1 group/s arriving, 7,590 tok/s per cell. The first rule sized the prefix
    # to train all of it within 30 s (57 cells of 64), starving rollout of the slow groups
    # the next batch needs; keeping up with arrivals and draining the queue over 300 s
    # needs ceil((6e4 + 170 x 6e4 / 300) / 7590) = 13.
    p = Pipeline(
        max_staleness=1,
        group_size=16,
        batch_groups=256,
        batch_assigned=255,
        ready_groups=170,
        backlog_tokens=6e4,
        train_rate_per_cell=7590.0,
        ready_rate=1.0,
        tokens_per_group=6e4,
    )
    t, why = rate_target(p, horizon_s=300.0)
    assert t == 13, why


def test_gyre_grows_the_prefix_from_rates_and_keeps_rollout_covering_w_eta():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=20,
        batch_assigned=20,
        ready_groups=40,
        train_rate_per_cell=1000.0,
        ready_rate=1.0,
        tokens_per_group=5e4,
        versions=(VersionCounts(1, groups=30, dispatched=120, launched=100, finished=60),),
        published_version=1,
    )
    s = _snap(_cells([T, R, R, R, R, R]), p)
    acts = GyrePolicy().decide(s)
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1"]
    # W_eta = min(60 open, needed 0 groups) = 0 here; with work needed, capacity must cover it.
    p2 = Pipeline(
        **{
            **p.__dict__,
            "ready_groups": 0,
            "batch_assigned": 0,
            "backlog_tokens": 1e7,
            "versions": (VersionCounts(1, groups=30, dispatched=120, launched=100, finished=90),),
        }
    )
    w = staleness.waterlevel(p2, 1)
    assert w == 30
    s2 = _snap(_cells([T, R, R, R, R, R]), p2)
    moves = [a for a in GyrePolicy().decide(s2) if isinstance(a, MoveToTraining)]
    assert moves and capacity(s2.cells) - 10 >= w
    s3 = _snap(_cells([T, T, T, R, R, R]), p2)  # 20 slots after the move < 30: hold
    assert not [a for a in GyrePolicy().decide(s3) if isinstance(a, MoveToTraining)]


def test_gyre_puts_several_moves_in_flight_at_scale():
    """B1024's start-up: with one move in flight the training prefix grew a cell per switch
    (a one-update run at 256 cells: 1 -> 102 cells in 280 s, the T = 128 split done in 287 s).
    ``parallel_moves`` of the elastic cells move at once, the next ones by index, each
    leaving rollout covering W_eta and its executions somewhere to go."""
    R, T, D = CellState.ROLLOUT, CellState.TRAINING, CellState.DRAINING
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=400,
        batch_assigned=400,
        ready_groups=200,
        train_rate_per_cell=1000.0,
        ready_rate=10.0,
        tokens_per_group=5e4,
        versions=(VersionCounts(1, groups=100, dispatched=400, launched=400, finished=300),),
        published_version=1,
    )
    cells = _cells([T] + [R] * 63)
    cfg = GyreConfig(parallel_moves=1 / 16)
    moved = [a.cell_id for a in GyrePolicy(cfg).decide(_snap(cells, p)) if isinstance(a, MoveToTraining)]
    assert moved == ["c1", "c2", "c3", "c4"]
    # One at a time with parallel_moves 0 (the old rule) ...
    one = GyreConfig(parallel_moves=0.0)
    assert [a.cell_id for a in GyrePolicy(one).decide(_snap(cells, p)) if isinstance(a, MoveToTraining)] == [
        "c1"
    ]
    # ... and the moves in flight count: two draining leave room for two more.
    draining = _cells([T, D, D] + [R] * 61)
    acts = GyrePolicy(cfg).decide(_snap(draining, p))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c3", "c4"]
    full = _cells([T, D, D, D, D] + [R] * 59)
    acts = GyrePolicy(cfg).decide(_snap(full, p))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    assert any(isinstance(a, Hold) and "DRAINING" in a.reason for a in acts)
    # Together the moves leave rollout covering W_eta: 100 open executions (10 cells of 10
    # slots) cap the prefix at 54, so from 50 only 4 go, however many may be in flight.
    w100 = Pipeline(**{**p.__dict__, "ready_groups": 0, "backlog_tokens": 3e6, "ready_rate": 0.4})
    assert staleness.waterlevel(w100, 1) == 100
    tight = _cells([T] * 50 + [R] * 14)
    acts = GyrePolicy(GyreConfig(parallel_moves=1.0)).decide(_snap(tight, w100))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c50", "c51", "c52", "c53"]
    # The free slots the earlier moves of a decision leave count for the later ones: three
    # cells of 8 executions and two empty ones have 26 free slots; c1's executions leave 16,
    # c2's leave 6, and c3's 8 would find 4 free slots elsewhere, so only two go.
    few = Pipeline(
        **{**p.__dict__, "versions": (VersionCounts(1, groups=5, dispatched=20, launched=20, finished=2),)}
    )
    busy = _cells([T] + [R] * 5, loads=[0, 8, 8, 8, 0, 0])
    acts = GyrePolicy(GyreConfig(parallel_moves=1.0)).decide(_snap(busy, few))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1", "c2"]
    assert any(isinstance(a, Hold) and a.cell_id == "c3" and "free slots" in a.reason for a in acts)


def test_gyre_returns_satellites_only_beyond_the_hysteresis_band():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=20,
        batch_assigned=0,
        ready_groups=0,
        train_rate_per_cell=1000.0,
        ready_rate=0.0,
        tokens_per_group=5e4,
        published_version=1,
    )
    # (Breathing off: with it on, rollout has no work here and would not use a returned cell.)
    band = GyrePolicy(GyreConfig(breathe=False))
    # Target 1 (nothing to train): 3 training cells > 1 + h (h = 1) -> the last satellite returns.
    acts = band.decide(_snap(_cells([T, T, T, R]), p))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c2"]
    # 2 training cells = 1 + h: kept (no flapping at the edge).
    acts = band.decide(_snap(_cells([T, T, R, R]), p))
    assert not [a for a in acts if isinstance(a, ReturnToRollout)]
    # Without hysteresis it returns at once.
    acts = GyrePolicy(GyreConfig(keep=False, breathe=False)).decide(_snap(_cells([T, T, R, R]), p))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c1"]


def test_gyre_does_not_return_cells_when_w_eta_jumps_past_the_capacity():
    # eta = 4: batches v .. v + 4 still need 100 groups x 4 = 400 executions, 100 of them open:
    # W_eta = 100 > the 20 slots of the two rollout cells, so no cell may move to training.
    # The rate target is 5 (0.1 groups/s x 5e4 tokens at 1000 tok/s per cell). The cap stops
    # moves; it must not send the 4 training cells back (a cap that forced returns did, at
    # every publication, and the cells moved back one by one: A64, eta = 4).
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = Pipeline(
        max_staleness=4,
        group_size=4,
        batch_groups=20,
        batch_assigned=0,
        ready_groups=0,
        train_rate_per_cell=1000.0,
        ready_rate=0.1,
        tokens_per_group=5e4,
        versions=(VersionCounts(1, groups=25, dispatched=100, launched=100, finished=0),),
        published_version=1,
    )
    s = _snap(_cells([T, T, T, T, R, R]), p)
    assert staleness.waterlevel(p, 1) == 100 > capacity(s.cells)
    acts = GyrePolicy().decide(s)
    assert not [a for a in acts if isinstance(a, (ReturnToRollout, MoveToTraining))], acts
    # When the rate target itself falls (nothing arrives any more), satellites do return.
    idle = Pipeline(**{**p.__dict__, "ready_rate": 0.0})
    acts = GyrePolicy().decide(_snap(_cells([T, T, T, T, R, R]), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c3"]


def _demo_pipeline(open_executions: int, **kw: Any) -> Pipeline:
    """The demo's shape: eta = 1, batches of 4 groups of 4, one cell trains faster than
    groups arrive (rate target 1), ``open_executions`` dispatched and running at v1."""
    return _eta1_pipeline(open_executions, batch_groups=4, tokens_per_group=1000.0, **kw)


def test_breathing_lends_the_cells_w_eta_leaves_idle_to_the_streaming_batch():
    # 2 groups ready, 1 assigned: batches v1..v2 still need 8 - 3 = 5 groups, but only 8
    # executions are open: W_eta = 8 needs one rollout cell of 10 slots, so two of the three
    # rollout cells are spare. The rate target is 1; breathing lends them one move at a time.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    # Claimable: a 14,000-token backlog and 2,000 ready, 8 s of training for two cells at
    # 1,000 tokens/s each and 5.3 s for three (>= lend_min_s 5 s).
    p = _demo_pipeline(8, ready_groups=2, ready_tokens=2000.0, batch_assigned=1, backlog_tokens=14000.0)
    assert staleness.waterlevel(p, 1) == 8
    acts = GyrePolicy().decide(_snap(_cells([T, R, R, R]), p))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1"]
    acts = GyrePolicy().decide(_snap(_cells([T, T, R, R]), p))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c2"]
    # A lent cell must be empty first: draining it would reroute work the rate rule did not
    # ask to move (PlanMoves keeps new work off it meanwhile).
    acts = GyrePolicy().decide(_snap(_cells([T, T, R, R], loads=[0, 0, 3, 0]), p))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    assert "c2" in next(a for a in acts if isinstance(a, PlanMoves)).cell_ids or p.planned
    acts = GyrePolicy().decide(_snap(_cells([T, T, T, R]), p))  # the last cell covers W_eta
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    # 3,000 claimable tokens are 1.5 s of training for two cells: not worth a switch each way
    # (the demo's lent cells were back within a second).
    light = _demo_pipeline(8, ready_groups=2, ready_tokens=2000.0, batch_assigned=1, backlog_tokens=1000.0)
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, R, R, R]), light)) if isinstance(a, MoveToTraining)
    ]
    acts = GyrePolicy(GyreConfig(lend_min_s=0.0)).decide(_snap(_cells([T, R, R, R]), light))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1"]
    # Without breathing the rate target (1) keeps the satellites in rollout.
    acts = GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T, R, R, R]), p))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    # When the next batch's work arrives (W_eta 32 > the 20 slots left), the lent cells go
    # back at once (no hysteresis for lent cells), the last first.
    busy = _demo_pipeline(32, ready_groups=1)
    acts = GyrePolicy().decide(_snap(_cells([T, T, T, R]), busy))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c2"]


def test_gyre_never_returns_a_cell_below_one_still_draining():
    # Seen in the demo: cell-2 started DRAINING to training, the target fell in the next
    # decision, and the hysteresis return picked cell-1 (the last TRAINING satellite): the
    # prefix broke and the repair sent cell-2 back too. The return waits for the move.
    R, T, D = CellState.ROLLOUT, CellState.TRAINING, CellState.DRAINING
    idle = _demo_pipeline(8)  # nothing to train: target 1, band 1
    for cfg in (GyreConfig(), GyreConfig(breathe=False), GyreConfig(keep=False)):
        acts = GyrePolicy(cfg).decide(_snap(_cells([T, T, D, R]), idle))
        assert not [a for a in acts if isinstance(a, ReturnToRollout)], (cfg, acts)
    acts = GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T, T, T, R]), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c2"]


def test_breathing_keeps_a_lent_cell_while_rollout_could_not_use_it():
    # Nothing to claim for a moment (the ready group was just claimed), but W_eta 8 fits the
    # 20 slots rollout has: the lent cell stays for the next batch instead of flapping.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    lull = _demo_pipeline(8)
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, T, T, R, R]), lull)) if isinstance(a, ReturnToRollout)
    ]
    # Without breathing the hysteresis band returns it.
    acts = GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T, T, T, R, R]), lull))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c2"]


def test_breathing_lends_nothing_while_only_the_optimizer_step_is_left():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    stepping = _demo_pipeline(8, batch_assigned=4, optimizing=True)
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, R, R, R]), stepping)) if isinstance(a, MoveToTraining)
    ]


def test_breathing_core_rolls_out_while_there_is_nothing_to_train_and_comes_back_at_half_a_batch():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    # Nothing ready or assigned, 40 executions open: W_eta 32 > the 24 slots without the
    # core (cells of 8): 8 executions wait, a whole core's worth.
    idle = _demo_pipeline(40)
    acts = GyrePolicy().decide(_snap(_cells([T, R, R, R], slots=8), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c0"]
    # Cells of 10: only 2 of the 32 wait (< breathe_out 0.5 x 10): not worth a switch each
    # way (the demo's core left for 2 and came back a second later); breathe_out 0 goes.
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, R, R, R]), idle)) if isinstance(a, ReturnToRollout)
    ]
    acts = GyrePolicy(GyreConfig(breathe_out=0.0)).decide(_snap(_cells([T, R, R, R]), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c0"]
    # Not mid-batch, not while one ready group waits (below half a batch it stays out, but a
    # training core does not leave it), not without breathing.
    for p in (
        _demo_pipeline(40, batch_assigned=1, backlog_tokens=100.0),
        _demo_pipeline(40, optimizing=True),
        _demo_pipeline(40, ready_groups=2),
    ):
        assert not [
            a
            for a in GyrePolicy().decide(_snap(_cells([T, R, R, R], slots=8), p))
            if isinstance(a, ReturnToRollout)
        ]
    assert not [
        a
        for a in GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T, R, R, R], slots=8), idle))
        if isinstance(a, ReturnToRollout)
    ]
    # Rollout could not use its slots (W_eta 20 fits the other 30): the core stays.
    light = _demo_pipeline(20)
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, R, R, R]), light)) if isinstance(a, ReturnToRollout)
    ]
    # Out of training (7-slot cells): one ready group keeps it out (W_eta 28 > the 21 slots
    # it would leave); half a batch brings it back although 21 < W_eta 24 (the trainer is the
    # next step: the gate waits for its version).
    one = _demo_pipeline(40, ready_groups=1)
    acts = GyrePolicy().decide(_snap(_cells([R, R, R, R], slots=7), one))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    half = _demo_pipeline(40, ready_groups=2)
    assert staleness.waterlevel(half, 1) == 24
    acts = GyrePolicy().decide(_snap(_cells([R, R, R, R], slots=7), half))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c0"]


def _eta4_pipeline(open_executions: int) -> Pipeline:
    """eta = 4, batches of 20 groups of 4, a rate target of 10 cells (0.2 groups/s x 5e4
    tokens at 1000 tok/s per cell), ``open_executions`` dispatched and running."""
    return Pipeline(
        max_staleness=4,
        group_size=4,
        batch_groups=20,
        train_rate_per_cell=1000.0,
        ready_rate=0.2,
        tokens_per_group=5e4,
        versions=(
            VersionCounts(
                1, groups=open_executions // 4, dispatched=open_executions, launched=open_executions
            ),
        ),
        published_version=1,
    )


def test_gyre_sizes_the_prefix_to_a_share_of_the_rate_target_while_rollout_is_saturated():
    # 20 cells of 10 slots; the rate target is 10 cells (0.2 groups/s x 5e4 tokens at
    # 1000 tok/s per cell), which would leave 10 x 10 = 100 slots to rollout.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    pipeline = _eta4_pipeline

    cells = _cells([T, T] + [R] * 18)
    elastic = list(cells)
    # W_eta 80 fits the 100 slots the target leaves: the rate target as it is, any share.
    s = _snap(cells, pipeline(80))
    for share in (0.6, 1.0):
        assert GyrePolicy(GyreConfig(saturated_share=share)).target(s, elastic, 80)[:2] == (10, 10)
    # W_eta 120 does not: rollout is the bottleneck (executions wait for a slot), so the
    # prefix is sized to 0.6 of the target (6 cells, under the W_eta cap of 20 - 12 = 8).
    s = _snap(cells, pipeline(120))
    assert staleness.waterlevel(s.pipeline, 1) == 120
    target, keep, band, why = GyrePolicy(GyreConfig(saturated_share=0.6)).target(s, elastic, 120)
    assert (target, keep, band) == (6, 6, 10) and "saturated" in why
    # Share 1 turns it off: the cap (8) holds the moves, returns measure against 10.
    assert GyrePolicy(GyreConfig(saturated_share=1.0)).target(s, elastic, 120)[:2] == (8, 10)
    # The default is the share.
    assert GyreConfig().saturated_share == 0.6
    moves = [a for a in GyrePolicy().decide(s) if isinstance(a, MoveToTraining)]
    assert [a.cell_id for a in moves] == ["c2"]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="saturated_share"):
            GyreConfig(saturated_share=bad)


def test_gyre_measures_the_hysteresis_band_against_the_rate_target_while_saturated():
    """While rollout is saturated the prefix is sized to a share of the rate target, but the
    band a satellite must exceed before it returns stays a fraction of the rate target
    itself: measured against the share (6 cells here) it was narrower, and satellites went
    back and forth as saturation came and went (B64, eta = 4: 2.1% of GPU-seconds in role
    switches and reroutes, past the 2% limit; 1.7-1.9% with this band, 1,765 s median
    against 1,772 s)."""
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = _eta4_pipeline(120)  # rate target 10 cells; W_eta 120: saturated

    def returns(training: int, hysteresis: float) -> list[str]:
        cells = _cells([T] * training + [R] * (20 - training))
        acts = GyrePolicy(GyreConfig(saturated_share=0.6, hysteresis=hysteresis)).decide(_snap(cells, p))
        return [a.cell_id for a in acts if isinstance(a, ReturnToRollout)]

    # keep 6 (0.6 x 10); band h = ceil(0.5 x 10) = 5: a satellite returns only past 11.
    assert returns(10, 0.5) == [] and returns(11, 0.5) == []
    assert returns(12, 0.5) == ["c11"]
    # Unsaturated (share 1) the band is the same fraction of the same target.
    cells = _cells([T] * 12 + [R] * 8)
    assert GyrePolicy(GyreConfig(saturated_share=1.0)).target(_snap(cells, p), list(cells), 0)[1:3] == (
        10,
        10,
    )


def test_gyre_plans_next_cells_and_migrates_the_tail_off_crowded_engines():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = Pipeline(
        max_staleness=1, group_size=4, batch_groups=20, published_version=1, train_rate_per_cell=1000.0
    )
    execs = (ExecView("7", "c3", 0, 300.0), ExecView("8", "c3", 0, 10.0, moves=1))
    s = _snap(_cells([T, R, R, R], loads=[0, 9, 1, 9]), p, execs=execs)
    acts = GyrePolicy().decide(s)
    plan = [a for a in acts if isinstance(a, PlanMoves)]
    assert plan and plan[0].cell_ids == ("c1", "c2")
    # c2 is planned, so the tail goes nowhere... unless a non-planned light engine exists.
    assert not [a for a in acts if isinstance(a, Migrate)]
    p2 = Pipeline(**{**p.__dict__, "planned": ("c1",)})
    s2 = _snap(_cells([T, R, R, R], loads=[0, 9, 1, 9]), p2, execs=execs)
    migs = [a for a in GyrePolicy(GyreConfig(plan_ahead=1)).decide(s2) if isinstance(a, Migrate)]
    assert [(m.execution_id, m.cell_id) for m in migs] == [("7", "c2")]  # once per execution


# Async static baselines ---------------------------------------------------------------------


def test_async_static_keeps_its_split_and_dispatches_to_the_gate():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = Pipeline(
        max_staleness=1,
        group_size=4,
        batch_groups=10,
        extra_groups=2,
        groups_dispatched=15,
        published_version=0,
    )
    s = _snap(_cells([T, R, T, R]), p, v=1, quota=1 << 30)
    acts = AsyncStaticPolicy(AsyncStaticConfig(training_cells=2)).decide(s)
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1"]
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c2"]
    pub = [a for a in acts if isinstance(a, PublishPolicy)]
    assert pub and pub[0].version == 1
    disp = [a for a in acts if isinstance(a, DispatchBurst)]
    assert disp and disp[0].quota == (3 * 10 + 2 - 15) * 4 and disp[0].policy_version == 1


def test_async_static_lend_lends_idle_trainers_and_reclaims_them():
    R, T = CellState.ROLLOUT, CellState.TRAINING
    pol = AsyncStaticLendPolicy(AsyncStaticConfig(training_cells=3, reclaim_groups=2))
    idle = Pipeline(max_staleness=1, group_size=4, batch_groups=10, groups_dispatched=30)
    acts = pol.decide(_snap(_cells([T, T, T, R]), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c1", "c2"]
    # Lent, some backlog but little ready supply: keep lending.
    busy = Pipeline(**{**idle.__dict__, "backlog_tokens": 10.0, "ready_groups": 1})
    assert not [a for a in pol.decide(_snap(_cells([T, R, R, R]), busy)) if isinstance(a, MoveToTraining)]
    # Enough ready supply: reclaim.
    ready = Pipeline(**{**busy.__dict__, "ready_groups": 2})
    acts = pol.decide(_snap(_cells([T, R, R, R]), ready))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1", "c2"]


def test_make_policy_names():
    assert make_policy("gyre").name == "gyre"
    assert make_policy("waterlevel").name == "waterlevel"
    assert make_policy("waterlevel-sync").name == "waterlevel-sync"
    assert make_policy("async-static", training_cells=3).name == "async-static"
    assert make_policy("async-static-lend", training_cells=3).name == "async-static-lend"


def test_placement_spreads_and_keeps_planned_cells_last():
    from gyre.etcd.values import CellRecord
    from services.scheduler.placement import CellTable, placement_order

    table = CellTable()
    table.records = {f"c{i}": CellRecord(f"c{i}", CellKind.ELASTIC, i, 4, f"t{i}") for i in range(4)}
    table.states = {cid: CellState.ROLLOUT for cid in table.records}
    counts = {"c0": 0, "c1": 3, "c2": 1, "c3": 2}

    def order(**kw: Any) -> list[str]:
        return [r.cell_id for r, _ in placement_order(table, counts, **kw)]

    assert order() == ["c3", "c2", "c1", "c0"]  # packing: descending index
    assert order(spread=True) == ["c0", "c2", "c3", "c1"]  # least loaded first
    assert order(spread=True, avoid=["c0"]) == ["c2", "c3", "c1", "c0"]  # planned cells last
    assert order(avoid=["c3", "c2"]) == ["c1", "c0", "c3", "c2"]


def test_breathing_core_rolls_out_at_the_publication_whose_dispatch_fills_rollout():
    # Seen in the demo: the core published v2 and joined the next batch at once; the dispatch
    # of that same decision raised W_eta past what rollout holds without the core only in
    # the next decision, which then returned the core, and the core waited ~30 s in RETURNING
    # (useless to both sides) for the batch it had just joined. The decision that dispatches
    # counts its own dispatch: W_eta after it decides whether the core rolls out.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    p = _demo_pipeline(
        8,
        versions=(VersionCounts(1, groups=10, dispatched=40, launched=40, finished=32, consumed=4),),
        groups_consumed=4,
    )
    s = _snap(_cells([T, R, R, R], slots=8), p, v=2, quota=1 << 30)
    before = staleness.waterlevel(p, 2)
    acts = GyrePolicy().decide(s)
    quota = sum(a.quota for a in acts if isinstance(a, DispatchBurst))
    assert before <= 24 and staleness.waterlevel(p, 2, dispatching=quota) >= 24 + 4, (before, quota)
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c0"], acts


def test_breathing_lends_nothing_once_every_group_the_window_needs_is_in():
    # W_eta 0: batches v1..v2 have all their groups ready or assigned; the batch steps in
    # moments and the next publication's dispatch would send a lent cell straight back.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    full = _demo_pipeline(8, ready_groups=5, ready_tokens=5000.0, batch_assigned=3, backlog_tokens=9000.0)
    assert staleness.waterlevel(full, 1) == 0
    assert not [
        a for a in GyrePolicy().decide(_snap(_cells([T, R, R, R]), full)) if isinstance(a, MoveToTraining)
    ]
    # One group short, its members still running: the spare cells are lent.
    short = _demo_pipeline(8, ready_groups=4, ready_tokens=4000.0, batch_assigned=3, backlog_tokens=9000.0)
    assert staleness.waterlevel(short, 1) == 4
    acts = GyrePolicy().decide(_snap(_cells([T, R, R, R]), short))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c1"]


def test_gyre_moves_no_cell_whose_executions_have_nowhere_to_go():
    # Seen in the demo: the breathing core came back to training with 5 executions on it and
    # the other rollout cells full; its drain found no destination, the move was called off,
    # and the next decisions moved it again: 4 moves called off in 2 s. It waits instead.
    R = CellState.ROLLOUT
    half = _demo_pipeline(24, ready_groups=2)
    full = _cells([R, R, R, R], slots=8, loads=[5, 8, 8, 6])
    acts = GyrePolicy().decide(_snap(full, half))
    assert not [a for a in acts if isinstance(a, MoveToTraining)], acts
    assert any(isinstance(a, Hold) and a.cell_id == "c0" and "free slots" in a.reason for a in acts)
    room = _cells([R, R, R, R], slots=8, loads=[5, 8, 8, 3])
    acts = GyrePolicy().decide(_snap(room, half))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c0"]


def test_gyre_lends_empty_rollout_cells_to_a_heavy_trainer_and_takes_them_back_when_idle():
    # B64 (seed 1): while the batch's last executions decode, W_eta leaves most rollout cells
    # empty while ready groups pile up; the rate rule (horizon 300 s) kept 5-15 of them idle.
    # Lending them at any rate target (empty ones, worth lend_min_s): B64 2,485 -> 2,349 s,
    # B64 at eta 0 3,504 -> 3,287 s. Here: rate target 5, W_eta 12 needs 2 of 10 cells.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    busy = _heavy_pipeline(12, ready_groups=10, ready_tokens=5e5, batch_assigned=5, backlog_tokens=1e5)
    acts = GyrePolicy().decide(_snap(_cells([T] * 5 + [R] * 5), busy))
    assert [a.cell_id for a in acts if isinstance(a, MoveToTraining)] == ["c5"], acts
    # Priced by the measured switch round trip when it is longer than lend_min_s: the 6e5
    # claimable tokens are 100 s of training for a sixth cell, not worth a 120 s round trip.
    slow = Pipeline(**{**busy.__dict__, "switch_s": 120.0})
    assert not [
        a
        for a in GyrePolicy().decide(_snap(_cells([T] * 5 + [R] * 5), slow))
        if isinstance(a, MoveToTraining)
    ]
    # Not a busy cell (its executions would be rerouted for a move the rate rule did not ask).
    acts = GyrePolicy().decide(_snap(_cells([T] * 5 + [R] * 5, loads=[0] * 5 + [3, 0, 0, 0, 0]), busy))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    # Without breathing the rate rule alone: the cells stay in rollout.
    acts = GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T] * 5 + [R] * 5), busy))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    # Saturated rollout (W_eta 90 leaves only 1 cell beyond the rate target's 5): nothing lent,
    # so the saturated share is not undone (B64 at eta 4 lost 6% when lending refilled it).
    full = _heavy_pipeline(90, ready_groups=10, ready_tokens=5e5, batch_assigned=5, backlog_tokens=1e5)
    acts = GyrePolicy().decide(_snap(_cells([T] * 5 + [R] * 5), full))
    assert not [a for a in acts if isinstance(a, MoveToTraining)]
    # Nothing left to claim: a cell beyond the rate target (3 here, its band 1) goes back at
    # once, where the hysteresis band alone would have kept it idle in training.
    idle = _heavy_pipeline(12)
    acts = GyrePolicy().decide(_snap(_cells([T] * 4 + [R] * 6), idle))
    assert [a.cell_id for a in acts if isinstance(a, ReturnToRollout)] == ["c3"], acts
    acts = GyrePolicy(GyreConfig(breathe=False)).decide(_snap(_cells([T] * 4 + [R] * 6), idle))
    assert not [a for a in acts if isinstance(a, ReturnToRollout)]


def test_gyre_keeps_a_lent_cell_while_work_is_left_to_claim_and_rollout_does_not_need_it():
    # A64 with drift (seed 1): a cell was lent while the claimable work was worth lend_min_s
    # a cell; as the cells trained it down below that bar, the lending target fell to the rate
    # target and the hysteresis band sent the lent cells back, to be lent again when the next
    # groups arrived: 3,147 lends and 2,993 returns in a 30,774 s run. A lent cell now goes
    # back when nothing is left to claim or rollout needs its slots, not on the bar.
    R, T = CellState.ROLLOUT, CellState.TRAINING
    cells = _cells([T] * 8 + [R] * 2)  # rate target 3 (band 1): c3..c7 are lent
    little = _heavy_pipeline(12, ready_groups=1, ready_tokens=2e4, batch_assigned=5, backlog_tokens=1e4)
    assert not [a for a in GyrePolicy().decide(_snap(cells, little)) if isinstance(a, ReturnToRollout)]
    # Rollout needs them (W_eta 30 > the 20 slots it has): the band sends them back, last first.
    needed = _heavy_pipeline(30, ready_groups=1, ready_tokens=2e4, batch_assigned=5, backlog_tokens=1e4)
    assert [
        a.cell_id for a in GyrePolicy().decide(_snap(cells, needed)) if isinstance(a, ReturnToRollout)
    ] == ["c7"]
    # Nothing left to claim: back at once.
    assert [
        a.cell_id
        for a in GyrePolicy().decide(_snap(cells, _heavy_pipeline(12)))
        if isinstance(a, ReturnToRollout)
    ] == ["c7"]


def test_a_publications_wave_waits_for_cells_returning_to_rollout():
    # B64 with switch costs x5 (seed 1): lent cells go back as the batch's last groups are
    # claimed and take 7.5 s to wake; the publication's wave 2 s later went to the cells
    # already in rollout (least loaded first), and the returning ones came up with nothing to
    # run. Waiting for them: 2,503 -> 2,417 s (seed 2: 2,505 -> 2,444 s).
    R, T, B = CellState.ROLLOUT, CellState.TRAINING, CellState.RETURNING
    p = _heavy_pipeline(12, published_version=2)
    returning = _snap(_cells([T] * 3 + [B] * 2 + [R] * 5), p, v=2, quota=1000)
    acts = GyrePolicy().decide(returning)
    assert not [a for a in acts if isinstance(a, DispatchBurst)], acts
    hold = [a for a in acts if isinstance(a, Hold) and "returning to rollout" in a.reason]
    assert [h.cell_id for h in hold] == ["c3"] and "c3, c4" in hold[0].reason
    # The same wave goes out at once when no cell is on its way back, or with the lever off.
    settled = _snap(_cells([T] * 3 + [R] * 7), p, v=2, quota=1000)
    assert [a.quota for a in GyrePolicy().decide(settled) if isinstance(a, DispatchBurst)] == [320]
    off = GyrePolicy(GyreConfig(wave_waits=False)).decide(returning)
    assert [a.quota for a in off if isinstance(a, DispatchBurst)] == [320]
    # A trickle (less than half a batch: groups refilling the gate as others close) goes out.
    trickle = _snap(_cells([T] * 3 + [B] * 2 + [R] * 5), p, v=2, quota=20)
    assert [a.quota for a in GyrePolicy().decide(trickle) if isinstance(a, DispatchBurst)] == [20]
