"""Packer durability: the WAL replays to exactly the state that wrote it; a torn last line
is cut off and a corrupt middle line is quarantined with everything intact recovered; a packer restarted mid-batch from
its WAL loses no trajectory, packs none twice, keeps claims held across the restart, and
every turn is trained exactly once."""

from __future__ import annotations

import random

import pytest

from gyre.errors import FailedPrecondition, FatalError
from services.packer.model import ClaimOutcome
from services.packer.packer import Packer
from services.packer.wal import MemoryLog, Wal
from testkit import packer_kit as tk


async def _scenario(p):
    await tk.feed_group(p, "g1", size=2, turns=2)
    await tk.feed_group(p, "g2", size=2, turns=1)
    r = await p.claim("a", 0, 0, 0)
    await p.ack("a", 1, r.micro_step.micro_step_id)
    await p.claim("b", 0, 0, 0)
    await tk.feed_group(p, "g3", size=3, turns=1)


async def test_wal_replays_to_the_same_state(tmp_path):
    wal = Wal(tmp_path, fsync=True)
    assert wal.open() == []
    p = Packer(tk.config(batch_size=2, micro_step_token_budget=16), wal, clock=tk.ManualClock())
    p.recover([])
    await _scenario(p)
    await wal.close()
    events = Wal(tmp_path).open()
    assert tk.snapshot(tk.replayed(events)) == tk.snapshot(p.state)
    assert wal.flushes >= 1 and wal.bytes_written == (tmp_path / "packer.wal").stat().st_size


async def test_torn_tail_is_cut(tmp_path):
    wal = Wal(tmp_path)
    wal.open()
    p = Packer(tk.config(), wal, clock=tk.ManualClock())
    p.recover([])
    await tk.feed_group(p, "g1", size=2)
    await wal.close()
    path = tmp_path / "packer.wal"
    good = path.read_bytes()
    n = len(Wal(tmp_path).open())
    path.write_bytes(good + b'0000abcd {"t":"tu')  # a crash in the middle of a write
    assert len(Wal(tmp_path).open()) == n
    assert path.read_bytes() == good


async def test_corrupt_middle_record_is_quarantined_and_the_rest_recovered(tmp_path):
    wal = Wal(tmp_path)
    wal.open()
    p = Packer(tk.config(), wal, clock=tk.ManualClock())
    p.recover([])
    await tk.feed_group(p, "g1", size=2)
    await tk.feed_group(p, "g2", size=3, turns=2)
    await wal.close()
    path = tmp_path / "packer.wal"
    lines = path.read_bytes().split(b"\n")
    original = Wal(tmp_path).open()
    bad = next(n for n, raw in enumerate(lines) if b'"g2-x1"' in raw and b'"t":"turn"' in raw)
    lines[bad] = lines[bad].replace(b'"g2"', b'"gX"')  # a flipped byte: the checksum fails
    path.write_bytes(b"\n".join(lines))
    reopened = Wal(tmp_path)
    events = reopened.open()  # before: FatalError, the packer crash-looped
    assert reopened.quarantined == [bad + 1]
    assert events == original[:bad] + original[bad + 1 :]
    (moved,) = tmp_path.glob("packer.wal.quarantine.*")
    assert lines[bad] in moved.read_bytes() and f"# line {bad + 1} of".encode() in moved.read_bytes()
    q = Packer(tk.config(), reopened, clock=tk.ManualClock())
    q.recover(events)
    q.state.check(deep=True)
    assert q.state.produced == 2 + 6 - 1  # every intact turn is back
    assert ("g2-x2", 1) in q.state.seen_turns and ("g2-x1", 0) not in q.state.seen_turns
    await reopened.close()
    again = Wal(tmp_path)
    assert again.open() == events and again.quarantined == []  # the log was rewritten clean


async def test_an_event_that_depends_on_a_lost_record_is_set_aside(tmp_path):
    events = [{"t": "batch", "b": 1, "size": 2}, {"t": "claim", "ms": "b1-m0", "cell": "a"}]
    p = Packer(tk.config(), MemoryLog(), clock=tk.ManualClock())
    assert p.recover(events) == 1
    assert p.skipped == [1]


