"""A model call sent again after its router died carries the call's idempotency key; the
packer keeps one turn per key: the answer the harness got.

The failure this guards (seen in CI, tests/fault/test_router_packer_failpoints.py with the
router dying at ``router.turn.recorded``): the router records a call's turn, dies before
answering; the harness retries the call at the restarted router, whose turn counter starts
again at 0; when the retry's tokens differ from the first try's (a new policy version came
between), the renumbered retry was recorded as a second turn of the same call: 169 turns
for 168 answered calls."""

from __future__ import annotations

import pytest

from gyre.errors import FailedPrecondition, InvalidArgument
from services.packer.model import Turn
from services.packer.snapshot import compacted
from testkit import packer_kit as tk


async def _three_turns(p, key: str = "call-2"):
    await p.record_turn(tk.turn("x0", "g", 0, call_key="call-0"))
    await p.record_turn(tk.turn("x0", "g", 1, prompt=6, call_key="call-1"))
    await p.record_turn(tk.turn("x0", "g", 2, prompt=8, version=0, call_key=key))


async def test_a_retry_with_the_same_answer_is_a_duplicate_at_any_index():
    p, log, _ = tk.make_packer()
    await _three_turns(p)
    n = len(log.events)
    # The restarted router numbers the retry 0 (its counter starts again).
    assert await p.record_turn(tk.turn("x0", "g", 0, prompt=8, call_key="call-2")) is True
    assert len(log.events) == n
    assert sorted(p.state.execs["x0"].turns) == [0, 1, 2] and p.state.produced == 3


async def test_a_retry_with_another_answer_replaces_the_first_try_at_its_index():
    p, log, _ = tk.make_packer()
    await _three_turns(p)
    retry = tk.turn("x0", "g", 0, prompt=8, version=1, output_ids=range(200, 204), call_key="call-2")
    assert await p.record_turn(retry) is False
    ex = p.state.execs["x0"]
    assert sorted(ex.turns) == [0, 1, 2]  # one turn per call: nothing recorded twice
    assert ex.turns[2].output == (200, 201, 202, 203) and ex.turns[2].versions == (1,) * 4
    assert ex.turns[1].prompt == tuple(range(1, 7))  # the others untouched
    assert p.state.produced == 3 and p.counters()["turns_replaced"] == 1
    p.state.check(deep=True)  # conservation: a replacement produced nothing new
    # Replaying the WAL, and a compacted snapshot, give the same state (the key included).
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)
    again = tk.replayed(compacted(p.state))
    assert tk.snapshot(again) == tk.snapshot(p.state)
    assert again.execs["x0"].turns[2] == ex.turns[2] and again.execs["x0"].call_keys == ex.call_keys
    # The retry of the retry (same answer) is a duplicate now.
    assert await p.record_turn(retry) is True


async def test_a_key_sent_again_with_another_prompt_is_refused_and_changes_nothing():
    p, log, _ = tk.make_packer()
    await _three_turns(p)
    before, n = tk.snapshot(p.state), len(log.events)
    with pytest.raises(FailedPrecondition, match="another prompt"):
        await p.record_turn(tk.turn("x0", "g", 3, prompt=10, call_key="call-2"))
    assert tk.snapshot(p.state) == before and len(log.events) == n


async def test_turns_without_keys_keep_the_index_rules():
    p, _, _ = tk.make_packer()
    await p.record_turn(tk.turn("x0", "g", 0))
    with pytest.raises(FailedPrecondition, match="other content"):
        await p.record_turn(tk.turn("x0", "g", 0, output=5))
    # A new key at a taken index is another call: refused at that index (the router renumbers).
    with pytest.raises(FailedPrecondition, match="other content"):
        await p.record_turn(tk.turn("x0", "g", 0, output=5, call_key="k"))


@pytest.mark.parametrize("key", ["x" * 129, "has space", "tab\t", "ünï"])
def test_a_bad_key_is_invalid_argument(key):
    msg = tk.turn_proto("x0", "g", 0)
    msg.idempotency_key = key
    with pytest.raises(InvalidArgument, match="idempotency key"):
        Turn.from_proto(msg, 1 << 16)


def test_a_good_key_travels_through_the_wal_form():
    msg = tk.turn_proto("x0", "g", 0)
    msg.idempotency_key = "a" * 128
    t = Turn.from_proto(msg, 1 << 16)
    assert Turn.from_json(t.to_json()) == t and t.call_key == "a" * 128
    assert "k" not in tk.turn("x0", "g", 0).to_json()  # no key: the WAL form as before


async def test_where_a_call_stands_for_any_router():
    """GetTrajectory: the turn a new call continues and the index its turn takes; a retry
    (the key of a call the packer holds) stands where its first try stood."""
    p, _, _ = tk.make_packer()
    assert p.trajectory("x0") == (None, 0)
    await _three_turns(p)
    last, index = p.trajectory("x0")
    assert index == 3 and last is not None and last.turn_index == 2
    last, index = p.trajectory("x0", "call-2")
    assert index == 2 and last is not None and last.turn_index == 1
    assert p.trajectory("x0", "call-0") == (None, 0)
    assert p.trajectory("x0", "new-call")[1] == 3
    with pytest.raises(InvalidArgument):
        p.trajectory("x0", "has space")
    with pytest.raises(InvalidArgument):
        p.trajectory("")


def test_a_chat_state_travels_through_the_wal_form_and_is_bounded():
    t = tk.turn("x0", "g", 0, chat_state="c1:2:ab:cd:ef")
    assert Turn.from_json(t.to_json()) == t and Turn.from_proto(t.to_proto(), 1 << 16) == t
    assert t.digest() == tk.turn("x0", "g", 0).digest()  # not part of the content
    assert "c" not in tk.turn("x0", "g", 0).to_json()
    with pytest.raises(InvalidArgument, match="chat_state"):
        tk.turn("x0", "g", 0, chat_state="x" * 257)
