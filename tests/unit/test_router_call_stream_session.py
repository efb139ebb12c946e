"""One GenerateStream's calls (``CallStreamSession``), with a stand-in for Generate: calls
that end together are answered in one message; a failed call gets its status and the
stream goes on; a cancel, even in the message that started the call, ends the call with no
answer; a call beyond the limit is RESOURCE_EXHAUSTED; a tag reused in flight ends the
stream with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from gyre.errors import InvalidArgument, PermissionDenied
from gyre.v1 import router_pb2 as pb
from services.router.call_stream import CallStreamSession


class Generate:
    """Answers a call once its execution's gate opens; "bad" tokens are refused."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.cancelled: list[str] = []
        self.answered: list[str] = []

    async def __call__(self, token: str, request: pb.GenerateRequest, part=None) -> list[pb.GenerateResponse]:
        if token == "bad":
            raise PermissionDenied("another execution's token")
        if part is not None:  # streamed: two parts, then the last answer
            part(pb.GenerateResponse(reroutes=100))
            part(pb.GenerateResponse(reroutes=101))
            return [pb.GenerateResponse(reroutes=102)]
        gate = self.gates.setdefault(request.execution_id, asyncio.Event())
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.execution_id)
            raise
        self.answered.append(request.execution_id)
        return [pb.GenerateResponse(reroutes=len(request.execution_id))]


def _call(tag: int, ex: str, token: str = "t") -> pb.StreamCall:
    return pb.StreamCall(tag=tag, token=token, request=pb.GenerateRequest(execution_id=ex))


async def _requests(
    queue: asyncio.Queue[pb.GenerateStreamRequest | None],
) -> AsyncIterator[pb.GenerateStreamRequest]:
    while (msg := await queue.get()) is not None:
        yield msg


async def test_answers_batched_failures_answered_cancels_silent_and_the_limit():
    generate = Generate()
    queue: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
    out = CallStreamSession(generate, max_calls=4).serve(_requests(queue))
    # Two calls, one cancelled in the very message that starts it, a refused one, and a
    # fifth beyond the limit of 4 in flight.
    await queue.put(
        pb.GenerateStreamRequest(
            calls=[_call(1, "a"), _call(2, "bb"), _call(5, "e"), _call(3, "c", "bad"), _call(4, "d")],
            cancels=[5],
        )
    )
    first = await anext(out)
    codes = {a.tag: a.code for a in first.answers}
    assert codes[3] == grpc.StatusCode.PERMISSION_DENIED.value[0]
    await asyncio.sleep(0.01)
    generate.gates["a"].set()
    generate.gates["bb"].set()
    answers = {}
    for a in first.answers:
        answers[a.tag] = a
    while len(answers) < 4:
        msg = await anext(out)
        assert len(msg.answers) >= 1
        for a in msg.answers:
            answers[a.tag] = a
    assert answers[1].responses[0].reroutes == 1 and answers[2].responses[0].reroutes == 2
    limited = [t for t, a in answers.items() if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert limited == [4] and 5 not in answers
    assert sorted(generate.answered) == ["a", "bb"]  # the cancelled call never ran to its end
    await queue.put(None)  # the harness half-closes: the stream ends once nothing is in flight
    with pytest.raises(StopAsyncIteration):  # (a cancel read before its call left it running)
        await asyncio.wait_for(anext(out), 5.0)


async def test_a_tag_reused_in_flight_ends_the_stream():
    generate = Generate()
    queue: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
    out = CallStreamSession(generate, max_calls=8).serve(_requests(queue))
    await queue.put(pb.GenerateStreamRequest(calls=[_call(7, "a"), _call(7, "b")]))
    with pytest.raises(InvalidArgument, match="tag 7"):
        await anext(out)
    assert generate.cancelled == ["a"]  # the call in flight was cancelled with the stream


async def test_a_streamed_call_is_answered_in_parts_then_once_more():
    queue: asyncio.Queue[pb.GenerateStreamRequest | None] = asyncio.Queue()
    out = CallStreamSession(Generate(), max_calls=8).serve(_requests(queue))
    call = _call(3, "s")
    call.stream = True
    await queue.put(pb.GenerateStreamRequest(calls=[call]))
    await queue.put(None)
    answers = [a async for msg in out for a in msg.answers]
    assert [(a.tag, a.more, [r.reroutes for r in a.responses]) for a in answers] == [
        (3, True, [100]),
        (3, True, [101]),
        (3, False, [102]),
    ]
