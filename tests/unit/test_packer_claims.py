"""Packer claims: many cells racing for micro-steps each get disjoint ones (every micro-step
claimed and trained exactly once) while conservation holds at every point; a claim not kept
past its TTL returns to the pool and is trained once by another cell; acks are idempotent;
a claim on another weight version is refused; the joining window closes once every
micro-step is claimed and the next batch opens after."""

from __future__ import annotations

import asyncio
import random

import pytest

from gyre.errors import FailedPrecondition, StaleEpoch
from services.packer.model import ClaimOutcome
from testkit import packer_kit as tk


async def _drain(p, cell, batch_id, version=0, trained=None, wait_s=0.0):
    """Claims and acks until CLOSED; returns the micro-step ids this cell trained."""
    mine = []
    while True:
        r = await p.claim(cell, batch_id, version, wait_s)
        if r.outcome is ClaimOutcome.CLOSED:
            return mine
        if r.outcome is ClaimOutcome.WAIT:
            await asyncio.sleep(0)
            continue
        ms = r.micro_step
        mine.append(ms.micro_step_id)
        if trained is not None:
            trained.extend((t.execution_id, t.turn_index) for s in ms.sequences for t in s.segment.turns)
        await asyncio.sleep(random.random() * 0.002)
        assert await p.ack(cell, batch_id, ms.micro_step_id) is False


async def test_racing_claimers_each_micro_step_claimed_once():
    random.seed(7)
    p, log, _ = tk.make_packer(batch_size=12, micro_step_token_budget=40, emit_fill_fraction=0.9)
    checks = 0

    async def producer():
        # Groups arrive while the cells are already claiming.
        for g in range(12):
            await tk.feed_group(p, f"g{g}", size=3, turns=2, prompt=3 + g % 4, output=2 + g % 5)
            await asyncio.sleep(0.001)

    async def monitor():
        nonlocal checks
        while True:
            c = p.state.counters()
            assert c["produced"] == c["consumed"] + c["buffered"] + sum(c["dropped"].values())
            checks += 1
            await asyncio.sleep(0)

    trained: list[tuple[str, int]] = []
    mon = asyncio.create_task(monitor())
    cells = [_drain(p, f"cell{i}", 1, trained=trained, wait_s=0.05) for i in range(16)]
    results = await asyncio.gather(producer(), *cells)
    mon.cancel()
    per_cell = results[1:]
    claimed = [m for ids in per_cell for m in ids]
    status = p.batch_status(1)
    assert status["done"] and status["sealed"] and status["closed"]
    assert len(claimed) == len(set(claimed)) == status["micro_steps"] == status["acked"]
    # Every turn trained exactly once.
    assert len(trained) == len(set(trained)) == 12 * 3 * 2
    c = p.state.counters()
    assert c["consumed"] == c["produced"] == 72 and c["buffered"] == 0
    assert sum(1 for ids in per_cell if ids) > 1  # the work was actually shared
    assert checks > 10
    # Micro-steps respect the budget; total tokens = loss tokens of all turns.
    assert all(m.packed_tokens <= 40 for m in p.state.micro_steps.values())
    assert status["total_tokens"] == sum(2 + g % 5 for g in range(12)) * 3 * 2
    # The WAL replays to the same state.
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)


async def test_expired_claim_returns_and_is_trained_once():
    p, _, clock = tk.make_packer(batch_size=1, micro_step_token_budget=16, claim_ttl_s=5.0)
    await tk.feed_group(p, "g", size=2)  # two turns of 8 tokens -> one micro-step of 16
    r = await p.claim("dead", 0, 0, 0)
    assert r.outcome is ClaimOutcome.CLAIMED
    ms_id = r.micro_step.micro_step_id
    assert (await p.claim("other", 1, 0, 0)).outcome is ClaimOutcome.CLOSED  # window closed
    clock.advance(4.0)
    assert await p.reap() == 0
    clock.advance(1.5)
    assert await p.reap() == 1
    assert p.state.counters()["claims_expired"] == 1
    # Closed to newcomers, but open to a participant? "dead" is the only participant: a
    # newcomer is still told CLOSED, the participant can retake it.
    assert (await p.claim("other", 1, 0, 0)).outcome is ClaimOutcome.CLOSED
    assert p.batch_status(1)["unclaimed"] == 1
    r2 = await p.claim("dead", 1, 0, 0)
    assert r2.outcome is ClaimOutcome.CLAIMED and r2.micro_step.micro_step_id == ms_id
    assert await p.ack("dead", 1, ms_id) is False
    assert p.batch_status(1)["done"]
    assert p.state.counters()["consumed"] == 2


