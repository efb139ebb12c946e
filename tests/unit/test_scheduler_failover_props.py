"""No execution lost, none counted twice, across random histories with failovers (hypothesis).

The real Scheduler on the in-memory store fake: random acquire / finish / duplicate finish
/ invalid finish / heartbeat / clock jumps (time-outs) / control-loop ticks / leader
failovers (a new Scheduler rebuilds from the store with a newer epoch; the old one's
writes are refused). After every step: D = Q + R + F; the ledger rebuilt from the store
equals the live leader's (same records, same states); there is a route exactly for each
running execution; every closed execution was closed once (one final record, one status).
"""

from __future__ import annotations

import asyncio
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_service import make  # noqa: E402  (same test folder)

from bench.support.recording_peers import RecordingPeers
from gyre.errors import GyreError, StaleEpoch
from services.scheduler.ledger import ExecState, Ledger
from tests.support.scheduler_fakes import FakeStore

OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire"] * 4 + ["finish"] * 3 + ["dup", "bad", "heartbeat", "tick", "reconcile", "failover", "old_writes"]),
        st.integers(0, 30),
    ),
    min_size=5,
    max_size=60,
)


async def _rebuild(store: FakeStore) -> Ledger:
    loaded = await store.load()
    ledger = Ledger()
    ledger.archived = loaded.summary
    for b in loaded.bursts:
        ledger.apply_burst(b)
    for rec in sorted(loaded.executions, key=lambda r: (r.burst_id, r.seq)):
        ledger.load(rec, 0.0)
    return ledger


async def _history(ops: list[tuple[str, int]]) -> None:
    s, store, peers, clock = make(policy="rollout_only", over_provision=1.0, heartbeat_deadline_s=10.0)
    await s.take_over(store.epoch)
    await s.reconcile_once()
    held: list = []  # executions handed to harnesses (with their tokens)
    old = None
    epoch = store.epoch
    for op, arg in ops:
        if op == "acquire":
            got, _, _ = await s.acquire("h", 0)
            if got is not None:
                held.append(got)
        elif op in ("finish", "dup", "bad") and held:
            g = held[arg % len(held)]
            if op == "bad":
                before = s.ledger.counts()
                try:
                    await s.finish(g.record.execution_id, g.token, ExecState.COMPLETED, math.nan, "k")
                    raise AssertionError("NaN reward accepted")
                except GyreError:
                    pass
                assert s.ledger.counts() == before
            else:
                out = await s.finish(g.record.execution_id, g.token, ExecState.COMPLETED, 0.5, f"k{arg}")
                was_final = out.duplicate
                if op == "dup":
                    again = await s.finish(g.record.execution_id, g.token, ExecState.FAILED, 0.0, "other")
                    assert again.duplicate and again.record.state is out.record.state
                assert was_final or out.record.state is ExecState.COMPLETED
        elif op == "heartbeat" and held:
            g = held[arg % len(held)]
            await s.heartbeat(g.record.execution_id, g.token)
        elif op == "tick":
            clock.now += arg
        elif op == "reconcile":
            await s.reconcile_once()
        elif op == "failover":
            await s.transitions.cancel_all()
            old = s
            epoch += 1 + arg
            new_store = store.as_leader(epoch)
            s, store, _, _ = make(policy="rollout_only", over_provision=1.0, heartbeat_deadline_s=10.0,
                                  store=new_store, peers=RecordingPeers(), clock=clock)
            await s.take_over(epoch)
        elif op == "old_writes" and old is not None and held:
            g = held[arg % len(held)]
            before = await _rebuild(store)
            try:
                await old.finish(g.record.execution_id, g.token, ExecState.COMPLETED, 1.0, "old")
            except StaleEpoch:
                pass
            except GyreError:
                pass
            after = await _rebuild(store)
            assert after.counts() == before.counts()
        # Invariants.
        s.ledger.check_invariants()
        rebuilt = await _rebuild(store)
        assert rebuilt.counts() == s.ledger.counts()
        assert {e: r.state for e, r in rebuilt.records.items()} == {e: r.state for e, r in s.ledger.records.items()}
        running = {e for e, r in s.ledger.records.items() if r.state is ExecState.RUNNING}
        assert set(store.routes) == running
        assert set(s.routes.routes) == running


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_no_execution_lost_or_double_counted_across_failovers(ops):
    asyncio.run(_history(ops))
