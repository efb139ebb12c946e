"""The tagged-stream core the router's GenerateStream and the engine's GenerateStream share:
answers go out as lists in the order they are ready; with ``one_turn`` the requests woken
by one event answer in one list; ``close_when_idle`` ends the call once nothing is in
flight while the caller still sends."""

from __future__ import annotations

import asyncio

import pytest

from gyre.errors import InvalidArgument
from gyre.grpcx.tagged import TaggedRequests


async def _answer_on(calls: TaggedRequests[int], tag: int, event: asyncio.Event) -> None:
    await event.wait()
    calls.send(tag)


@pytest.mark.parametrize(("one_turn", "expected"), [(True, [[1, 2, 3]]), (False, [[1], [2, 3]])])
async def test_requests_woken_by_one_event_answer_in_one_list_with_one_turn(one_turn, expected):
    calls: TaggedRequests[int] = TaggedRequests(8)
    step, rest = asyncio.Event(), asyncio.Event()

    async def first() -> None:
        await step.wait()
        calls.send(1)  # wakes the serve loop before the others of this step run
        rest.set()

    async def read() -> None:
        calls.start(1, first(), "t1")
        for tag in (2, 3):
            calls.start(tag, _answer_on(calls, tag, rest), f"t{tag}")
        await asyncio.sleep(0.01)
        step.set()

    got = [answers async for answers in calls.serve(read, one_turn=one_turn)]
    assert got == expected


async def test_close_when_idle_ends_the_call_while_the_caller_still_sends():
    calls: TaggedRequests[int] = TaggedRequests(8)
    done = asyncio.Event()
    forever = asyncio.Event()

    async def read() -> None:
        calls.start(1, _answer_on(calls, 1, done), "t1")
        await forever.wait()  # the caller never ends its request stream

    async def stop() -> None:
        await asyncio.sleep(0.01)
        calls.close_when_idle()  # request 1 still in flight: the call goes on
        await asyncio.sleep(0.01)
        done.set()

    stopper = asyncio.create_task(stop())
    got = await asyncio.wait_for(_collect(calls.serve(read)), 5)
    await stopper
    assert got == [[1]]


async def test_a_tag_reused_in_flight_ends_the_call():
    calls: TaggedRequests[int] = TaggedRequests(8)
    never = asyncio.Event()

    async def read() -> None:
        calls.start(1, _answer_on(calls, 1, never), "t1")
        calls.check_tag(1)

    with pytest.raises(InvalidArgument, match="already in flight"):
        await _collect(calls.serve(read))


async def _collect(answers) -> list[list[int]]:
    return [a async for a in answers]
