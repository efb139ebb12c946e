"""Each trajectory segment is trained once: consecutive turns of an execution whose prompts
extend the previous turn's tokens are packed as one sequence (every token once, the loss
mask on generated tokens only, each generated token's log-prob and policy version at its
place); a turn that does not extend its predecessor (history edited) starts a new segment;
a micro-step's packed tokens are the sum of its segments' lengths; conservation still
counts turns; a WAL replay and a snapshot restore rebuild the same segments; an ``assign``
event written before segments existed replays as one sequence per turn."""

from __future__ import annotations

import random

from services.packer.segments import split_segments
from services.packer.snapshot import restore, to_event
from services.packer.state import PackerState
from testkit import packer_kit as tk


async def _run(budget: int = 4096):
    rng = random.Random(5)
    p, log, _ = tk.make_packer(batch_size=1, micro_step_token_budget=budget)
    eps = {"g-x0": tk.episode("g-x0", "g", 5, rng), "g-x1": tk.episode("g-x1", "g", 4, rng, edit_at=2)}
    claim = await tk.claim_episodes(p, "g", eps)
    return p, log, eps, claim


async def test_one_sequence_per_segment():
    p, _, eps, claim = await _run()
    assert claim.micro_step is not None
    seqs = sorted(
        claim.micro_step.sequences, key=lambda s: (s.segment.last.execution_id, s.segment.turns[0].turn_index)
    )
    assert [(s.segment.last.execution_id, [t.turn_index for t in s.segment.turns]) for s in seqs] == [
        ("g-x0", [0, 1, 2, 3, 4]),
        ("g-x1", [0, 1]),
        ("g-x1", [2, 3]),
    ]
    for s in seqs:
        msg = s.to_proto()
        last = s.segment.last
        assert list(msg.token_ids) == list(last.prompt) + list(last.output)
        assert msg.turns == len(s.segment.turns)
        for t in s.segment.turns:
            at = len(t.prompt)
            assert list(msg.token_ids[at : at + len(t.output)]) == list(t.output)
            assert list(msg.loss_mask[at : at + len(t.output)]) == list(t.mask)
            assert list(msg.token_policy_versions[at : at + len(t.output)]) == list(t.versions)
            assert list(msg.logprobs[at : at + len(t.output)]) == [
                lp if m else 0.0 for lp, m in zip(t.logprobs, t.mask)
            ]
        assert sum(msg.loss_mask) == sum(t.loss_tokens for t in s.segment.turns)
        assert s.policy_version == min(v for t in s.segment.turns for v in t.versions)
    ms = claim.micro_step
    assert ms.packed_tokens == sum(len(s.segment.last.prompt) + len(s.segment.last.output) for s in seqs)
    assert ms.packed_tokens < sum(t.tokens for turns in eps.values() for t in turns)
    assert ms.loss_tokens == sum(t.loss_tokens for turns in eps.values() for t in turns)
    counters = p.state.counters()
    assert counters["packed"] == 9 and counters["produced"] == 9
    await p.ack("c", ms.batch_id, ms.micro_step_id)
    assert p.state.counters()["consumed"] == 9


async def test_replay_and_snapshot_rebuild_segments():
    p, log, _, _ = await _run()
    replayed = PackerState()
    for ev in log.events:
        replayed.apply(ev)
    assert tk.snapshot(replayed) == tk.snapshot(p.state)
    restored = PackerState()
    restore(restored, to_event(p.state))
    assert {x: e.segments for x, e in restored.execs.items()} == {
        x: e.segments for x, e in p.state.execs.items()
    }
    assert restored.segment(("g-x1", 2)).tokens == p.state.segment(("g-x1", 2)).tokens


async def test_old_assign_events_replay_a_turn_each():
    _, log, _, _ = await _run()
    replayed = PackerState()
    for ev in log.events:
        if ev["t"] == "assign":
            ev = {k: v for k, v in ev.items() if k != "segs"}
        if ev["t"] == "emit":
            break
        replayed.apply(ev)
    batch = replayed.batches[1]
    assert len(batch.pending) == 9


def test_split_segments_rule():
    rng = random.Random(1)
    turns = {t.turn_index: t for t in tk.episode("x", "g", 6, rng, edit_at=4)}
    assert split_segments(turns) == [(0, 1, 2, 3), (4, 5)]
    # A missing record: turn 3 still extends turn 1 (turn 2's tokens are context in it, not
    # trained, since nothing recorded their log-probs).
    del turns[2]
    assert split_segments(turns) == [(0, 1, 3), (4, 5)]


async def test_emits_sum_what_the_segments_hold_and_turns_cache_their_sums():
    """A micro-step's counts (computed from the executions' segments without building a
    Segment) equal the Segment sums; a Turn's cached loss tokens and oldest version equal
    the plain sums, and the cache does not change equality."""
    from services.packer.model import Turn
    from services.packer.segments import Segment

    p, _, _ = tk.make_packer(batch_size=3, micro_step_token_budget=40)
    for g in range(3):
        await tk.feed_group(p, f"g{g}", size=3, turns=3, prompt=3 + g, output=2 + g)
    await p.claim("c", 0, 0, 0)  # activates and packs the batch
    st = p.state
    batch = st.batches[1]
    assert batch.micro_steps
    for ms in batch.micro_steps:
        segs: list[Segment] = [st.segment(r) for r in ms.seqs]
        assert ms.n_seqs == sum(len(s.turns) for s in segs)
        assert ms.loss_tokens == sum(sum(t.mask) for s in segs for t in s.turns)
        assert ms.packed_tokens == sum(s.tokens for s in segs) == sum(st.segment_tokens(r) for r in ms.seqs)
    t = Turn.validated("x", "g", 0, [1, 2], [3, 4, 5], [-0.1] * 3, [7, 5, 6], [1, 0, 1], 100)
    fresh = Turn.validated("x", "g", 0, [1, 2], [3, 4, 5], [-0.1] * 3, [7, 5, 6], [1, 0, 1], 100)
    assert (t.loss_tokens, t.oldest_version(9)) == (2, 5)
    assert t == fresh and hash(t) == hash(fresh)
    assert Turn.validated("x", "g", 0, [1], [3], [-0.1], [], [1], 100).oldest_version(9) == 9
