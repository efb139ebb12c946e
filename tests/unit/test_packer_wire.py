"""Pre-encoded claim answers (config ``pre_encode``, services.packer.model.WireCache): the
bytes a claim answers, concatenated from sequences encoded once when their group became
ready, are exactly what building and serializing the protos gives (byte for byte, and so
they parse to the same message), for one micro-step and for several, with and without
one, across length prefixes of 1 to 3 bytes; a wrong concatenation is caught; a
redelivered micro-step (lapsed claim, retaken) gets the same bytes; a cache entry made
from other content is never served; entries go with their executions."""

from __future__ import annotations

import random

import pytest
from google.protobuf.internal.encoder import _VarintBytes  # type: ignore[attr-defined]
from google.protobuf.message import DecodeError

from services.packer import model
from services.packer.model import ClaimOutcome, MicroStepView, PackedSequence, WireCache
from services.packer.packer import Packer
from testkit import packer_kit as tk

ClaimsResponse = model.packer_pb2.ClaimMicroStepsResponse


async def _feed(p: Packer, g: str, size: int, rng: random.Random, version: int = 0) -> None:
    """A group whose executions have two turns of one segment (the second prompt extends the
    first turn) with a partial loss mask, and a single-turn execution: varied sequences."""
    for k in range(size):
        x = f"{g}-x{k}"
        prompt = [rng.randrange(200_000) for _ in range(rng.randint(20, 200))]
        out1 = [rng.randrange(200_000) for _ in range(rng.randint(5, 150))]
        mask1 = [rng.randint(0, 1) for _ in out1]
        t1 = tk.turn(
            x, g, 0, output_ids=out1, prompt_ids=prompt, logprobs=[-rng.random() for _ in out1],
            versions=[version + rng.randint(0, 2) for _ in out1], mask=mask1,
        )  # fmt: skip
        await p.record_turn(t1)
        if k % 3:
            prompt2 = prompt + out1 + [rng.randrange(200_000) for _ in range(rng.randint(1, 30))]
            out2 = [rng.randrange(200_000) for _ in range(rng.randint(5, 150))]
            t2 = tk.turn(
                x, g, 1, output_ids=out2, prompt_ids=prompt2, logprobs=[-rng.random() for _ in out2],
                versions=[version] * len(out2),
            )  # fmt: skip
            await p.record_turn(t2)
        await p.report_finish(tk.finish(x, g, size, reward=float(k) - 1.5, version=version))


async def _packer(budget: int = 1200, groups: int = 3, **kw: object) -> tuple[Packer, tk.ManualClock]:
    p, _, clock = tk.make_packer(batch_size=groups, micro_step_token_budget=budget, **kw)
    rng = random.Random(7)
    for g in range(groups):
        await _feed(p, f"g{g}", 5, rng)
    return p, clock


def _old_many(first: model.ClaimResult, views: list[MicroStepView]) -> bytes:
    return first.to_proto_many(views).SerializeToString()


@pytest.mark.parametrize("budget", [600, 1200, 4096])
async def test_pre_encoded_answers_are_the_old_answers_byte_for_byte(budget: int) -> None:
    p, _ = await _packer(budget)
    assert len(p.wire) > 0 and p.wire.misses == 0  # encoded when the groups became ready
    n = 0
    while True:
        first, views = await p.claim_many(f"cell{n % 3}", 1, 0, 0, "", 1 + n % 5)
        new = first.encode_many(p.wire.micro_step(v) for v in views)
        assert new == _old_many(first, views)
        assert ClaimsResponse.FromString(new) == first.to_proto_many(views)
        n += 1
        if first.outcome is ClaimOutcome.CLOSED:
            assert (
                not views and ClaimsResponse.FromString(new).outcome == model.packer_pb2.CLAIM_OUTCOME_CLOSED
            )
            break
        await p.ack_many(f"cell{(n - 1) % 3}", 1, [v.micro_step_id for v in views])
    assert p.wire.misses == 0 and p.wire.hits > 0  # nothing encoded on the claim path
    # A claim without a micro-step (WAIT on the next, empty batch) encodes alike.
    wait = await p.claim("c", 2, 0, 0)
    assert wait.outcome is ClaimOutcome.WAIT
    assert wait.encode_many([]) == wait.to_proto_many([]).SerializeToString()


