"""The scheduler's operations against in-memory fakes of etcd and its peers.

Invariants: a finish for an unknown execution, with a bad or foreign token, a bad status, or
a NaN / infinite / negative reward gets a precise error and changes nothing (no write, same
counts); a repeat returns the first outcome; a missed heartbeat closes an execution once as
TIMED_OUT; a deposed leader's writes are refused and change nothing; a move to training
drains the cell, CASes each route to a new epoch on a preferred destination, asks the router
to move, switches the cell and joins it to the batch, every command fenced; at burst end
satellites return with the new policy and the next burst is dispatched; a new leader rebuilds
the same ledger from the store and finishes a half-done transition; finish reports are
retried until the packer acknowledges them.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from gyre.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StaleEpoch,
    Unauthenticated,
    Unavailable,
)
from gyre.execution import ExecutionStatus
from services.scheduler.peers import SupplyUpdate
from services.scheduler.policy import CellState
from services.scheduler.scheduler import Scheduler
from testkit.recording_peers import RecordingPeers
from testkit.scheduler_rig import (
    CELLS,
    KV,
    lead,
    make,
    publish_cells,
    publish_policy,
    publish_states,
    reconciled,
    settle,
)


async def test_bad_finish_reports_change_nothing():
    s, store, peers, _ = make(policy="rollout_only")
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)
    b, _, _ = await s.acquire("h", 0)
    assert a is not None and b is not None
    before, writes = s.ledger.counts(), store.writes
    eid = a.record.execution_id
    cases = [
        (NotFound, ("b9-t0-0", a.token, ExecutionStatus.COMPLETED, 1.0, "k")),
        (Unauthenticated, (eid, "not-a-token", ExecutionStatus.COMPLETED, 1.0, "k")),
        (PermissionDenied, (eid, b.token, ExecutionStatus.COMPLETED, 1.0, "k")),
        (InvalidArgument, (eid, a.token, ExecutionStatus.COMPLETED, math.nan, "k")),
        (InvalidArgument, (eid, a.token, ExecutionStatus.COMPLETED, math.inf, "k")),
        (InvalidArgument, (eid, a.token, ExecutionStatus.COMPLETED, -0.5, "k")),
        (InvalidArgument, (eid, a.token, ExecutionStatus.TIMED_OUT, 0.0, "k")),
        (InvalidArgument, (eid, a.token, ExecutionStatus.COMPLETED, 1.0, "")),
    ]
    for exc, args in cases:
        with pytest.raises(exc):
            await s.finish(*args)
        assert s.ledger.counts() == before and store.writes == writes, exc
    out = await s.finish(eid, a.token, ExecutionStatus.COMPLETED, 0.75, "k1")
    assert not out.duplicate and out.record.state is ExecutionStatus.COMPLETED
    assert s.ledger.counts().finished == 1 and store.route_of(eid) is None
    writes = store.writes
    for key in ("k1", "another-key"):
        again = await s.finish(eid, a.token, ExecutionStatus.FAILED, 0.0, key)
        assert (
            again.duplicate
            and again.record.state is ExecutionStatus.COMPLETED
            and again.record.reward == 0.75
        )
    assert store.writes == writes and s.ledger.counts().finished == 1


async def test_missed_heartbeat_times_out_once():
    s, store, peers, clock = make(policy="rollout_only")
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)
    b, _, _ = await s.acquire("h", 0)
    clock.now += 6
    await s.heartbeat(b.record.execution_id, b.token)
    clock.now += 6  # a: 12 s without heartbeat (> 10), b: 6 s
    await s.reconcile_once()
    assert s.ledger.records[a.record.execution_id].state is ExecutionStatus.TIMED_OUT
    assert s.ledger.records[b.record.execution_id].state is ExecutionStatus.RUNNING
    await s.reconcile_once()
    assert s.ledger.counts().finished == 1
    late = await s.finish(a.record.execution_id, a.token, ExecutionStatus.COMPLETED, 1.0, "k")
    assert late.duplicate and late.record.state is ExecutionStatus.TIMED_OUT
    s.ledger.check_invariants()


async def test_deposed_leader_changes_nothing():
    s, store, peers, _ = make(policy="rollout_only")
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)
    before = s.ledger.counts()
    store.depose()
    with pytest.raises(StaleEpoch):
        await s.finish(a.record.execution_id, a.token, ExecutionStatus.COMPLETED, 1.0, "k")
    assert s.deposed.is_set() and s.ledger.counts() == before
    assert s.ledger.records[a.record.execution_id].state is ExecutionStatus.RUNNING
    with pytest.raises(StaleEpoch):
        await s.acquire("h", 0)


async def _fill(s: Scheduler, n: int) -> list:
    out = []
    for _ in range(n):
        got, _, _ = await s.acquire("h", 0)
        assert got is not None
        out.append(got)
    return out


async def test_move_to_training_reroutes_with_fenced_commands():
    s, store, peers, clock = make(over_provision=1.0)  # quota: 8 groups x 2 = 16
    await lead(s, store)
    launched = await _fill(s, 16)  # sa 8, then sat1 4, then core 4
    where = {g.record.execution_id: g.route.cell_id for g in launched}
    assert [where[g.record.execution_id] for g in launched] == ["sa"] * 8 + ["sat1"] * 4 + ["core"] * 4
    # W = 16 > capacity after moving the core (12): no move, whatever the supply.
    peers.supply.put_nowait(SupplyUpdate(4, 4, 1))
    s.supply_raw = SupplyUpdate(4, 4, 1)
    await s.reconcile_once()
    assert not s.transitions.running("core")
    assert "capacity 12 < W 16" in s.events.after(0)[-1].message
    # Four standalone executions finish: W = 12 <= 12.
    for g in launched[:4]:
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    await reconciled(s)
    moved = [g for g in launched if g.route.cell_id == "core"]
    for g in moved:
        route, epoch = store.route_of(g.record.execution_id)
        assert route["cell_id"] == "sa" and epoch == 2  # standalone first; route epoch + 1
    states = [a[2] for a in peers.commands("set_state") if a[0] == "core:1"]
    assert states == [CellState.DRAINING, CellState.TRAINING]
    ((routers, epoch, moves),) = peers.commands("move_executions")
    assert epoch == 7 and {m.execution_id for m in moves} == {g.record.execution_id for g in moved}
    assert all(m.from_cell == "core" and m.to_cell == "sa" and m.route_epoch == 2 for m in moves)
    for _ in range(500):  # the join runs in its own task, after the transition ended
        if peers.commands("join_batch"):
            break
        await asyncio.sleep(0.01)
    (join,) = peers.commands("join_batch")
    assert join == ("core:1", 7, 1, 0, 1, "core:1")
    assert all(args[1] == 7 for name, args in peers.calls if name != "move_executions")
    assert not store.transitions
    kinds = [e.kind for e in s.events.after(0)]
    assert "cell_to_training" in kinds and "reroute" in kinds and "joined_batch" in kinds


async def test_burst_end_returns_satellites_and_dispatches_next():
    s, store, peers, clock = make(
        cells=[("core", "elastic", 0, 4), ("sat1", "elastic", 1, 4), ("sa", "standalone", -1, 16)]
    )
    await lead(s, store)
    s.supply_raw = SupplyUpdate(4, 4, 1)
    for _ in range(2):  # core, then sat1 (W 8 <= 16)
        await reconciled(s)
    assert s.cells.state("core") is CellState.TRAINING and s.cells.state("sat1") is CellState.TRAINING
    # The core's optimizer step publishes v1.
    publish_policy(s, 1)
    await reconciled(s)
    await asyncio.sleep(0.05)
    assert s.cells.state("sat1") is CellState.ROLLOUT
    assert ("sat1:1", 7, 1, "core:1") in peers.commands("load_policy")
    assert sorted(s.ledger.bursts) == [1, 2] and s.ledger.bursts[2].policy_version == 1
    # Capacity 16 + 4 covers W 8 + 8 and supply held: the core stays.
    assert s.cells.state("core") is CellState.TRAINING
    assert any(e.kind == "core_kept" for e in s.events.after(0))


async def test_new_leader_rebuilds_ledger_and_resumes_transition():
    s, store, peers, clock = make(over_provision=1.0)
    await lead(s, store)
    launched = await _fill(s, 16)
    for g in launched[:5]:
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    counts = s.ledger.counts()
    s.supply_raw = SupplyUpdate(4, 4, 1)
    peers.hold_set_state = asyncio.Event()  # the cell agent hangs: the transition stalls
    await s.reconcile_once()
    await asyncio.sleep(0.05)
    assert store.transitions == {
        "core": {
            "cell_id": "core",
            "target": "TRAINING",
            "reason": store.transitions["core"]["reason"],
            "epoch": 7,
        }
    }
    await s.transitions.cancel_all()  # the old leader dies here
    # A standby takes over with a newer epoch and the same etcd contents.
    peers2 = RecordingPeers()
    store2 = store.as_leader(epoch=9)
    s2, _, _, _ = make(store=store2, peers=peers2, clock=clock, over_provision=1.0)
    await s2.take_over(9)
    assert s2.ledger.counts() == counts
    s2.ledger.check_invariants()
    assert s2.transitions.running("core")
    await settle(s2)
    assert s2.cells.state("core") is CellState.TRAINING and not store2.transitions
    assert all(args[1] == 9 for _, args in peers2.calls)
    # The old leader can no longer write.
    g = launched[6]
    with pytest.raises(StaleEpoch):
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    out = await s2.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    assert not out.duplicate and s2.ledger.counts().finished == counts.finished + 1


async def test_finish_reports_retried_until_acknowledged():
    s, store, peers, _ = make(policy="rollout_only")
    await lead(s, store)
    peers.report_failures = 3
    task = asyncio.create_task(s.report_loop())
    try:
        a, _, _ = await s.acquire("h", 0)
        await s.finish(a.record.execution_id, a.token, ExecutionStatus.COMPLETED, 0.5, "k")
        for _ in range(300):
            if a.record.execution_id in peers.reports:
                break
            await asyncio.sleep(0.01)
        rep = peers.reports[a.record.execution_id]
        assert rep.status is ExecutionStatus.COMPLETED and rep.reward == 0.5 and rep.group_size == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_close_whose_answer_etcd_lost_is_recorded_and_reported_once(tmp_path):
    # An etcd outage can apply the close's transaction and lose its answer (seen in the chaos
    # demo: etcd paused 5 s). The close is ours: it must be in the history, counted once, and
    # its finish report must reach the packer. Before the fix the scheduler took it for
    # another writer's close: no history line, no report (the packer never heard of it).
    from services.scheduler.history import check, read

    hist = tmp_path / "scheduler.jsonl"
    s, store, peers, _ = make(policy="rollout_only", history_file=str(hist))
    await lead(s, store)
    task = asyncio.create_task(s.report_loop())
    try:
        a, _, _ = await s.acquire("h", 0)
        eid = a.record.execution_id
        store.lose_next_close_answer = 1
        out = await s.finish(eid, a.token, ExecutionStatus.COMPLETED, 0.5, "k")
        assert (
            not out.duplicate
            and s.ledger.records[eid].state is ExecutionStatus.COMPLETED
            and s.ledger.counts().finished == 1
        )
        for _ in range(300):
            if eid in peers.reports:
                break
            await asyncio.sleep(0.01)
        assert eid in peers.reports and peers.reports[eid].reward == 0.5
        again = await s.finish(eid, a.token, ExecutionStatus.COMPLETED, 0.5, "k")
        assert again.duplicate and s.ledger.counts().finished == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ops = read(hist)
    assert [op["execution_id"] for op in ops if op["op"] == "close"] == [eid]
    assert not check(ops)


async def test_a_launch_whose_answer_etcd_lost_is_recorded_once(tmp_path):
    from services.scheduler.history import check, read

    hist = tmp_path / "scheduler.jsonl"
    s, store, peers, _ = make(policy="rollout_only", history_file=str(hist))
    await lead(s, store)
    store.lose_next_launch_answer = 1
    with pytest.raises(Unavailable):
        await s.acquire("h", 0, key="k1-0123456789abcdef")
    (eid,) = [e for e, r in s.ledger.records.items() if r.state is ExecutionStatus.RUNNING]
    again, _, _ = await s.acquire("h", 0, key="k1-0123456789abcdef")  # the harness retries with its key
    assert again is not None and again.record.execution_id == eid
    await s.finish(eid, again.token, ExecutionStatus.COMPLETED, 0.5, "f")
    ops = read(hist)
    assert [op["execution_id"] for op in ops if op["op"] == "launch"] == [eid]
    assert not check(ops), check(ops)


async def test_a_new_leader_joins_the_cells_already_training():
    # The chaos of a full run: the leader moved the core to training and was SIGKILLed
    # before its JoinBatch landed. The new leader resumes no transition (the move was done)
    # and, with continuous dispatch, only joined cells after a new version, which only
    # training could publish: nothing trained, the demo timed out. Now every training cell
    # joins again after a takeover.
    s, store, peers, _ = make(policy="gyre")
    states = {cid: CellState.ROLLOUT for cid, *_ in CELLS} | {"core": CellState.TRAINING}
    publish_states(s, states)
    await lead(s, store)
    for _ in range(200):
        if peers.commands("join_batch"):
            break
        await asyncio.sleep(0.01)
    joins = peers.commands("join_batch")
    assert joins and joins[0][0] == "core:1", peers.calls


async def test_acquire_waits_for_a_free_slot():
    s, store, peers, _ = make(policy="rollout_only", cells=[("sa", "standalone", -1, 1)])
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)
    none, exhausted, retry = await s.acquire("h", 0)
    assert none is None and not exhausted and retry > 0
    waiter = asyncio.create_task(s.acquire("h", 5))
    await asyncio.sleep(0.05)
    await s.finish(a.record.execution_id, a.token, ExecutionStatus.FAILED, 0.0, "k")
    got, _, _ = await asyncio.wait_for(waiter, 5)
    assert got is not None and got.route.cell_id == "sa"


async def test_executions_of_a_lost_cell_are_rerouted_after_grace():
    s, store, peers, clock = make(policy="rollout_only", over_provision=1.0, orphan_grace_s=3.0)
    await lead(s, store)
    launched = await _fill(s, 10)  # sa 8, sat1 2
    on_sat = [g for g in launched if g.route.cell_id == "sat1"]
    assert len(on_sat) == 2
    alive = [c for c in CELLS if c[0] != "sat1"]
    publish_cells(s, alive)
    await reconciled(s)
    assert all(
        store.route_of(g.record.execution_id)[0]["cell_id"] == "sat1" for g in on_sat
    )  # within the grace
    clock.now += 3.5
    await reconciled(s)
    for g in on_sat:
        route, epoch = store.route_of(g.record.execution_id)
        assert route["cell_id"] == "core" and epoch == 2
    ((_, epoch, moves),) = peers.commands("move_executions")
    assert {m.execution_id for m in moves} == {g.record.execution_id for g in on_sat}
    assert any(e.kind == "rescued" for e in s.events.after(0))


async def test_drained_burst_trains_on_what_is_ready_and_seals():
    s, store, peers, clock = make(drain_grace_s=1.0)
    await lead(s, store)
    launched = await _fill(s, 8)
    for g in launched:
        await s.finish(
            g.record.execution_id,
            g.token,
            ExecutionStatus.FAILED if g is not launched[0] else ExecutionStatus.COMPLETED,
            1.0,
            "k",
        )
    s.supply_raw = SupplyUpdate(1, 4, 1)  # one ready group: below 0.5 x 4, and no more will come
    await s.reconcile_once()
    assert not s.transitions.running("core")
    clock.now += 1.5
    await reconciled(s)
    assert s.cells.state("core") is CellState.TRAINING
    assert "drained" in [e for e in s.events.after(0) if e.kind == "cell_to_training"][0].message
    s.supply_raw = SupplyUpdate(0, 3, 1)  # the core's claim assigned the group: 1 of 4 in the batch
    await s.reconcile_once()
    assert peers.commands("seal_batch") == [(7, 1)]
    await s.reconcile_once()
    assert peers.commands("seal_batch") == [(7, 1)]  # once per batch


async def test_drained_burst_with_nothing_trainable_goes_on():
    s, store, peers, clock = make(drain_grace_s=1.0)
    await lead(s, store)
    for g in await _fill(s, 8):
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.FAILED, 0.0, "k")
    s.supply_raw = SupplyUpdate(0, 4, 1)
    clock.now += 1.5
    await s.reconcile_once()
    assert sorted(s.ledger.bursts) == [1, 2] and s.ledger.bursts[2].policy_version == 0
    assert not s.transitions.running("core")


async def test_metrics_expose_waterlevel_capacity_and_roles():
    from prometheus_client import generate_latest

    from services.scheduler.events import Metrics

    metrics = Metrics()
    s, store, peers, _ = make(policy="rollout_only")
    s.telemetry.metrics = metrics
    await lead(s, store)
    await _fill(s, 3)
    await s.reconcile_once()
    text = generate_latest(metrics.registry).decode()
    assert "gyre_scheduler_waterlevel 8.0" in text and "gyre_scheduler_running 3.0" in text
    assert "gyre_scheduler_capacity 16.0" in text and 'gyre_scheduler_cells{state="ROLLOUT"} 3.0' in text
    assert 'gyre_scheduler_events_total{kind="burst_started"} 1.0' in text


async def test_colocated_baseline_trains_everyone_at_the_barrier():
    s, store, peers, clock = make(policy="colocated", drain_grace_s=0.0)
    await lead(s, store)
    launched = await _fill(s, 8)
    s.supply_raw = SupplyUpdate(4, 4, 1)
    for g in launched[:-1]:
        await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    await s.reconcile_once()
    assert not any(s.transitions.running(c) for c in ("core", "sat1"))  # W 1 > 0: barrier
    await s.finish(launched[-1].record.execution_id, launched[-1].token, ExecutionStatus.COMPLETED, 1.0, "k")
    await reconciled(s)
    assert s.cells.state("core") is CellState.TRAINING and s.cells.state("sat1") is CellState.TRAINING
    publish_policy(s, 1)
    await reconciled(s)
    assert s.cells.state("core") is CellState.ROLLOUT and s.cells.state("sat1") is CellState.ROLLOUT
    assert sorted(s.ledger.bursts) == [1, 2]


async def test_static_split_baseline_keeps_the_core_training():
    s, store, peers, clock = make(policy="static", static_training_cells=1)
    await lead(s, store)
    await settle(s)
    assert s.cells.state("core") is CellState.TRAINING and s.cells.state("sat1") is CellState.ROLLOUT
    launched = await _fill(s, 8)
    assert {g.route.cell_id for g in launched} <= {"sa", "sat1"}


async def test_overlapping_launches_never_overfill_a_cell():
    s, store, peers, _ = make(
        policy="rollout_only",
        over_provision=1.0,
        cells=[("sa", "standalone", -1, 3), ("sb", "standalone", -1, 2)],
    )
    await lead(s, store)
    store.launch_delay_s = 0.02
    store.fail_next = 0
    got = await asyncio.gather(*(s.acquire("h", 0) for _ in range(12)))
    launched = [g for g, _, _ in got if g is not None]
    assert len(launched) == 5 and len({g.record.execution_id for g in launched}) == 5
    assert s.routes.counts() == {"sa": 3, "sb": 2}
    assert s.ledger.counts().launched == 5 and len(store.execs) == 5
    # A failed write gives the execution and the slot back.
    g = launched[0]
    await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "k")
    store.fail_next = 1
    with pytest.raises(Unavailable):
        await s.acquire("h", 0)
    assert s.routes.counts() == {"sa": 2, "sb": 2} and s.ledger.counts().launched == 5
    again, _, _ = await s.acquire("h", 0)
    assert again is not None and again.route.cell_id == "sa" and s.ledger.counts().launched == 6


async def test_a_missed_join_is_retried_and_does_not_block_a_return():
    s, store, peers, clock = make(cells=[("core", "elastic", 0, 4), ("sa", "standalone", -1, 16)])
    await lead(s, store)
    answers = [False, False, True]

    async def join_batch(*args):
        peers.calls.append(("join_batch", args))
        return answers.pop(0) if answers else True

    peers.join_batch = join_batch
    s.supply_raw = SupplyUpdate(4, 4, 1)
    await reconciled(s)
    for _ in range(100):
        if len(peers.commands("join_batch")) >= 3:
            break
        await asyncio.sleep(0.05)
    kinds = [e.kind for e in s.events.after(0)]
    assert kinds.count("join_missed") == 1 and "joined_batch" in kinds  # one event per missed batch
    # With the trainer never joining, a burst-end return still goes through.
    answers[:] = [False] * 1000
    publish_policy(s, 1)
    s.transitions.rejoin("core")
    await asyncio.sleep(0.05)
    s.transitions.start("core", CellState.ROLLOUT, "test")
    await settle(s)
    assert s.cells.state("core") is CellState.ROLLOUT


async def test_a_join_the_cell_does_not_answer_is_retried_while_it_trains():
    """A partition longer than a few command deadlines: JoinBatch keeps failing (UNAVAILABLE)
    while the cell stays registered. Giving up would leave it training with no batch, and
    nothing would rejoin it: the join is retried until the cell answers."""
    s, store, peers, clock = make(cells=[("core", "elastic", 0, 4), ("sa", "standalone", -1, 16)])
    await lead(s, store)
    unreachable = [True] * 7

    async def join_batch(*args):
        peers.calls.append(("join_batch", args))
        if unreachable and unreachable.pop():
            raise Unavailable("partitioned")
        return True

    peers.join_batch = join_batch
    s.supply_raw = SupplyUpdate(4, 4, 1)
    await reconciled(s)
    for _ in range(100):
        if "joined_batch" in [e.kind for e in s.events.after(0)]:
            break
        await asyncio.sleep(0.05)
    kinds = [e.kind for e in s.events.after(0)]
    assert len(peers.commands("join_batch")) == 8 and "joined_batch" in kinds
    assert kinds.count("join_failed") == 1  # one event per batch
    assert s.cells.state("core") is CellState.TRAINING


def test_history_checker_finds_double_counts_and_unfenced_writes():
    from services.scheduler.history import check

    good = [
        {"op": "leader", "epoch": 5, "rev": 5},
        {"op": "dispatch", "epoch": 5, "rev": 6, "burst_id": 1, "quota": 2},
        {"op": "launch", "epoch": 5, "rev": 7, "execution_id": "b1-t0-0", "burst_id": 1},
        {"op": "leader", "epoch": 9, "rev": 9},
        {"op": "launch", "epoch": 9, "rev": 10, "execution_id": "b1-t0-1", "burst_id": 1},
        {"op": "close", "epoch": 9, "rev": 11, "execution_id": "b1-t0-0", "status": "COMPLETED"},
        {"op": "close", "epoch": 9, "rev": 12, "execution_id": "b1-t0-1", "status": "FAILED"},
    ]
    assert check(good, complete=True) == []
    twice = good + [{"op": "close", "epoch": 9, "rev": 13, "execution_id": "b1-t0-1", "status": "COMPLETED"}]
    assert any("closed twice" in v for v in check(twice))
    stale = good + [{"op": "close", "epoch": 5, "rev": 14, "execution_id": "b1-t0-0", "status": "FAILED"}]
    assert any("after epoch 9 was elected" in v for v in check(stale))
    assert any("dispatched 2 != finished 1" in v for v in check(good[:-1], complete=True))


async def test_a_failed_move_calls_the_drain_off():
    s, store, peers, clock = make(cells=[("core", "elastic", 0, 4), ("sa", "standalone", -1, 16)])
    await lead(s, store)
    real = peers.set_state

    async def refuse_training(target, epoch, state, reason):
        if state is CellState.TRAINING:
            raise FailedPrecondition("engine still holds requests")
        return await real(target, epoch, state, reason)

    peers.set_state = refuse_training
    s.supply_raw = SupplyUpdate(4, 4, 1)
    import services.scheduler.fleet as T

    old, T.MAX_REFUSALS = T.MAX_REFUSALS, 2
    try:
        await reconciled(s)
    finally:
        T.MAX_REFUSALS = old
    assert s.cells.state("core") is CellState.ROLLOUT and not store.transitions
    assert [a[2] for a in peers.commands("set_state")] == [CellState.DRAINING, CellState.ROLLOUT]
    assert any(e.kind == "transition_failed" for e in s.events.after(0))


async def test_a_cell_stranded_in_returning_is_brought_back():
    s, store, peers, clock = make(policy="rollout_only")
    await lead(s, store)
    peers.on_state("sat1:1", CellState.RETURNING)  # e.g. a return whose leader died before recording it
    await reconciled(s)
    assert s.cells.state("sat1") is CellState.ROLLOUT
    assert [a[2] for a in peers.commands("set_state")] == [CellState.RETURNING, CellState.ROLLOUT]


async def test_cancel_closes_running_and_withdraws_queued_executions_once():
    """The cancel rule's mechanism: a running execution closes as CANCELLED (route gone, its
    harness's heartbeat and finish answer CANCELLED, the packer is told), a queued one is
    withdrawn (never launched), and a repeat or an already closed one changes nothing."""
    s, store, peers, _ = make(policy="rollout_only", cells=[("sa", "standalone", -1, 1)])
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)  # b1-t0-0 runs; the other 7 are queued
    assert a is not None
    group = a.record.group_id
    done = await s.executions.cancel(s.ledger.members(group), "its group can no longer be trained")
    assert sorted(done) == [f"{group}-0", f"{group}-1"]
    assert store.route_of(a.record.execution_id) is None and not s.routes.routes
    left, state = await s.heartbeat(a.record.execution_id, a.token)
    assert (left, state) == (0.0, ExecutionStatus.CANCELLED)
    out = await s.finish(a.record.execution_id, a.token, ExecutionStatus.COMPLETED, 1.0, "k")
    assert out.duplicate and out.record.state is ExecutionStatus.CANCELLED
    c = s.ledger.counts()
    assert (c.dispatched, c.launched, c.finished) == (8, 2, 2)
    s.ledger.check_invariants()
    assert await s.executions.cancel(s.ledger.members(group), "again") == []
    # The withdrawn member is never launched; the next acquire takes the next group.
    b, _, _ = await s.acquire("h", 0)
    assert b is not None and b.record.group_id != group
    task = asyncio.create_task(s.report_loop())
    try:
        for _ in range(300):
            if f"{group}-1" in peers.reports:
                break
            await asyncio.sleep(0.01)
        assert {peers.reports[f"{group}-{m}"].status for m in (0, 1)} == {ExecutionStatus.CANCELLED}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # A new leader rebuilds the same counts from the store.
    s2, _, _, _ = make(policy="rollout_only", store=store.as_leader(epoch=9))
    await s2.take_over(9)
    assert s2.ledger.counts() == s.ledger.counts() and s2.ledger.next_queued() is not None
    s2.ledger.check_invariants()


async def test_migrate_moves_one_execution_with_a_fenced_route_cas_and_tells_the_routers():
    s, store, peers, _ = make(
        policy="rollout_only", cells=[("sa", "standalone", -1, 1), ("sb", "standalone", -1, 2)]
    )
    await lead(s, store)
    got = [await s.acquire("h", 0) for _ in range(2)]
    on_sb = next(g for g, _, _ in got if g.route.cell_id == "sb")
    on_sa = next(g for g, _, _ in got if g.route.cell_id == "sa")
    assert not await s.transitions._migrate(on_sb.record.execution_id, "sa", "test")  # sa is full
    assert not await s.transitions._migrate(on_sb.record.execution_id, "gone", "test")
    assert await s.transitions._migrate(on_sa.record.execution_id, "sb", "spread the load")
    route, epoch = store.route_of(on_sa.record.execution_id)
    assert (
        route["cell_id"] == "sb" and epoch == 2 and s.routes.routes[on_sa.record.execution_id].cell_id == "sb"
    )
    ((_, fence, moves),) = peers.commands("move_executions")
    assert fence == 7 and [(m.execution_id, m.from_cell, m.to_cell, m.route_epoch) for m in moves] == [
        (on_sa.record.execution_id, "sa", "sb", 2)
    ]
    st = s.status()
    assert st.migrations == 1 and st.reroutes == 1
    assert any(e.kind == "migrated" for e in s.events.after(0))


async def test_status_has_the_ledger_per_policy_version():
    s, store, peers, _ = make(policy="rollout_only", max_bursts=2)
    await lead(s, store)
    publish_policy(s, 3)
    for g in [await s.acquire("h", 0) for _ in range(8)]:
        await s.finish(g[0].record.execution_id, g[0].token, ExecutionStatus.COMPLETED, 1.0, "k")
    await s.reconcile_once()  # burst 2 at v3
    a, _, _ = await s.acquire("h", 0)
    st = s.status()
    assert {v: (c.dispatched, c.launched, c.finished) for v, c in st.versions.items()} == {
        0: (8, 8, 8),
        3: (8, 1, 0),
    }
    assert st.open_bursts == 1 and a.record.policy_version == 3


async def test_cancel_early_rule_cancels_groups_no_batch_within_eta_can_take():
    """gyre.staleness.unconsumable, applied by the control loop: groups stamped v0 stay while
    the trainer is at v1 with its batch still filling (eta 1), are cancelled once batch v1 is
    full, and the cancelled ones close as CANCELLED (running ones lose their route)."""
    s, store, peers, _ = make(policy="rollout_only", max_bursts=1, max_staleness=1)
    await lead(s, store)
    a, _, _ = await s.acquire("h", 0)
    publish_policy(s, 1)
    s.supply_raw = SupplyUpdate(0, 4, 2, batch_assigned=3)
    await s.reconcile_once()
    assert s.ledger.counts().finished == 0
    s.supply_raw = SupplyUpdate(0, 0, 2, batch_assigned=4)  # batch v1 has all its groups
    await s.reconcile_once()
    c = s.ledger.counts()
    assert c.finished == c.dispatched == 8 and s.ledger.finished_by_status() == {"CANCELLED": 8}
    assert store.route_of(a.record.execution_id) is None
    assert (await s.heartbeat(a.record.execution_id, a.token))[1] is ExecutionStatus.CANCELLED
    assert any(e.kind == "cancelled" and "max_staleness 1" in e.message for e in s.events.after(0))
    s.ledger.check_invariants()


def _core_training(s: Scheduler, peers: RecordingPeers) -> None:
    """The core TRAINING, the satellite and the standalone cell in rollout, batch 2 open."""
    publish_states(s, {"core": CellState.TRAINING, "sat1": CellState.ROLLOUT, "sa": CellState.ROLLOUT})
    peers.batch_id = 2


async def test_continuous_policy_rejoins_training_cells_after_each_update():
    """No burst end with continuous dispatch: after each published version every cell still
    training joins the next batch (once, however many ticks see the version)."""
    s, store, peers, _ = make(policy="gyre", max_staleness=1)
    await lead(s, store)
    _core_training(s, peers)
    publish_policy(s, 1)
    for _ in range(3):
        await s.reconcile_once()
    for _ in range(100):
        if peers.commands("join_batch"):
            break
        await asyncio.sleep(0.01)
    assert peers.commands("join_batch") == [("core:1", 7, 2, 1, 1, "core:1")]
    assert s.status().total.dispatched == 2 * 4 * 2 + 4 * 2  # v1's gate: (1 + 1 + 1) x 4 groups of 2


async def test_a_core_returned_at_a_publication_is_not_joined_to_the_next_batch():
    """Seen in the demo: the policy breathed the core out one decision after a publication,
    when the core had already joined the next batch, so it sat RETURNING (useless to both
    sides) until that batch stepped, ~30 s. The policy now decides at the publication itself
    (W_eta counts its own dispatch, test_policy_async); this guards the loop's side: a core
    returned in the publication's tick gets no JoinBatch (the join yields to the move)."""
    from services.scheduler.policy import Hold, ReturnToRollout

    s, store, peers, _ = make(policy="gyre", max_staleness=1)
    await lead(s, store)
    _core_training(s, peers)

    class BreatheOut:
        name = "breathe-out"

        def decide(self, snap):
            if snap.policy_version >= 1:
                return [ReturnToRollout("core", "test: nothing to train, W_eta waits for slots")]
            return [Hold("test")]

    s.control.policy = BreatheOut()
    publish_policy(s, 1)
    await reconciled(s)
    await s.reconcile_once()
    await asyncio.sleep(0.05)
    assert peers.commands("join_batch") == []
    assert s.cells.state("core") is CellState.ROLLOUT


