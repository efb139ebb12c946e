"""Packer packing: first-fit decreasing puts every sequence in exactly one micro-step, no
micro-step exceeds the token budget, no two bins are both at most half full (so the bin
count is near optimal), and the result is deterministic; through the packer, a sealed
batch's total token count equals the loss tokens of all its turns."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.packer.model import ClaimOutcome
from services.packer.packing import first_fit_decreasing
from testkit import packer_kit as tk


def _ffd_by_scan(items, budget):
    """First-fit decreasing scanning every bin: what first_fit_decreasing must equal."""
    bins, room = [], []
    for i in sorted(range(len(items)), key=lambda i: (-items[i][1], i)):
        key, size = items[i]
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(key)
                room[b] = free - size
                break
        else:
            bins.append([key])
            room.append(budget - size)
    return bins


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(min_value=0, max_value=300),
    sizes=st.lists(st.integers(min_value=0, max_value=300), max_size=130),
)
def test_ffd_equals_the_scan_of_every_bin(budget, sizes):
    items = [(i, min(s, budget)) for i, s in enumerate(sizes)]
    assert first_fit_decreasing(items, budget) == _ffd_by_scan(items, budget)


def test_ffd_refuses_an_item_over_the_budget():
    with pytest.raises(ValueError):
        first_fit_decreasing([("a", 3), ("b", 11)], 10)
    with pytest.raises(ValueError):
        first_fit_decreasing([("a", -1)], 10)


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(min_value=1, max_value=200),
    sizes=st.lists(st.integers(min_value=0, max_value=200), max_size=60),
)
def test_ffd_properties(budget, sizes):
    items = [(i, min(s, budget)) for i, s in enumerate(sizes)]
    bins = first_fit_decreasing(items, budget)
    placed = [k for b in bins for k in b]
    assert sorted(placed) == [k for k, _ in items]
    size = dict(items)
    fills = [sum(size[k] for k in b) for b in bins]
    assert all(f <= budget for f in fills)
    assert sum(1 for f in fills if 2 * f <= budget) <= 1
    assert len(bins) <= max(1, 2 * math.ceil(sum(size.values()) / budget) + 1) or not items
    assert bins == first_fit_decreasing(items, budget)


def test_ffd_refuses_an_item_larger_than_the_budget():
    with pytest.raises(ValueError):
        first_fit_decreasing([("a", 11)], 10)


def test_ffd_packs_a_known_case_optimally():
    bins = first_fit_decreasing([("a", 5), ("b", 5), ("c", 4), ("d", 3), ("e", 3)], 10)
    assert bins == [["a", "b"], ["c", "d", "e"]]


async def test_sealed_batch_total_tokens_and_budget():
    p, _, _ = tk.make_packer(batch_size=4, micro_step_token_budget=50, emit_fill_fraction=0.8)
    expected_loss = 0
    for g in range(4):
        await tk.feed_group(p, f"g{g}", size=3, turns=2, prompt=5 + g, output=3 + 2 * g)
        expected_loss += 3 * 2 * (3 + 2 * g)
    got = []
    while True:
        r = await p.claim("c", 1, 0, 0)
        if r.outcome is not ClaimOutcome.CLAIMED:
            break
        got.append(r.micro_step)
        await p.ack("c", 1, r.micro_step.micro_step_id)
    status = p.batch_status(1)
    assert status["sealed"] and status["total_tokens"] == expected_loss
    assert sum(m.loss_tokens for m in got) == expected_loss
    assert all(m.packed_tokens <= 50 for m in got)
    assert sum(len(m.sequences) for m in got) == 4 * 3 * 2


async def test_an_emit_of_a_segment_not_pending_is_refused_and_changes_nothing():
    """The batch's pending segments are an ordered set (an emit takes its own out in O(its
    size)); an emit that names a segment not pending is a bug (FatalError) caught before
    anything changes."""
    from gyre.errors import FatalError

    p, _, _ = tk.make_packer(batch_size=2, micro_step_token_budget=8, emit_fill_fraction=1.0)
    for g in ("g1", "g2"):
        await tk.feed_group(p, g, size=2)
    await p.claim("a", 0, 0, 0)  # activates: the four segments are packed, one per micro-step
    batch = p.state.batches[1]
    ms = batch.micro_steps[0]
    before = tk.snapshot(p.state)
    for seqs in ([list(ms.seqs[0])], [["g9-x0", 0]]):
        with pytest.raises(FatalError):
            p.state.apply({"t": "emit", "b": 1, "ms": "b1-mX", "seqs": seqs})
    assert tk.snapshot(p.state) == before