async def test_expired_claim_taken_by_participant_refuses_late_ack():
    p, _, clock = tk.make_packer(batch_size=1, micro_step_token_budget=8, claim_ttl_s=5.0)
    await tk.feed_group(p, "g", size=2)  # two micro-steps of 8 tokens
    a = await p.claim("a", 0, 0, 0)
    b = await p.claim("b", 0, 0, 0)
    assert a.outcome is b.outcome is ClaimOutcome.CLAIMED
    clock.advance(3.0)
    assert await p.keep("b") == 1  # b keeps its claim alive; a does not
    clock.advance(3.0)
    assert await p.reap() == 1
    r = await p.claim("b", 1, 0, 0)  # b is a participant: takes a's returned micro-step
    assert r.micro_step.micro_step_id == a.micro_step.micro_step_id
    with pytest.raises(FailedPrecondition):
        await p.ack("a", 1, a.micro_step.micro_step_id)
    assert await p.ack("b", 1, a.micro_step.micro_step_id) is False
    assert await p.ack("b", 1, b.micro_step.micro_step_id) is False
    assert await p.ack("b", 1, b.micro_step.micro_step_id) is True  # idempotent
    with pytest.raises(FailedPrecondition):
        await p.ack("a", 1, b.micro_step.micro_step_id)
    assert p.batch_status(1)["done"] and p.state.counters()["consumed"] == 2


async def test_late_ack_of_returned_but_untaken_micro_step_is_accepted():
    p, _, clock = tk.make_packer(batch_size=1, micro_step_token_budget=16, claim_ttl_s=1.0)
    await tk.feed_group(p, "g", size=2)
    r = await p.claim("slow", 0, 0, 0)
    clock.advance(2.0)
    assert await p.reap() == 1
    assert await p.ack("slow", 1, r.micro_step.micro_step_id) is False
    assert p.batch_status(1)["done"]


async def test_claim_on_other_version_refused_and_changes_nothing():
    p, log, _ = tk.make_packer(batch_size=1, micro_step_token_budget=8)
    await tk.feed_group(p, "g", size=2)
    assert (await p.claim("a", 0, 1, 0)).outcome is ClaimOutcome.CLAIMED
    before, n = tk.snapshot(p.state), len(log.events)
    for wrong in (0, 2):
        with pytest.raises(FailedPrecondition):
            await p.claim("b", 1, wrong, 0)
    assert tk.snapshot(p.state) == before and len(log.events) == n
    r = await p.claim("b", 1, 1, 0)
    assert r.outcome is ClaimOutcome.CLAIMED and r.policy_version == 1
    assert r.micro_step.policy_version == 1


async def test_window_closes_then_next_batch_opens():
    p, _, _ = tk.make_packer(batch_size=1, micro_step_token_budget=16)
    await tk.feed_group(p, "g1", size=2)
    await tk.feed_group(p, "g2", size=2)
    r = await p.claim("core", 0, 0, 0)
    assert r.batch_id == 1 and r.outcome is ClaimOutcome.CLAIMED
    assert (await p.claim("late", 1, 0, 0)).outcome is ClaimOutcome.CLOSED
    assert (await p.claim("core", 1, 0, 0)).outcome is ClaimOutcome.CLOSED
    # Batch 2 exists (being filled) but is not active until a claim pins its version.
    s = p.supply()
    assert s["batch_id"] == 2 and not s["batch_active"] and s["ready_groups"] == 1
    await p.ack("core", 1, r.micro_step.micro_step_id)
    assert p.batch_status(0)["batch_id"] == 2  # current batch moved on
    r2 = await p.claim("late", 0, 1, 0)
    assert r2.batch_id == 2 and r2.outcome is ClaimOutcome.CLAIMED and r2.policy_version == 1