def test_switch_times_give_a_round_trip_once_both_directions_were_measured():
    from services.scheduler.transitions import SwitchTimes

    t = SwitchTimes(keep=2)
    assert t.round_trip_s == 0.0
    t.record(CellState.TRAINING, 4.0)
    assert t.round_trip_s == 0.0  # no return measured yet
    t.record(CellState.ROLLOUT, 2.0)
    assert t.round_trip_s == 6.0
    for s in (10.0, 20.0):  # the newest two are kept
        t.record(CellState.TRAINING, s)
    t.record(CellState.DRAINING, 99.0)  # not a move's target: ignored
    assert t.round_trip_s == 17.0


async def test_a_completed_move_is_timed_and_the_policy_sees_the_round_trip():
    s, store, peers, clock = make(
        policy="gyre", max_staleness=1, cells=[("core", "elastic", 0, 4), ("sa", "standalone", -1, 16)]
    )
    await lead(s, store)
    s.transitions.start("core", CellState.TRAINING, "test")
    await settle(s)
    s.transitions.start("core", CellState.ROLLOUT, "test")
    await settle(s)
    times = s.transitions.switch_times
    assert len(times._times[CellState.TRAINING]) == 1 and len(times._times[CellState.ROLLOUT]) == 1
    snap = s.control.snapshot()
    assert snap.pipeline is not None and snap.pipeline.switch_s == times.round_trip_s