async def test_restart_mid_batch_loses_nothing_and_trains_each_turn_once(tmp_path):
    random.seed(3)
    cfg = dict(batch_size=6, micro_step_token_budget=24, emit_fill_fraction=0.9, claim_ttl_s=5.0)
    clock = tk.ManualClock()

    def boot():
        wal = Wal(tmp_path)
        events = wal.open()
        packer = Packer(tk.config(**cfg), wal, clock=clock)
        packer.recover(events)
        return packer, wal

    trained: list[tuple[str, int]] = []
    p, wal = boot()
    for g in range(3):
        await tk.feed_group(p, f"g{g}", size=2, turns=2, prompt=3, output=2 + g)
    held = await p.claim("a", 0, 0, 0)  # claimed, never acked before the crash
    r = await p.claim("b", 0, 0, 0)
    trained += [(t.execution_id, t.turn_index) for s in r.micro_step.sequences for t in s.segment.turns]
    await p.ack("b", 1, r.micro_step.micro_step_id)
    before = tk.snapshot(p.state)
    # Crash: no close; whatever was acknowledged to callers is on disk.
    p, wal = boot()
    assert tk.snapshot(p.state) == before
    # The claim held across the restart is still a's: nobody else gets it.
    others = []
    for g in range(3, 6):
        await tk.feed_group(p, f"g{g}", size=2, turns=2, prompt=3, output=2 + g % 3)
    while True:
        r = await p.claim("b", 1, 0, 0)
        if r.outcome is not ClaimOutcome.CLAIMED:
            break
        others.append(r.micro_step.micro_step_id)
        trained += [(t.execution_id, t.turn_index) for s in r.micro_step.sequences for t in s.segment.turns]
        await p.ack("b", 1, r.micro_step.micro_step_id)
    assert held.micro_step.micro_step_id not in others
    trained += [(t.execution_id, t.turn_index) for s in held.micro_step.sequences for t in s.segment.turns]
    assert await p.ack("a", 1, held.micro_step.micro_step_id) is False
    status = p.batch_status(1)
    assert status["done"]
    assert len(trained) == len(set(trained)) == 6 * 2 * 2
    c = p.state.counters()
    assert c["produced"] == c["consumed"] == 24
    await wal.close()


async def test_claim_held_across_restart_expires_after_ttl(tmp_path):
    clock = tk.ManualClock()
    wal = Wal(tmp_path)
    wal.open()
    p = Packer(tk.config(batch_size=1, micro_step_token_budget=16, claim_ttl_s=5.0), wal, clock=clock)
    p.recover([])
    await tk.feed_group(p, "g", size=2)
    r = await p.claim("dead", 0, 0, 0)
    clock.advance(100.0)  # the packer was down a long time: the TTL restarts at recovery
    wal2 = Wal(tmp_path)
    p2 = Packer(tk.config(batch_size=1, micro_step_token_budget=16, claim_ttl_s=5.0), wal2, clock=clock)
    p2.recover(wal2.open())
    assert await p2.reap() == 0
    clock.advance(5.1)
    assert await p2.reap() == 1
    r2 = await p2.claim("dead", 1, 0, 0)
    assert r2.micro_step.micro_step_id == r.micro_step.micro_step_id


async def test_snapshot_round_trips_and_compaction_keeps_everything(tmp_path):
    from services.packer.snapshot import compacted

    clock = tk.ManualClock()
    cfg = dict(batch_size=2, micro_step_token_budget=16, claim_ttl_s=5.0)
    wal = Wal(tmp_path)
    wal.open()
    p = Packer(tk.config(**cfg), wal, clock=clock)
    p.recover([{"t": "wal", "id": "abc"}])
    await _scenario(p)  # batch 1 done, batch 2 filling, a claim held, groups pending
    await p.record_turn(tk.turn("late-x0", "late", 0))
    await p.report_finish(tk.finish("x-drop", "drop", 1, reward=1.0))  # zero variance: dropped
    await wal.sync()
    before = tk.snapshot(p.state)
    size_before = (tmp_path / "packer.wal").stat().st_size
    # Events appended before the compaction, not yet flushed, are reflected by the snapshot.
    await p.record_turn(tk.turn("late-x1", "late", 0))
    size = await wal.compact(lambda: compacted(p.state))
    after_compact = tk.snapshot(p.state)
    assert after_compact != before  # the late turn is in
    assert tk.snapshot(tk.replayed(Wal(tmp_path).open())) == after_compact
    assert size == (tmp_path / "packer.wal").stat().st_size and wal.compactions == 1
    # The log goes on after the compaction, and a restart sees both.
    await p.report_finish(tk.finish("late-x0", "late", 2, reward=0.0))
    await p.report_finish(tk.finish("late-x1", "late", 2, reward=1.0))
    r = await p.claim("b", 0, 0, 0)
    assert r.outcome is ClaimOutcome.CLAIMED
    await wal.close()
    wal2 = Wal(tmp_path)
    events = wal2.open()
    assert events[0] == {"t": "wal", "id": "abc"} and events[1]["t"] == "snapshot"
    p2 = Packer(tk.config(**cfg), wal2, clock=clock)
    p2.recover(events)
    assert tk.snapshot(p2.state) == tk.snapshot(p.state)
    assert p2.state.wal_id == "abc"
    # Idempotency survives the compaction: a retried turn and finish are duplicates.
    assert await p2.record_turn(tk.turn("g1-x0", "g1", 0)) is True
    assert await p2.report_finish(tk.finish("g1-x0", "g1", 2, reward=0.0)) is True
    assert size_before > 0


