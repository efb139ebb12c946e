"""Random command histories against a cell (mock engine, fake fenced store, moving leader
epochs): the state in the store always equals the cell's state, every change follows the
transition table, a refused command changes nothing, and no write carries an epoch older
than one already committed (the fence only moves forward)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import FailedPrecondition, GyreError, StaleEpoch
from services.cell_agent.cell import Cell, CellIdentity
from services.cell_agent.engines.mock import MockEngine, MockTiming, VirtualClock
from services.cell_agent.lifecycle import CellKind, CellState
from testkit.lifecycle import ALLOWED

TARGETS = [s for s in CellState if s is not CellState.STARTING]


class Store:
    def __init__(self) -> None:
        self.leader = 10
        self.writes: list[tuple[CellState, int]] = []

    async def write_state(self, state, epoch, updated_s):
        if epoch > 0 and epoch != self.leader:
            raise StaleEpoch("deposed")
        self.writes.append((state, epoch))

    async def register(self, record):
        pass

    async def verify_leader(self, epoch):
        if epoch != self.leader:
            raise StaleEpoch("deposed")


commands = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.sampled_from(TARGETS), st.integers(-1, 1)),
        st.tuples(st.just("elect"), st.just(CellState.ROLLOUT), st.just(0)),
    ),
    max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(list(CellKind)), history=commands)
def test_random_histories_keep_store_and_cell_in_step(kind, history):
    asyncio.run(_run(kind, history))


async def _run(kind, history):
    engine = MockEngine(MockTiming(time_scale=0.0), VirtualClock())
    store = Store()
    cell = Cell(CellIdentity("c", kind, 0, 2, "mock"), engine, store, drain_wait_s=0.0)
    await cell.start()
    await cell.open("x:1")
    committed_epochs = [0]
    for op, target, delta in history:
        if op == "elect":
            store.leader += 5  # a new leader; the old epoch is now stale in etcd
            continue
        epoch = store.leader + delta * 5  # the leader's, an old one, or a future one
        before_state, before_writes = cell.state, len(store.writes)
        try:
            got = await cell.set_state(target, epoch)
        except (FailedPrecondition, GyreError):
            assert cell.state is before_state and len(store.writes) == before_writes
            continue
        assert got is cell.state
        if cell.state is not before_state:
            assert (before_state, cell.state) in ALLOWED
            assert store.writes[-1][0] is cell.state
            assert epoch >= max(committed_epochs)
            committed_epochs.append(epoch)
        assert kind is CellKind.ELASTIC or cell.state not in (CellState.TRAINING, CellState.RETURNING)
        if cell.state is CellState.FAILED:
            break
        assert store.writes[-1][0] is cell.state
    await cell.close()
