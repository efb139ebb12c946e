"""Turn records reach the packer even when it is slow or down for a while (retried; the
harness never waits), are dropped (and counted) only when the bounded buffer overflows, and
a record the packer refuses as malformed is not retried forever."""

from __future__ import annotations

import asyncio

from gyre.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.router.turns import Turn, TurnRecorder


def turn(i: int) -> Turn:
    return Turn("e1", "g", i, (1, 2), (3,), (-0.1,), (1,))


class FlakySink:
    def __init__(self, failures: int, delay_s: float = 0.0) -> None:
        self.failures = failures
        self.delay_s = delay_s
        self.got: list[int] = []
        self.calls = 0

    async def record(self, t: Turn) -> None:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable("packer down")
        if t.turn_index < 0:
            raise InvalidArgument("bad turn")
        self.got.append(t.turn_index)


async def _no_sleep(_: float) -> None:
    await asyncio.sleep(0)


async def test_retries_until_acknowledged():
    sink = FlakySink(failures=5)
    rec = TurnRecorder(sink=sink, senders=1, sleep=_no_sleep)
    task = asyncio.create_task(rec.run())
    for i in range(3):
        rec.submit(turn(i))
    assert await rec.flush(2.0)
    assert sorted(sink.got) == [0, 1, 2] and rec.sent == 3
    task.cancel()


async def test_submit_never_blocks_and_overflow_drops_oldest():
    sink = FlakySink(failures=0, delay_s=10.0)  # a packer that hangs
    rec = TurnRecorder(sink=sink, capacity=3, senders=1)
    task = asyncio.create_task(rec.run())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i in range(10):
        rec.submit(turn(i))
    assert loop.time() - t0 < 1.0
    assert rec.dropped >= 6
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_refused_turn_is_not_retried():
    sink = FlakySink(failures=0)
    rec = TurnRecorder(sink=sink, senders=2, sleep=_no_sleep)
    task = asyncio.create_task(rec.run())
    rec.submit(turn(-1))
    rec.submit(turn(1))
    assert await rec.flush(2.0)
    assert sink.got == [1] and rec.rejected == 1 and sink.calls == 2
    task.cancel()


async def test_oversized_turn_is_not_retried():
    class TooBig(FlakySink):
        async def record(self, t: Turn) -> None:
            self.calls += 1
            raise ResourceExhausted("turn exceeds the micro-step token budget")

    sink = TooBig(failures=0)
    rec = TurnRecorder(sink=sink, senders=1, sleep=_no_sleep)
    task = asyncio.create_task(rec.run())
    rec.submit(turn(0))
    assert await rec.flush(2.0)
    assert rec.rejected == 1 and sink.calls == 1
    task.cancel()


async def test_no_packer_configured_is_a_no_op():
    rec = TurnRecorder(sink=None)
    rec.submit(turn(0))
    assert rec.pending == 0


class TakenSink:
    """A packer that already holds turns 0 and 1 of e1 with other content (a router restart)."""

    def __init__(self) -> None:
        self.held = {0: "old", 1: "old"}

    async def record(self, t: Turn) -> None:
        from gyre.errors import FailedPrecondition

        if self.held.get(t.turn_index, "new") != "new":
            raise FailedPrecondition(
                f"turn {t.turn_index} of {t.execution_id} was recorded with other content"
            )
        self.held[t.turn_index] = "new"


async def test_taken_index_is_renumbered_not_lost():
    from services.router.calls import CallPolicy
    from services.router.manager import CallManager
    from services.router.routes import RouteTable

    sink = TakenSink()
    rec = TurnRecorder(sink=sink, senders=1, sleep=_no_sleep)
    mgr = CallManager(routes=RouteTable(), engines=None, policy=CallPolicy(), turns=rec)  # type: ignore[arg-type]
    task = asyncio.create_task(rec.run())
    rec.submit(turn(0))
    assert await rec.flush(2.0)
    assert sink.held == {0: "old", 1: "old", 2: "new"} and rec.renumbered == 2 and rec.sent == 1
    assert mgr._turn_index["e1"] == 3  # the next turn of e1 goes after it
    task.cancel()


async def test_history_records_turns_recorded_refused_and_dropped(tmp_path):
    """With history_file set, the recorder's outcomes go to its history; the checker
    (apps/checker) flags the dropped ones as training data lost."""
    from apps.checker import check
    from gyre.history import History, read

    path = tmp_path / "router.jsonl"
    sink = FlakySink(failures=1)
    rec = TurnRecorder(
        sink=sink, capacity=2, senders=1, sleep=_no_sleep, history=History(str(path), svc="router")
    )
    for i in (0, 1, -1):  # the third overflows the buffer: turn 0 is dropped
        rec.submit(turn(i))
    task = asyncio.create_task(rec.run())
    assert await rec.flush(2.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    ops = [op["op"] for op in read(path)]
    assert ops == ["start", "turn_dropped", "turn_recorded", "turn_refused"]
    v = check(read(path))
    assert v.counts == {"turns_recorded": 1, "turns_refused": 1, "turns_dropped": 1}
    assert len(v.violations) == 1 and "dropped" in v.violations[0]


async def test_submit_tells_when_the_packer_holds_the_turn():
    sink = FlakySink(failures=2)
    rec = TurnRecorder(sink=sink, senders=1, sleep=_no_sleep)
    task = asyncio.create_task(rec.run())
    ok, bad = rec.submit(turn(0)), rec.submit(turn(-1))
    assert ok is not None and bad is not None
    assert await TurnRecorder.wait_recorded(ok, 5.0) is True  # after two retries
    assert await TurnRecorder.wait_recorded(bad, 5.0) is False  # refused for good
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_waiting_for_a_record_is_bounded_and_never_cancels_it():
    sink = FlakySink(failures=0, delay_s=0.2)
    rec = TurnRecorder(sink=sink, senders=1)
    task = asyncio.create_task(rec.run())
    done = rec.submit(turn(0))
    assert done is not None
    assert await TurnRecorder.wait_recorded(done, 0.0) is False  # not yet
    assert await TurnRecorder.wait_recorded(done, 10.0) is True  # the send went on
    assert sink.got == [0]
    dropped = TurnRecorder(sink=sink, capacity=1, senders=1)
    first = dropped.submit(turn(1))
    dropped.submit(turn(2))  # overflow: the oldest is dropped, and says so
    assert first is not None and first.done() and first.result() is False
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
