"""A cell's role commands change nothing when refused (stale epoch in the store, illegal
transition, engine not drained), release the engine only once it holds no request, call the
training hook around TRAINING, load policies only while the engine is up, and end the
process (FatalError from the monitor) when the engine dies or its probe hangs."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gyre.errors import FailedPrecondition, FatalError, StaleEpoch, Unavailable
from gyre.etcd.values import CellRecord
from services.cell_agent.cell import Cell, CellIdentity
from services.cell_agent.engines.base import Sampling
from services.cell_agent.engines.mock import MockEngine, MockFaults, MockTiming, RealClock
from services.cell_agent.hooks import JoinBatch
from services.cell_agent.lifecycle import CellKind, CellState

S = CellState


class FakeStore:
    """The store with a leader epoch that tests can move."""

    def __init__(self, leader_epoch: int = 5) -> None:
        self.leader_epoch = leader_epoch
        self.states: list[tuple[str, int]] = []
        self.records: list[CellRecord] = []

    async def write_state(self, state, epoch, updated_s):
        if epoch > 0 and epoch != self.leader_epoch:
            raise StaleEpoch("not the leader")
        self.states.append((state.name, epoch))

    async def register(self, record):
        self.records.append(record)

    async def verify_leader(self, epoch):
        if epoch != self.leader_epoch:
            raise StaleEpoch("not the leader")


class RecordingHook:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def on_enter_training(self):
        self.calls.append("enter")

    async def on_leave_training(self):
        self.calls.append("leave")

    async def join_batch(self, cmd: JoinBatch) -> bool:
        self.calls.append(f"join {cmd.batch_id}")
        return True

    def services(self):
        return ()


async def _cell(faults=None, kind=CellKind.ELASTIC, pull=None, **kw) -> tuple[Cell, FakeStore, RecordingHook]:
    engine = MockEngine(MockTiming(fixed_decode_step_s=0.001), RealClock(), faults=faults)
    store = FakeStore()
    hook = RecordingHook()
    identity = CellIdentity("c1", kind, 0, 4, "mock")
    cell = Cell(identity, engine, store, hook=hook, pull=pull, drain_wait_s=0.1, **kw)
    await cell.start()
    await cell.open("127.0.0.1:9")
    return cell, store, hook


async def test_full_cycle_calls_the_hook_and_persists_every_step():
    cell, store, hook = await _cell()
    for target in (S.DRAINING, S.TRAINING, S.RETURNING, S.ROLLOUT):
        assert await cell.set_state(target, 5) is target
    assert store.states == [
        ("ROLLOUT", 0),
        ("DRAINING", 5),
        ("TRAINING", 5),
        ("RETURNING", 5),
        ("ROLLOUT", 5),
    ]
    assert hook.calls == ["enter", "leave"]
    assert store.records[0].target == "127.0.0.1:9" and store.records[0].kind is CellKind.ELASTIC
    # The registration carries the engine's KV size, and its JSON keeps it (an older
    # agent's record without it reads as 0: unknown).
    rec = store.records[0]
    assert rec.kv_tokens == cell.engine.kv_tokens > 0
    assert CellRecord.from_json(rec.to_json()) == rec
    assert CellRecord.from_json(rec.to_json().replace(b', "kv_tokens"', b', "old"')).kv_tokens == 0
    await cell.close()


async def test_refusals_change_nothing():
    cell, store, _ = await _cell()
    with pytest.raises(StaleEpoch):  # the store's fenced write refuses epoch 4
        await cell.set_state(S.DRAINING, 4)
    assert cell.state is S.ROLLOUT and cell.lifecycle.epoch == 0
    with pytest.raises(FailedPrecondition):
        await cell.set_state(S.RETURNING, 5)
    await cell.set_state(S.DRAINING, 5)
    with pytest.raises(Unavailable):
        await anext(cell.generate("r", [3, 4], Sampling(max_tokens=10_000)))  # DRAINING takes no new request
    await cell.set_state(S.ROLLOUT, 5)  # a drain can be called off
    stream = cell.generate("r", [3, 4], Sampling(max_tokens=10_000))
    await anext(stream)
    await cell.set_state(S.DRAINING, 5)
    with pytest.raises(FailedPrecondition, match="holds 1"):
        await cell.set_state(S.TRAINING, 5)
    assert cell.state is S.DRAINING and not cell.engine.sleeping
    await stream.aclose()  # consumer gone -> request aborted
    assert await cell.set_state(S.TRAINING, 5) is S.TRAINING
    assert cell.engine.sleeping
    assert len(store.states) == 5
    await cell.close()


async def test_standalone_cell_refuses_training():
    cell, _, _ = await _cell(kind=CellKind.STANDALONE)
    await cell.set_state(S.DRAINING, 5)
    with pytest.raises(FailedPrecondition):
        await cell.set_state(S.TRAINING, 5)
    await cell.close()


async def test_load_policy_and_join_batch_are_fenced_and_state_checked():
    torch = pytest.importorskip("torch")
    pulled = []

    async def pull(target, version):
        pulled.append((target, version))
        return version, {"w": torch.full((3,), float(version))}

    cell, store, hook = await _cell(pull=pull)
    before = [t async for c in cell.generate("a", [3, 4], Sampling(max_tokens=8)) for t in c.token_ids]
    version, _ = await cell.load_policy(5, 7, "core:1")
    assert version == 7 and pulled == [("core:1", 7)] and store.records[-1].policy_version == 7
    after = [t async for c in cell.generate("b", [3, 4], Sampling(max_tokens=8)) for t in c.token_ids]
    assert after != before
    with pytest.raises(StaleEpoch):
        await cell.load_policy(6, 8, "core:1")  # not the leader's epoch
    with pytest.raises(FailedPrecondition):
        await cell.join_batch(JoinBatch(5, 1, 7, 1, ""))  # not training
    await cell.set_state(S.DRAINING, 5)
    await cell.set_state(S.TRAINING, 5)
    with pytest.raises(FailedPrecondition):
        await cell.load_policy(5, 8, "core:1")  # engine asleep
    assert await cell.join_batch(JoinBatch(5, 1, 7, 1, "")) is True
    assert hook.calls[-1] == "join 1"
    await cell.close()


@pytest.mark.parametrize("faults", [MockFaults(die_after_tokens=5), MockFaults(hang_after_tokens=5)])
async def test_monitor_ends_the_process_when_the_engine_dies_or_hangs(faults):
    cell, store, _ = await _cell(faults=faults, probe_interval_s=0.05, probe_timeout_s=0.3)
    monitor = asyncio.create_task(cell.run())
    results = await asyncio.gather(*[_drain(cell, f"r{i}") for i in range(3)], return_exceptions=True)
    assert all(isinstance(r, Unavailable) for r in results), results
    with pytest.raises(FatalError):
        await asyncio.wait_for(monitor, 5)
    assert cell.state is S.FAILED and store.states[-1] == ("FAILED", 0)
    await cell.close()


async def _drain(cell, rid):
    async for _ in cell.generate(rid, [3, 5], Sampling(max_tokens=10_000)):
        pass


async def test_leaving_training_waits_for_the_trainer_and_a_refusal_changes_nothing():
    from gyre.errors import DeadlineExceeded

    cell, store, hook = await _cell()
    await cell.set_state(S.DRAINING, 5)
    await cell.set_state(S.TRAINING, 5)

    async def busy():
        raise DeadlineExceeded("batch 3 still running")

    hook.on_leave_training = busy
    writes = len(store.states)
    with pytest.raises(DeadlineExceeded):
        await cell.set_state(S.RETURNING, 5)
    assert cell.state is S.TRAINING and len(store.states) == writes and cell.engine.sleeping
    with pytest.raises(StaleEpoch):  # a deposed leader cannot fail the cell either
        await cell.set_state(S.FAILED, 4)
    assert cell.state is S.TRAINING
    await cell.close()


@pytest.mark.parametrize("target", [S.TRAINING, S.RETURNING])
async def test_a_committed_transition_completes_when_its_caller_goes_away(target):
    """A scheduler SIGKILLed mid-command cancels the call on the cell's side. Once the new
    state is written, its side effects (the engine's sleep or wake, the training hook) must
    complete anyway: found by the 2-hour soak, where a scheduler killed during TRAINING ->
    RETURNING left cell-0 RETURNING with its engine asleep, and every command of the next
    leader (load the policy, then ROLLOUT) was refused 'while RETURNING' from then on."""
    cell, store, hook = await _cell()
    cell.engine.timing = dataclasses.replace(cell.engine.timing, sleep_s=0.3, wake_s=0.3)
    await cell.set_state(S.DRAINING, 5)
    if target is S.RETURNING:
        await cell.set_state(S.TRAINING, 5)
    call = asyncio.create_task(cell.set_state(target, 5))
    while cell.state is not target:  # committed: the side effect is under way
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert cell.state is target
    if target is S.TRAINING:
        assert cell.engine.sleeping and hook.calls[-1] == "enter"
        return
    assert not cell.engine.sleeping
    assert (await cell.load_policy(5, 0, ""))[0] == 0  # the next leader's first command
    assert await cell.set_state(S.ROLLOUT, 5) is S.ROLLOUT
