"""The sampling temperature travels with every turn: TurnRecord.temperature is validated
(finite, >= 0; a record without one has 1), kept in the WAL (an entry written before the
field reads as 1, and a turn at 1 is written as before, digest included), rebuilt by a
replay and a snapshot restore, and carried by each packed sequence; a turn sampled at
another temperature than the previous one starts a new segment (a sequence is scored at one
temperature)."""

from __future__ import annotations

import math

import grpc
import pytest

from gyre.errors import InvalidArgument, status_for
from gyre.v1 import packer_pb2
from services.packer.model import Turn
from services.packer.packer import Packer
from services.packer.segments import split_segments
from services.packer.snapshot import restore, to_event
from services.packer.state import PackerState
from services.packer.wal import Wal
from testkit import packer_kit as tk


def _episode(x: str, g: str, temps: list[float]) -> list[Turn]:
    """Token-consistent turns (each prompt = previous prompt + output + an observation)
    sampled at ``temps``."""
    out, context = [], [5, 6, 7]
    for i, temp in enumerate(temps):
        output = [100 + 10 * i, 101 + 10 * i]
        out.append(
            tk.turn(
                x, g, i, output=len(output), prompt_ids=list(context), output_ids=output, temperature=temp
            )
        )
        context = context + output + [50 + i]
    return out


def _boot(tmp_path) -> tuple[Packer, Wal]:
    wal = Wal(tmp_path)
    events = wal.open()
    packer = Packer(tk.config(batch_size=1, micro_step_token_budget=4096), wal, clock=tk.ManualClock())
    packer.recover(events)
    return packer, wal


async def test_temperature_round_trips_record_wal_replay_and_packed_sequence(tmp_path):
    p, wal = _boot(tmp_path)
    eps = {"g-x0": _episode("g-x0", "g", [0.7, 0.7, 0.7]), "g-x1": _episode("g-x1", "g", [0.0, 1.0])}
    for k, (x, turns) in enumerate(eps.items()):
        for t in turns:
            msg = t.to_proto()
            assert msg.HasField("temperature") and msg.temperature == t.temperature
            # The wire form reads back as the same turn (the router's record).
            assert Turn.from_proto(msg, 4096) == t
            await p.record_turn(Turn.from_proto(msg, 4096))
        await p.report_finish(tk.finish(x, "g", 2, reward=float(k)))
    await wal.close()

    events = Wal(tmp_path).open()
    turns = [ev["turn"] for ev in events if ev["t"] == "turn"]
    assert [t.get("T") for t in turns] == [0.7, 0.7, 0.7, 0.0, None]  # 1 is written as before
    replayed = tk.replayed(events)
    assert tk.snapshot(replayed) == tk.snapshot(p.state)
    for x, ts in eps.items():
        assert [replayed.execs[x].turns[t.turn_index].temperature for t in ts] == [t.temperature for t in ts]
    restored = PackerState()
    restore(restored, to_event(p.state))
    assert {x: [t.temperature for t in e.turns.values()] for x, e in restored.execs.items()} == {
        x: [t.temperature for t in ts] for x, ts in eps.items()
    }

    # A packer recovered from the WAL packs them: each sequence carries its turns' temperature.
    p2, wal2 = _boot(tmp_path)
    await p2.reap()
    claim = await p2.claim("c", 0, 0, 0)
    assert claim.micro_step is not None
    got = sorted(
        (s.execution_id, s.turn_index, s.turns, s.temperature)
        for s in (packer_pb2.PackedSequence.FromString(s.encode()) for s in claim.micro_step.sequences)
    )
    assert got == [("g-x0", 0, 3, pytest.approx(0.7)), ("g-x1", 0, 1, 0.0), ("g-x1", 1, 1, 1.0)]
    for s in claim.micro_step.sequences:
        assert s.to_proto().HasField("temperature")
    await wal2.close()


def test_a_temperature_change_starts_a_new_segment():
    turns = _episode("x", "g", [1.0, 1.0, 0.5, 0.5, 1.0, 0.0, 0.0])
    assert split_segments(dict(enumerate(turns))) == [(0, 1), (2, 3), (4,), (5, 6)]
    same = _episode("x", "g", [0.3] * 4)
    assert split_segments(dict(enumerate(same))) == [(0, 1, 2, 3)]


async def test_packed_segments_never_mix_temperatures():
    p, _, _ = tk.make_packer(batch_size=1, micro_step_token_budget=4096)
    eps = {"g-x0": _episode("g-x0", "g", [1.0, 0.6, 0.6]), "g-x1": _episode("g-x1", "g", [0.6, 0.6])}
    claim = await tk.claim_episodes(p, "g", eps)
    assert claim.micro_step is not None
    seqs = sorted(
        (s.segment.last.execution_id, [t.turn_index for t in s.segment.turns], s.to_proto().temperature)
        for s in claim.micro_step.sequences
    )
    assert seqs == [
        ("g-x0", [0], 1.0),
        ("g-x0", [1, 2], pytest.approx(0.6)),
        ("g-x1", [0, 1], pytest.approx(0.6)),
    ]


def test_a_wal_entry_from_before_the_field_reads_as_temperature_1():
    t = tk.turn("x", "g", 0)
    old = t.to_json()
    assert "T" not in old  # a turn at 1 is written exactly as before the field existed
    assert Turn.from_json(old).temperature == 1.0 and Turn.from_json(old) == t
    # Unset on the wire (a router from before the field) is 1 too; the digest of a turn at 1
    # is the one it had before the field (snapshots keep digests).
    msg = tk.turn_proto("x", "g", 0)
    assert not msg.HasField("temperature")
    legacy = Turn.from_proto(msg, 1 << 20)
    assert legacy.temperature == 1.0
    msg.temperature = 1.0
    assert Turn.from_proto(msg, 1 << 20).digest() == legacy.digest()
    msg.temperature = 0.5
    assert Turn.from_proto(msg, 1 << 20).digest() != legacy.digest()
    assert Turn.from_proto(msg, 1 << 20).to_json()["T"] == 0.5


def test_negative_zero_is_zero():
    t = tk.turn("x", "g", 0, temperature=-0.0)
    assert t.temperature == 0.0 and math.copysign(1.0, t.temperature) == 1.0


@pytest.mark.parametrize("temp", [float("nan"), float("inf"), -float("inf"), -0.1, -1e-300])
async def test_an_invalid_temperature_is_refused_and_nothing_recorded(temp):
    p, log, _ = tk.make_packer()
    await tk.feed_group(p, "g0", size=2)
    before, n = tk.snapshot(p.state), len(log.events)
    msg = tk.turn_proto("x0", "g", 0)
    msg.temperature = temp
    with pytest.raises(InvalidArgument, match="temperature") as err:
        await p.record_turn(Turn.from_proto(msg, p.cfg.micro_step_token_budget))
    assert status_for(err.value)[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert tk.snapshot(p.state) == before and len(log.events) == n
    assert "x0" not in p.state.execs