async def test_idempotency_records_are_forgotten_after_dedupe_batches():
    p, log, _ = tk.make_packer(batch_size=1, micro_step_token_budget=64, dedupe_batches=2)
    for b in range(1, 5):
        await tk.feed_group(p, f"g{b}", size=2)
        r = await p.claim("c", b, 0, 0)
        await p.ack("c", b, r.micro_step.micro_step_id)
    # Batches 1..4 trained; the batch being filled is 5: groups of batches <= 3 forgotten.
    assert p.state.filling == 5
    assert set(p.state.forgettable) == {"g3", "g4"}
    assert ("g1-x0", 0) not in p.state.seen_turns and "g1-x0" not in p.state.finished
    assert await p.report_finish(tk.finish("g4-x0", "g4", 2, reward=0.0)) is True  # recent: dup
    with pytest.raises(FailedPrecondition):
        await p.report_finish(tk.finish("g1-x0", "g1", 2, reward=0.0))  # forgotten: refused
    with pytest.raises(FailedPrecondition):
        await p.record_turn(tk.turn("g1-x0", "g1", 0))
    assert tk.snapshot(tk.replayed(log.events)) == tk.snapshot(p.state)


async def test_a_failed_write_is_fatal(tmp_path):
    import asyncio

    wal = Wal(tmp_path)
    wal.open()

    def broken(data: bytes) -> None:
        raise OSError(5, "Input/output error")  # not a full disk: that one waits (below)

    wal._write = broken  # type: ignore[method-assign]
    watch = asyncio.create_task(wal.watch())
    wal.append({"t": "policy", "v": 1})
    with pytest.raises(OSError):
        await wal.sync()
    with pytest.raises(FatalError):
        wal.append({"t": "policy", "v": 2})
    with pytest.raises(FatalError):
        await asyncio.wait_for(watch, 1)  # the supervised task ends the process


async def test_a_full_disk_holds_writes_until_space_returns(tmp_path, monkeypatch):
    import asyncio

    from gyre.failpoints import FAILPOINT_ENV

    wal = Wal(tmp_path)
    wal.open()
    monkeypatch.setenv(FAILPOINT_ENV, "packer.wal.write=enospc")
    wal.append({"t": "policy", "v": 1})
    syncing = asyncio.create_task(wal.sync())
    while not wal.disk_full_pauses:
        await asyncio.sleep(0.01)
    assert not syncing.done()  # held, not failed
    monkeypatch.delenv(FAILPOINT_ENV)
    await asyncio.wait_for(syncing, 10)
    wal.append({"t": "policy", "v": 2})
    await wal.sync()
    await wal.close()
    assert Wal(tmp_path).open() == [{"t": "policy", "v": 1}, {"t": "policy", "v": 2}]


async def test_a_compaction_with_no_room_keeps_the_log_and_what_was_queued(tmp_path, monkeypatch):
    from gyre.failpoints import FAILPOINT_ENV

    wal = Wal(tmp_path)
    wal.open()
    wal.append({"t": "policy", "v": 1})
    await wal.sync()
    wal.append({"t": "policy", "v": 2})  # queued, not flushed: a snapshot would hold it
    monkeypatch.setenv(FAILPOINT_ENV, "packer.wal.compact=enospc")
    assert await wal.compact(lambda: [{"t": "policy", "v": 2}]) == 0
    assert wal.compactions == 0 and not wal.tmp_path().exists()
    monkeypatch.delenv(FAILPOINT_ENV)
    await wal.sync()
    await wal.close()
    assert Wal(tmp_path).open() == [{"t": "policy", "v": 1}, {"t": "policy", "v": 2}]


async def test_a_replay_holds_the_logs_lines_not_its_decoded_events(tmp_path):
    """A restarted packer replays its log without decoding it whole first: decoded, an event
    takes about eight times its line (token ids become int objects), and a packer that held a
    117 MB log's events peaked near 1 GB and kept ~700 MB resident after the replay."""
    import gc
    import tracemalloc

    wal = Wal(tmp_path)
    wal.open()
    p = Packer(tk.config(batch_size=64, micro_step_token_budget=4096), wal)
    p.recover([])
    for g in range(40):
        await tk.feed_group(p, f"g{g}", size=4, turns=3, prompt=300, output=200)
    await wal.sync()
    size = wal.path.stat().st_size
    assert size > 1_000_000  # a log worth measuring
    gc.collect()
    tracemalloc.start()
    try:
        reopened = Wal(tmp_path)
        events = reopened.open()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size, f"opening a {size:,} B log peaked at {peak:,} B"
    p2 = Packer(tk.config(batch_size=64, micro_step_token_budget=4096), reopened)
    p2.recover(events)  # the replay reads the events one by one, as before
    assert tk.snapshot(p2.state) == tk.snapshot(p.state)


def test_a_live_logs_durable_events_are_read_up_to_a_line_in_the_middle_of_its_write(tmp_path):
    """read_durable (Packer.ReadLog's reader) stops before a last line still being written,
    and hands the events out in chunks."""
    from services.packer.wal import WAL_NAME, encode, read_durable

    events = [{"t": "wal", "n": 0}] + [{"t": "policy", "v": v} for v in range(5)]
    path = tmp_path / WAL_NAME
    path.write_text("".join(encode(e) for e in events) + encode({"t": "policy", "v": 9})[:12])
    chunks = list(read_durable(path, chunk=4))
    assert [len(c) for c in chunks] == [4, 2]
    assert [e for c in chunks for e in c] == events
