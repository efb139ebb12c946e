"""No execution lost, none counted twice, across random histories with failovers (hypothesis).

The real Scheduler on the in-memory store fake: random acquire / finish / duplicate finish
/ invalid finish / finish of everything held / heartbeat / clock jumps (time-outs) / control-loop ticks / leader
failovers (a new Scheduler rebuilds from the store with a newer epoch; the old one's
writes are refused) / acquires retried with their idempotency key (the same execution and
token, on any leader; refused once closed), with the finish relay running and closed
bursts archived as soon as they may be. After every step: D = Q + R + F; the ledger
rebuilt from the store equals the live leader's (same counts, archived bursts included, same records, same
states); every launch is one handed to a harness (a retried key never launches twice);
there is a route exactly for each running execution; every closed execution was closed
once (one final record, one status).
"""

from __future__ import annotations

import asyncio
import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_scheduler_service import make  # same test folder

from gyre.errors import FailedPrecondition, GyreError, StaleEpoch
from gyre.execution import ExecutionStatus
from services.scheduler.ledger import Ledger
from testkit.recording_peers import RecordingPeers
from testkit.scheduler_fakes import FakeStore

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["acquire"] * 4
            + ["finish"] * 3
            + ["reconcile"] * 2
            + ["dup", "bad", "heartbeat", "tick", "failover", "old_writes", "reacquire", "finish_all"]
        ),
        st.integers(0, 30),
    ),
    min_size=20,
    max_size=80,
)
SETTINGS = {
    "policy": "rollout_only",
    "batch_size": 1,
    "over_provision": 1.0,
    "heartbeat_deadline_s": 10.0,
    "archive_grace_s": 0.0,
    "drain_grace_s": 0.0,
}  # bursts of 4: many close and are archived


async def _rebuild(store: FakeStore) -> Ledger:
    loaded = await store.load()
    ledger = Ledger()
    ledger.archived = loaded.summary
    for b in loaded.bursts:
        ledger.apply_burst(b)
    for rec in sorted(loaded.executions, key=lambda r: (r.burst_id, r.seq)):
        ledger.load(rec, 0.0)
    return ledger


def _relay(s) -> asyncio.Task[None]:
    """The leader's finish relay (the packer acknowledges at once): settled reports let
    closed bursts be archived."""
    return asyncio.create_task(s.report_loop())


async def _history(ops: list[tuple[str, int]]) -> None:
    s, store, _, clock = make(**SETTINGS)
    await s.take_over(store.epoch)
    relay = _relay(s)
    await s.reconcile_once()
    held: list = []  # (execution handed to a harness, with its token; its acquire key)
    old = None
    epoch = store.epoch

    def live() -> list:  # held executions whose burst is not archived
        return [(g, k) for g, k in held if g.record.burst_id > s.ledger.archived.through]

    for n, (op, arg) in enumerate(ops):
        cands = live()
        if op == "acquire":
            key = f"acquire-key-{n:06d}-{arg:04d}"
            got, _, _ = await s.acquire("h", 0, key)
            if got is not None:
                held.append((got, key))
        elif op == "reacquire" and cands:
            g, key = cands[arg % len(cands)]
            if s.ledger.records[g.record.execution_id].state.final:
                try:
                    await s.acquire("h", 0, key)
                    raise AssertionError("a closed execution was handed out again")
                except FailedPrecondition:
                    pass
            else:
                again, _, _ = await s.acquire("h", 0, key)
                assert (again.record.execution_id, again.token) == (g.record.execution_id, g.token)
        elif op in ("finish", "dup", "bad") and cands:
            g, _ = cands[arg % len(cands)]
            if op == "bad":
                before = s.ledger.counts()
                try:
                    await s.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, math.nan, "k")
                    raise AssertionError("NaN reward accepted")
                except GyreError:
                    pass
                assert s.ledger.counts() == before
            else:
                out = await s.finish(
                    g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 0.5, f"k{arg}"
                )
                was_final = out.duplicate
                if op == "dup":
                    again = await s.finish(
                        g.record.execution_id, g.token, ExecutionStatus.FAILED, 0.0, "other"
                    )
                    assert again.duplicate and again.record.state is out.record.state
                assert was_final or out.record.state is ExecutionStatus.COMPLETED
        elif op == "finish_all":  # every held execution still running closes (a burst can end)
            for g, _ in cands:
                if s.ledger.records[g.record.execution_id].state is ExecutionStatus.RUNNING:
                    await s.finish(g.record.execution_id, g.token, ExecutionStatus.FAILED, 0.0, "all")
        elif op == "heartbeat" and cands:
            g, _ = cands[arg % len(cands)]
            await s.heartbeat(g.record.execution_id, g.token)
        elif op == "tick":
            clock.now += arg
        elif op == "reconcile":
            await s.reconcile_once()
        elif op == "failover":
            await s.transitions.cancel_all()
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            old = s
            epoch += 1 + arg
            new_store = store.as_leader(epoch)
            s, store, _, _ = make(**SETTINGS, store=new_store, peers=RecordingPeers(), clock=clock)
            await s.take_over(epoch)
            relay = _relay(s)
        elif op == "old_writes" and old is not None and cands:
            g, _ = cands[arg % len(cands)]
            before = await _rebuild(store)
            try:
                await old.finish(g.record.execution_id, g.token, ExecutionStatus.COMPLETED, 1.0, "old")
            except StaleEpoch:
                pass
            except GyreError:
                pass
            after = await _rebuild(store)
            assert after.counts() == before.counts()
        for _ in range(5):
            await asyncio.sleep(0)  # the relay delivers
        # Invariants.
        s.ledger.check_invariants()
        rebuilt = await _rebuild(store)
        assert rebuilt.counts() == s.ledger.counts()
        assert rebuilt.finished_by_status() == s.ledger.finished_by_status()
        assert {e: r.state for e, r in rebuilt.records.items()} == {
            e: r.state for e, r in s.ledger.records.items()
        }
        running = {e for e, r in s.ledger.records.items() if r.state is ExecutionStatus.RUNNING}
        assert set(store.routes) == running
        assert set(s.routes.routes) == running
        assert s.ledger.counts().launched == len({g.record.execution_id for g, _ in held}) + sum(
            1 for r in s.ledger.records.values() if not r.token_sha256
        )  # (withdrawn: no token)
    relay.cancel()
    await asyncio.gather(relay, return_exceptions=True)
    event(f"bursts archived: {min(s.ledger.archived.bursts, 3)}+")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_no_execution_lost_or_double_counted_across_failovers(ops):
    asyncio.run(_history(ops))
