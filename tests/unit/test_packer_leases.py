"""Claims are leases until the core's step commits: in a batch the core opened
(OpenBatch), an ack does not train a micro-step for good; CommitBatch does. A failed attempt
(a core crash, a broken collective) is retried by opening the batch again, which returns
every held or acknowledged, uncommitted micro-step to the pool, so nothing trained in a lost
attempt is lost. A claim is idempotent on its claim id. All of it replays from the
WAL and survives a compaction to a snapshot."""

from __future__ import annotations

import pytest

from gyre.errors import FailedPrecondition, InvalidArgument
from services.packer.model import ClaimOutcome
from services.packer.snapshot import compacted
from testkit import packer_kit as tk


async def _sealed_batch(p):
    await tk.feed_group(p, "g1", size=2, turns=2)
    await tk.feed_group(p, "g2", size=2, turns=1)
    return p.state.batches[1]


async def _claim_all(p, cell, batch_id=1):
    got = []
    while True:
        r = await p.claim(cell, batch_id, 0, 0)
        if r.outcome is not ClaimOutcome.CLAIMED:
            return got
        got.append(r.micro_step)


def _turns(steps):
    return sorted(
        (t.execution_id, t.turn_index) for ms in steps for s in ms.sequences for t in s.segment.turns
    )


async def test_acks_of_an_opened_batch_wait_for_the_commit_and_a_reopen_redelivers_them():
    p, log, _ = tk.make_packer(micro_step_token_budget=16)
    await p.open_batch("core", 1)
    await _sealed_batch(p)
    first = await _claim_all(p, "core")
    batch = p.state.batches[1]
    assert batch.sealed and first
    for ms in first:
        assert await p.ack("core", 1, ms.micro_step_id) is False
    assert batch.done and not batch.committed
    assert p.state.consumed == 0  # nothing is trained for good before the step commits
    produced = p.state.produced
    # The core crashed before its step: its new attempt gets every micro-step back.
    await p.open_batch("core", 1)
    assert batch.attempt == 2 and not batch.done and not batch.closed and batch.acked == 0
    again = await _claim_all(p, "core")
    assert _turns(again) == _turns(first) and len(again) == len(first)
    for ms in again:
        await p.ack("core", 1, ms.micro_step_id)
    _, dup = await p.commit("core", 1)
    assert not dup and batch.committed and p.state.consumed == produced
    assert (await p.commit("core", 1))[1] is True  # idempotent
    with pytest.raises(FailedPrecondition):
        await p.open_batch("core", 1)
    p.state.check(deep=True)
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)


async def test_commit_before_every_ack_is_refused():
    p, _, _ = tk.make_packer(micro_step_token_budget=16)
    await p.open_batch("core", 1)
    await _sealed_batch(p)
    steps = await _claim_all(p, "core")
    await p.ack("core", 1, steps[0].micro_step_id)
    with pytest.raises(FailedPrecondition, match="acknowledged"):
        await p.commit("core", 1)
    with pytest.raises(InvalidArgument):
        await p.commit("core", 0)


async def test_a_dead_satellites_acked_work_returns_with_the_next_attempt():
    p, log, _ = tk.make_packer(micro_step_token_budget=16)
    await p.open_batch("core", 1)
    await _sealed_batch(p)
    sat = await p.claim("sat", 1, 0, 0)
    await p.ack("sat", 1, sat.micro_step.micro_step_id)
    held = await p.claim("sat", 1, 0, 0)
    assert await p.release_cell("sat") == 1  # its held claim returns at once
    assert held.micro_step.micro_step_id in p.state.batches[1].free
    # Its acked gradient died with it (the reduce failed): the core's next attempt retrains it.
    await p.open_batch("core", 1)
    assert sat.micro_step.micro_step_id in p.state.batches[1].free
    steps = await _claim_all(p, "core")
    assert len(steps) == len(p.state.batches[1].micro_steps)
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)


async def test_a_batch_never_opened_keeps_final_acks():
    p, _, _ = tk.make_packer(micro_step_token_budget=16)
    await _sealed_batch(p)
    steps = await _claim_all(p, "cell")
    for ms in steps:
        await p.ack("cell", 1, ms.micro_step_id)
    assert p.state.batches[1].committed and p.state.consumed == p.state.produced


async def test_claim_is_idempotent_on_its_claim_id():
    p, log, _ = tk.make_packer(micro_step_token_budget=16)
    await _sealed_batch(p)
    a = await p.claim("cell", 1, 0, 0, claim_id="k1")
    again = await p.claim("cell", 1, 0, 0, claim_id="k1")  # the answer was lost; the cell retries
    assert again.outcome is ClaimOutcome.CLAIMED and again.micro_step == a.micro_step
    assert len([m for m in p.state.held.values() if m.holder == "cell"]) == 1
    b = await p.claim("cell", 1, 0, 0, claim_id="k2")
    assert b.micro_step.micro_step_id != a.micro_step.micro_step_id
    other = await p.claim("other", 1, 0, 0, claim_id="k1")  # keys are per cell
    assert other.micro_step is None or other.micro_step.micro_step_id != a.micro_step.micro_step_id
    with pytest.raises(InvalidArgument):
        await p.claim("cell", 1, 0, 0, claim_id="x" * 129)
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)
    assert tk.replayed(log.events).batches[1].claim_keys == p.state.batches[1].claim_keys


async def test_leases_survive_a_compaction():
    p, _, _ = tk.make_packer(micro_step_token_budget=16)
    await p.open_batch("core", 1)
    await _sealed_batch(p)
    steps = await _claim_all(p, "core", 1)
    await p.ack("core", 1, steps[0].micro_step_id)
    restored = tk.replayed(compacted(p.state))
    assert tk.snapshot(restored) == tk.snapshot(p.state)
    b = restored.batches[1]
    assert (b.attempt, b.committed, b.acked) == (1, False, 1)
    assert not any(m.committed for m in b.micro_steps)