async def test_partial_bins_wait_for_demand():
    p, _, _ = tk.make_packer(batch_size=3, micro_step_token_budget=64, emit_fill_fraction=0.9)
    await tk.feed_group(p, "g1", size=2)  # 16 tokens: not enough for a full bin
    r = await p.claim("c", 0, 0, 0)  # the claim is demand: the partial bin goes out
    assert r.outcome is ClaimOutcome.CLAIMED and r.micro_step.packed_tokens == 16
    await p.ack("c", 1, r.micro_step.micro_step_id)
    await tk.feed_group(p, "g2", size=2)  # no claimer waiting: stays unpacked
    assert p.batch_status(1)["micro_steps"] == 1 and p.state.counters()["assigned"] == 2

    async def later():
        await asyncio.sleep(0.01)
        await tk.feed_group(p, "g3", size=2)

    task = asyncio.create_task(later())
    r = await p.claim("c", 1, 0, 1.0)
    await task
    assert r.outcome is ClaimOutcome.CLAIMED
    s = p.batch_status(1)
    assert s["sealed"] and s["groups_packed"] == 3


async def test_seal_batch_with_fewer_groups_is_fenced_and_idempotent():
    p, _, _ = tk.make_packer(batch_size=5, micro_step_token_budget=64)
    with pytest.raises(FailedPrecondition):
        await p.seal(0, epoch=10)  # nothing in it yet
    await tk.feed_group(p, "g1", size=2)
    await p.claim("c", 0, 0, 0)
    await tk.feed_group(p, "g2", size=2)
    with pytest.raises(StaleEpoch):
        await p.seal(1, epoch=9)
    batch = await p.seal(1, epoch=11)
    assert batch.sealed and len(batch.groups) == 2 and not batch.pending
    assert (await p.seal(1, epoch=11)).sealed
    # Batch 1 is sealed but g2's micro-step is still free: it is what a joiner could take.
    assert p.state.filling == 2
    s = p.supply()
    assert s["batch_id"] == 1 and s["ready_groups"] == 1 and s["batch_needs"] == 1
    total = sum(m.loss_tokens for m in batch.micro_steps)
    assert p.batch_status(1)["total_tokens"] == total == 16


async def test_seal_takes_ready_groups_even_before_a_claim():
    p, _, _ = tk.make_packer(batch_size=5, micro_step_token_budget=64)
    await tk.feed_group(p, "g1", size=2)
    await tk.feed_group(p, "g2", size=2)
    assert p.supply()["ready_unassigned"] == 2 and not p.batch_status(1)["active"]
    batch = await p.seal(0, epoch=3)
    assert batch.id == 1 and batch.sealed and batch.groups == ["g1", "g2"]
    assert p.batch_status(1)["total_tokens"] == 16
    r = await p.claim("core", 1, 0, 0)
    assert r.outcome is ClaimOutcome.CLAIMED and r.policy_version == 0
    assert (await p.claim("late", 1, 0, 0)).outcome is ClaimOutcome.CLOSED


