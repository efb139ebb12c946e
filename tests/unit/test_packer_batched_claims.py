"""Batched claims and acks (ClaimMicroSteps / AckMicroSteps): racing cells that claim
several micro-steps per call and ack them in one go still train every micro-step exactly
once and the WAL replays to the same state; a retried batched claim answers what the first
call claimed; a batched ack is all or nothing and flags the ones acknowledged before; bad
sizes are refused and change nothing."""

from __future__ import annotations

import asyncio
import random

import pytest

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound
from services.packer.model import ClaimOutcome
from testkit import packer_kit as tk


class CountingLog(tk.MemoryLog):
    """A MemoryLog that counts sync() calls (one WAL flush each on the real log)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    async def sync(self) -> None:
        self.syncs += 1


async def _drain_many(p, cell, n, trained):
    while True:
        first, views = await p.claim_many(cell, 1, 0, 0.05, f"{cell}-{len(trained)}", n)
        if first.outcome is ClaimOutcome.CLOSED:
            return
        if not views:
            await asyncio.sleep(0)
            continue
        ids = [v.micro_step_id for v in views]
        trained.extend(ids)
        await asyncio.sleep(random.random() * 0.002)
        assert await p.ack_many(cell, 1, ids) == [False] * len(ids)


async def test_racing_batched_claimers_train_each_micro_step_once():
    random.seed(3)
    p, log, _ = tk.make_packer(batch_size=12, micro_step_token_budget=40, emit_fill_fraction=0.9)

    async def producer():
        for g in range(12):
            await tk.feed_group(p, f"g{g}", size=3, turns=2, prompt=3 + g % 4, output=2 + g % 5)
            await asyncio.sleep(0.001)

    trained: list[str] = []
    await asyncio.gather(producer(), *(_drain_many(p, f"cell{i}", 1 + i % 4, trained) for i in range(8)))
    status = p.batch_status(1)
    assert status["done"] and len(trained) == len(set(trained)) == status["micro_steps"] == status["acked"]
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)


async def test_batched_claim_is_idempotent_on_its_claim_id():
    p, _, _ = tk.make_packer(batch_size=2, micro_step_token_budget=8)
    for g in ("g1", "g2"):
        await tk.feed_group(p, g, size=2)  # four micro-steps of 8 tokens
    first, views = await p.claim_many("a", 0, 0, 0, "k1", 3)
    assert first.outcome is ClaimOutcome.CLAIMED and len(views) == 3
    _, views2 = await p.claim_many("a", 1, 0, 0, "k1", 3)
    assert [v.micro_step_id for v in views2] == [v.micro_step_id for v in views]
    _, rest = await p.claim_many("b", 1, 0, 0, "k1", 3)  # the key is the cell's own
    assert len(rest) == 1 and rest[0].micro_step_id not in {v.micro_step_id for v in views}
    assert (await p.claim_many("b", 1, 0, 0, "k2", 3))[0].outcome is ClaimOutcome.CLOSED


async def test_a_batched_claim_leaves_a_micro_step_to_each_cell_waiting_for_one():
    # "b" joined the batch and waits; four micro-steps become free at once. A batched claim
    # of "a" for 4 takes 3 and leaves one to b (it took all 4 before, and b trained none:
    # tests/integration/test_training_packer.py's satellite, in CI).
    p, _, _ = tk.make_packer(batch_size=2, micro_step_token_budget=8)
    await tk.feed_group(p, "g1", size=2)  # two micro-steps
    first, views = await p.claim_many("a", 0, 0, 0, "k0", 2)
    assert first.outcome is ClaimOutcome.CLAIMED and len(views) == 2
    waiter = asyncio.create_task(p.claim_many("b", 1, 0, 5.0, "kb", 4))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # b waits for a micro-step of batch 1
    await tk.feed_group(p, "g2", size=2)  # two more: the batch is complete
    first, views = await p.claim_many("a", 1, 0, 0, "k1", 4)
    b_first, b_views = await asyncio.wait_for(waiter, 5)
    assert b_first.outcome is ClaimOutcome.CLAIMED and len(b_views) >= 1
    assert len(views) + len(b_views) == 2
    # With nobody waiting a batched claim takes what there is.
    p2, _, _ = tk.make_packer(batch_size=2, micro_step_token_budget=8)
    for g in ("g1", "g2"):
        await tk.feed_group(p2, g, size=2)
    assert len((await p2.claim_many("a", 0, 0, 0, "k", 4))[1]) == 4


async def test_batched_ack_is_all_or_nothing_with_one_flush():
    log = CountingLog()
    from services.packer.packer import Packer

    p = Packer(tk.config(batch_size=1, micro_step_token_budget=8), log, clock=tk.ManualClock())
    p.recover([])
    await tk.feed_group(p, "g", size=4)  # four micro-steps
    _, mine = await p.claim_many("a", 0, 0, 0, "", 2)
    _, theirs = await p.claim_many("b", 1, 0, 0, "", 2)
    a_ids, b_ids = [v.micro_step_id for v in mine], [v.micro_step_id for v in theirs]
    before, n = tk.snapshot(p.state), len(log.events)
    for bad, err in (
        (a_ids + b_ids[:1], FailedPrecondition),
        (a_ids + ["nope"], NotFound),
        (a_ids + a_ids[:1], InvalidArgument),
        ([], InvalidArgument),
    ):
        with pytest.raises(err):
            await p.ack_many("a", 1, bad)
    assert tk.snapshot(p.state) == before and len(log.events) == n
    syncs = log.syncs
    assert await p.ack_many("a", 1, a_ids) == [False, False]
    assert log.syncs == syncs + 1
    assert await p.ack_many("a", 1, a_ids[:1]) == [True]
    assert await p.ack_many("b", 1, b_ids) == [False, False]
    assert p.batch_status(1)["done"]


async def test_batched_claim_refuses_bad_sizes_and_changes_nothing():
    p, log, _ = tk.make_packer(batch_size=1, micro_step_token_budget=8)
    await tk.feed_group(p, "g", size=2)
    before, n = tk.snapshot(p.state), len(log.events)
    for bad in (0, 65):
        with pytest.raises(InvalidArgument):
            await p.claim_many("a", 0, 0, 0, "", bad)
    with pytest.raises(InvalidArgument):
        await p.claim_many("a", 0, 0, 0, "k" * 121, 2)
    assert tk.snapshot(p.state) == before and len(log.events) == n


async def test_batched_claim_is_durable_with_one_flush_after_all_its_claims():
    """One WAL flush per batched claim, after every one of its claims is in the log (a
    claim answered is durable); the cell's leases are renewed for all of them."""

    class SyncPoints(CountingLog):
        def __init__(self) -> None:
            super().__init__()
            self.at: list[int] = []

        async def sync(self) -> None:
            await super().sync()
            self.at.append(len(self.events))

    log = SyncPoints()
    from services.packer.packer import Packer

    clock = tk.ManualClock()
    p = Packer(tk.config(batch_size=2, micro_step_token_budget=8), log, clock=clock)
    p.recover([])
    for g in ("g1", "g2"):
        await tk.feed_group(p, g, size=3)  # six micro-steps of 8 tokens
    syncs = log.syncs
    first, views = await p.claim_many("a", 0, 0, 0, "k", 4)
    assert first.outcome is ClaimOutcome.CLAIMED and len(views) == 4
    assert log.syncs == syncs + 1
    claims = [e for e in log.events if e["t"] == "claim"]
    assert [e["ms"] for e in claims] == [v.micro_step_id for v in views]
    assert [e.get("key") for e in claims] == ["k", "k#1", "k#2", "k#3"]
    assert log.at[-1] == len(log.events)  # the flush came after the last claim
    held = [p.state.micro_steps[v.micro_step_id] for v in views]
    assert len({m.deadline for m in held}) == 1 and all(m.holder == "a" for m in held)
    # The rest (two), then nothing free: a batched claim takes what there is.
    _, rest = await p.claim_many("b", 1, 0, 0, "", 4)
    assert len(rest) == 2 and log.syncs == syncs + 2