async def test_the_policy_sees_the_engines_kv_and_the_packers_open_context():
    """Live Gyre counts a rollout cell as the executions its KV keeps: the elastic engines'
    smallest KV size from their registrations (a standalone engine's is not a cell the
    policy moves) and the packer's mean open context."""
    s, store, peers, clock = make(policy="gyre", max_staleness=1)
    s.on_cells(
        {
            f"/c/{cid}".encode(): KV(
                f"/c/{cid}".encode(),
                json.dumps(
                    {
                        "cell_id": cid,
                        "kind": kind,
                        "index": i,
                        "slots": 4,
                        "target": f"{cid}:1",
                        "kv_tokens": kv,
                    }
                ).encode(),
            )
            for cid, kind, i, kv in [
                ("core", "elastic", 0, 6000),
                ("sat1", "elastic", 1, 9000),
                ("sa", "standalone", -1, 1000),
            ]
        }
    )
    s.supply_raw = SupplyUpdate(0, 4, 1, open_context_tokens=2000.0)
    p = s.control.snapshot().pipeline
    assert p is not None
    assert (p.kv_tokens_per_cell, p.context_tokens) == (6000.0, 2000.0)
    assert p.kv_slots(4) == 3  # 6,000 tokens keep three contexts of 2,000
    # An older agent's record has no kv_tokens: unknown, and the policy counts slots.
    publish_cells(s, [("core", "elastic", 0, 4), ("sat1", "elastic", 1, 4)])
    p = s.control.snapshot().pipeline
    assert p is not None and p.kv_tokens_per_cell == 0 and p.kv_slots(4) == 4