async def test_supply_counts_ready_groups_not_yet_claimed():
    # One micro-step per group (2 turns x 8 tokens = the 16-token budget).
    p, _, _ = tk.make_packer(batch_size=4, micro_step_token_budget=16)
    for g in range(3):
        await tk.feed_group(p, f"g{g}", size=2)
    s = p.supply()
    assert (s["batch_id"], s["ready_groups"], s["batch_needs"], s["batch_active"]) == (1, 3, 4, False)
    await p.claim("core", 1, 0, 0)  # activates: 3 groups assigned and packed, 1 claimed
    s = p.supply()
    assert (s["ready_groups"], s["batch_needs"], s["batch_active"]) == (2, 3, True)
    await tk.feed_group(p, "g3", size=2)  # the 4th group: the batch is sealed
    s = p.supply()
    assert p.batch_status(1)["sealed"] and (s["batch_id"], s["ready_groups"], s["batch_needs"]) == (1, 3, 3)
    for _ in range(3):
        assert (await p.claim("satellite", 1, 0, 0)).outcome is ClaimOutcome.CLAIMED
    # Every micro-step claimed: the window is closed, the supply is the next batch's.
    await tk.feed_group(p, "g4", size=2)
    s = p.supply()
    assert (s["batch_id"], s["ready_groups"], s["batch_needs"], s["batch_active"]) == (2, 1, 4, False)
    assert p.batch_status(0)["batch_id"] == 2


async def test_keep_claims_counts_and_unknown_cells():
    p, _, _ = tk.make_packer(batch_size=1, micro_step_token_budget=8)
    await tk.feed_group(p, "g", size=2)
    await p.claim("a", 0, 0, 0)
    await p.claim("a", 0, 0, 0)
    assert await p.keep("a") == 2
    assert await p.keep("nobody") == 0


async def test_supply_carries_the_tokens_and_counts_the_schedulers_rates_need():
    """Ready tokens (each execution's longest turn), the current batch's untrained backlog,
    tokens trained, groups that became ready, and "optimizing" once every micro-step of a
    sealed batch is acknowledged."""
    p, _, _ = tk.make_packer(batch_size=2, micro_step_token_budget=400)
    s0 = p.supply()
    assert (s0["ready_tokens"], s0["backlog_tokens"], s0["tokens_trained"], s0["groups_ready_total"]) == (
        0,
        0,
        0,
        0,
    )
    await tk.feed_group(p, "g0", size=2, turns=1, prompt=6, output=4)
    assert p.supply()["groups_ready_total"] == 1 and p.supply()["ready_tokens"] == 2 * 10
    await tk.feed_group(p, "g1", size=2, turns=1, prompt=6, output=4)
    assert p.supply()["ready_tokens"] == 4 * 10  # waiting for a claim to activate batch 1
    r = await p.claim("cell0", 1, 0, 0)
    assert r.micro_step is not None
    s1 = p.supply()
    assert s1["ready_tokens"] == 0 and s1["backlog_tokens"] == 4 * 10  # assigned, not trained
    assert await p.ack("cell0", 1, r.micro_step.micro_step_id) is False
    s2 = p.supply()
    assert s2["tokens_trained"] == 4 * 10 and s2["backlog_tokens"] == 0 and s2["groups_ready_total"] == 2
    assert s2["optimizing"]  # batch 1 trained on v0; v1 is not published yet
    await p.observe_policy(1)
    assert not p.supply()["optimizing"]


async def test_supply_carries_the_mean_context_of_the_open_executions():
    """The scheduler counts a rollout cell as the executions its KV keeps at this context:
    each open execution's latest turn (prompt and output), closed ones left out, measured at
    most once a second and rounded to two significant digits."""
    p, _, clock = tk.make_packer(batch_size=4, micro_step_token_budget=4000)
    assert p.supply()["open_context_tokens"] == 0
    await p.record_turn(tk.turn("a", "g", 0, prompt=100, output=20))
    await p.record_turn(tk.turn("a", "g", 1, prompt=1000, output=234))  # the latest: 1,234
    await p.record_turn(tk.turn("b", "g", 0, prompt=300, output=66))  # 366
    clock.advance(1.0)
    assert p.supply()["open_context_tokens"] == 800.0  # (1,234 + 366) / 2
    await p.report_finish(tk.finish("a", "g", 3))
    assert p.supply()["open_context_tokens"] == 800.0  # not measured again within a second
    clock.advance(1.0)
    assert p.supply()["open_context_tokens"] == 370.0  # b alone, 366 to two digits
    await p.report_finish(tk.finish("b", "g", 3))
    clock.advance(1.0)
    assert p.supply()["open_context_tokens"] == 0