async def test_length_prefixes_of_every_size_are_right() -> None:
    for n in [*range(300), 16_383, 16_384, 2_097_151, 2_097_152, 1 << 40]:
        assert model._varint(n) == _VarintBytes(n)
    # A micro-step over 16 KiB: its length prefix in the response takes 3 bytes.
    p, _ = await _packer(budget=4096, groups=4)
    first, views = await p.claim_many("a", 1, 0, 0, "", 64)
    sizes = [len(p.wire.micro_step(v)) for v in views]
    assert max(sizes) >= 16_384, sizes
    assert first.encode_many(p.wire.micro_step(v) for v in views) == _old_many(first, views)


async def test_a_wrong_concatenation_is_caught() -> None:
    """The comparison above would fail on any slip in framing or order."""
    p, _ = await _packer(budget=600)
    first, views = await p.claim_many("a", 1, 0, 0, "", 3)
    assert len(views) == 3 and len(views[0].sequences) >= 2
    good = [p.wire.micro_step(v) for v in views]
    old = first.to_proto_many(views)
    swapped = first.encode_many([good[1], good[0], good[2]])
    assert swapped != _old_many(first, views) and ClaimsResponse.FromString(swapped) != old
    # A micro-step whose sequences are framed without their tag, or with a length one short.
    seqs = [p.wire.get(s) for s in views[0].sequences]
    untagged = (
        views[0].encode(seqs).replace(model._LEN_FIELD_3 + model._varint(len(seqs[0])) + seqs[0], seqs[0])
    )
    with pytest.raises(DecodeError):
        model.packer_pb2.MicroStep.FromString(untagged)
    short = first.encode_many([good[0][:-1], *good[1:]])
    with pytest.raises(DecodeError):
        ClaimsResponse.FromString(short)
    # Sequence bytes of another micro-step: parses, but not to the old answer.
    mixed = first.encode_many([views[0].encode([p.wire.get(s) for s in views[1].sequences]), *good[1:]])
    assert ClaimsResponse.FromString(mixed) != old


async def test_a_redelivered_micro_step_gets_the_same_bytes() -> None:
    p, clock = await _packer(budget=600)
    first, views = await p.claim_many("a", 1, 0, 0, "k", 2)
    before = {v.micro_step_id: p.wire.micro_step(v) for v in views}
    clock.advance(p.cfg.claim_ttl_s + 1)  # a's claims lapse; b retakes them
    await p.reap()
    again: dict[str, bytes] = {}
    while set(before) - set(again):
        _, more = await p.claim_many("b", 1, 0, 0, "", 64)
        assert more
        again.update((v.micro_step_id, p.wire.micro_step(v)) for v in more)
    assert {m: again[m] for m in before} == before
    # And a retried claim (same claim id) by the holder answers the same bytes too.
    first2, views2 = await p.claim_many("b", 1, 0, 0, "k2", 1)
    retry, views3 = await p.claim_many("b", 1, 0, 0, "k2", 1)
    assert first2.encode_many(p.wire.micro_step(v) for v in views2) == retry.encode_many(
        p.wire.micro_step(v) for v in views3
    )


async def test_an_entry_made_from_other_content_is_not_served() -> None:
    cache = WireCache()
    a = tk.turn("x", "g", 0, output=3)
    b = tk.turn("x", "g", 0, output=3, logprobs=[-0.25] * 3)  # same key, other content
    seq_a = PackedSequence(model.Segment((a,)), 1.0, 0)
    data_a = cache.put(seq_a)
    assert cache.get(seq_a) == data_a and cache.hits == 1
    for other in (PackedSequence(model.Segment((b,)), 1.0, 0), PackedSequence(model.Segment((a,)), 2.0, 0)):
        assert cache.get(other) == other.to_proto().SerializeToString() != data_a
    assert cache.misses == 2
    assert cache.keep({"y"}) == 1 and len(cache) == 0


async def test_without_pre_encode_nothing_is_cached_and_claims_still_encode_alike() -> None:
    p, _ = await _packer(budget=600, pre_encode=False)
    assert len(p.wire) == 0
    first, views = await p.claim_many("a", 1, 0, 0, "", 4)
    assert first.encode_many(p.wire.micro_step(v) for v in views) == _old_many(first, views)


async def test_entries_go_with_their_executions() -> None:
    p, _ = await _packer(budget=600, groups=2)
    assert len(p.wire) > 0
    while True:
        first, views = await p.claim_many("a", 1, 0, 0, "", 64)
        if not views:
            break
        await p.ack_many("a", 1, [v.micro_step_id for v in views])
    assert p.batch_status(1)["done"]
    await p.reap()
    assert len(p.wire) == 0
