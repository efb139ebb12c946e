"""The claim stream's session without gRPC (services.packer.claim_stream): a pre-encoded
claim's answer is byte for byte the message's serialization; requests on one stream run
concurrently (an ack is answered while a claim waits); each failure is its request's answer
with the unary status, and the stream goes on; beyond the bound a request is
RESOURCE_EXHAUSTED; a tag reused in flight ends the stream with INVALID_ARGUMENT; the end of
the requests lets those in flight finish; and the per-message own check refuses another
cell's id (its refusal message is the guard's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from gyre.grpcx import auth
from gyre.identity import Identity, Role
from gyre.v1 import packer_pb2 as pb
from services.packer.claim_stream import ClaimStreamSession, answer

OK = 0


def _claim_response(n: int) -> pb.ClaimMicroStepsResponse:
    return pb.ClaimMicroStepsResponse(
        outcome=pb.CLAIM_OUTCOME_CLAIMED,
        micro_steps=[pb.MicroStep(micro_step_id=f"b1-m{i}", batch_id=1, num_tokens=7) for i in range(n)],
        claim_ttl_s=10.0,
        batch_id=1,
        policy_version=3,
    )


@pytest.mark.parametrize("tag", [0, 1, 127, 128, 2**40])
def test_a_pre_encoded_answer_is_the_messages_bytes(tag: int) -> None:
    resp = _claim_response(3)
    raw = answer(tag, "claim", resp.SerializeToString())
    assert isinstance(raw, bytes)
    msg = pb.ClaimStreamResponse(tag=tag, claim=resp)
    assert raw == msg.SerializeToString()
    assert pb.ClaimStreamResponse.FromString(raw) == msg
    assert answer(tag, "ack", pb.AckMicroStepsResponse(duplicate=[True])) == pb.ClaimStreamResponse(
        tag=tag, ack=pb.AckMicroStepsResponse(duplicate=[True])
    )


class Feed:
    """The cell's side of a session: requests in, answers out by tag."""

    def __init__(self, session: ClaimStreamSession) -> None:
        self.queue: asyncio.Queue[pb.ClaimStreamRequest | None] = asyncio.Queue()
        self.answers: dict[int, pb.ClaimStreamResponse] = {}
        self.arrived = asyncio.Event()
        self.task = asyncio.create_task(self._collect(session))

    async def _requests(self) -> AsyncIterator[pb.ClaimStreamRequest]:
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _collect(self, session: ClaimStreamSession) -> None:
        async for item in session.serve(self._requests()):
            msg = pb.ClaimStreamResponse.FromString(item) if isinstance(item, bytes) else item
            self.answers[msg.tag] = msg
            self.arrived.set()

    def send(self, tag: int, **request: Any) -> None:
        self.queue.put_nowait(pb.ClaimStreamRequest(tag=tag, **request))

    async def answer(self, tag: int) -> pb.ClaimStreamResponse:
        async with asyncio.timeout(5):
            while tag not in self.answers:
                self.arrived.clear()
                await self.arrived.wait()
        return self.answers.pop(tag)


def _session(release: asyncio.Event, max_requests: int = 4) -> ClaimStreamSession:
    async def claim(request: pb.ClaimMicroStepsRequest) -> Any:
        if request.batch_id == 99:
            raise NotFound("no batch 99")
        await release.wait()  # waits for work
        return _claim_response(request.max_micro_steps).SerializeToString()  # pre-encoded

    async def ack(request: pb.AckMicroStepsRequest) -> pb.AckMicroStepsResponse:
        await asyncio.sleep(0)
        return pb.AckMicroStepsResponse(duplicate=[False] * len(request.micro_step_ids))

    return ClaimStreamSession(claim, ack, max_requests)


def _claim(n: int = 2, batch: int = 1, cell: str = "") -> pb.ClaimMicroStepsRequest:
    return pb.ClaimMicroStepsRequest(cell_id=cell, batch_id=batch, max_micro_steps=n)


async def test_requests_run_concurrently_and_failures_are_their_answers() -> None:
    release = asyncio.Event()
    feed = Feed(_session(release, max_requests=3))
    feed.send(1, claim=_claim(2))  # waits
    feed.send(2, ack=pb.AckMicroStepsRequest(micro_step_ids=["a", "b"]))
    got = await feed.answer(2)  # the ack goes through while the claim waits
    assert (got.code, list(got.ack.duplicate)) == (OK, [False, False])
    feed.send(3, claim=_claim(batch=99))
    failed = await feed.answer(3)
    assert (failed.code, failed.message) == (grpc.StatusCode.NOT_FOUND.value[0], "no batch 99")
    feed.send(4)  # neither claim nor ack
    assert (await feed.answer(4)).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    feed.send(5, claim=_claim(1))  # 2 in flight
    feed.send(6, claim=_claim(1))  # 3 in flight: the bound
    feed.send(7, claim=_claim(1))
    assert (await feed.answer(7)).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    feed.queue.put_nowait(None)  # the cell half-closes: those in flight still finish
    release.set()
    answers = [await feed.answer(t) for t in (1, 5, 6)]
    assert [len(a.claim.micro_steps) for a in answers] == [2, 1, 1]
    await asyncio.wait_for(feed.task, 5)  # then the stream ends


async def test_a_tag_reused_in_flight_ends_the_stream() -> None:
    release = asyncio.Event()
    feed = Feed(_session(release))
    feed.send(1, claim=_claim())
    feed.send(1, ack=pb.AckMicroStepsRequest(micro_step_ids=["a"]))
    with pytest.raises(InvalidArgument, match="tag 1"):
        await asyncio.wait_for(feed.task, 5)
    # A tag answered is free again.
    feed = Feed(_session(release))
    release.set()
    for _ in range(2):
        feed.send(1, claim=_claim())
        assert (await feed.answer(1)).code == OK
    feed.queue.put_nowait(None)
    await asyncio.wait_for(feed.task, 5)


async def test_each_message_may_act_only_for_the_caller() -> None:
    token = auth._caller.set(Identity(Role.CELL_AGENT, "cell-1"))
    try:
        auth.check_own(_claim(cell="cell-1"), "cell_id")
        with pytest.raises(PermissionDenied, match="may act only for itself"):
            auth.check_own(_claim(cell="cell-0"), "cell_id")
        release = asyncio.Event()
        release.set()
        feed = Feed(_session(release))  # its tasks copy the caller, as the guard sets it
        feed.send(1, claim=_claim(cell="cell-0"))
        feed.send(2, ack=pb.AckMicroStepsRequest(cell_id="cell-0", micro_step_ids=["a"]))
        feed.send(3, claim=_claim(cell="cell-1"))
        codes = [(await feed.answer(t)).code for t in (1, 2, 3)]
        assert codes == [grpc.StatusCode.PERMISSION_DENIED.value[0]] * 2 + [OK]
        feed.queue.put_nowait(None)
        await asyncio.wait_for(feed.task, 5)
    finally:
        auth._caller.reset(token)
    auth.check_own(_claim(cell="anyone"), "cell_id")  # no verified caller (tls.insecure)


def _ack_claim_session() -> tuple[ClaimStreamSession, list[tuple[Any, Any]]]:
    """A session whose acks carried with a claim (``ack_first``) are served by a fake: an
    ack of batch 98 fails (nothing done), a claim of batch 99 fails after its ack went
    through; the pairs it served are recorded."""
    served: list[tuple[Any, Any]] = []

    async def ack_claim(ack: pb.AckMicroStepsRequest, claim: pb.ClaimMicroStepsRequest) -> tuple[Any, Any]:
        if ack.batch_id == 98:
            raise FailedPrecondition("held by another cell")
        served.append((ack, claim))
        acked = pb.AckMicroStepsResponse(duplicate=[False] * len(ack.micro_step_ids))
        if claim.batch_id == 99:
            return acked, NotFound("no batch 99")
        return acked, _claim_response(claim.max_micro_steps).SerializeToString()

    async def never(request: Any) -> Any:
        raise AssertionError("an ack carried with a claim is served as one request")

    return ClaimStreamSession(never, never, 4, ack_claim=ack_claim), served


def test_an_answer_with_its_ack_parses_to_the_message() -> None:
    resp, acked = _claim_response(2), pb.AckMicroStepsResponse(duplicate=[False, True])
    raw = answer(5, "claim", resp.SerializeToString(), acked)
    assert isinstance(raw, bytes)
    assert pb.ClaimStreamResponse.FromString(raw) == pb.ClaimStreamResponse(tag=5, claim=resp, acked=acked)
    assert answer(5, "claim", resp, acked) == pb.ClaimStreamResponse(tag=5, claim=resp, acked=acked)


async def test_an_ack_carried_with_a_claim_is_one_request_and_one_answer() -> None:
    session, served = _ack_claim_session()
    feed = Feed(session)
    feed.send(1, claim=_claim(3), ack_first=pb.AckMicroStepsRequest(batch_id=1, micro_step_ids=["a", "b"]))
    got = await feed.answer(1)
    assert got.code == OK and list(got.acked.duplicate) == [False, False] and len(got.claim.micro_steps) == 3
    assert len(served) == 1
    # The ack fails: its status, no `acked`, no claim made.
    feed.send(2, claim=_claim(3), ack_first=pb.AckMicroStepsRequest(batch_id=98, micro_step_ids=["a"]))
    got = await feed.answer(2)
    assert (got.code, got.message) == (grpc.StatusCode.FAILED_PRECONDITION.value[0], "held by another cell")
    assert not got.HasField("acked") and not got.HasField("claim") and len(served) == 1
    # The ack goes through and the claim fails: `acked` with the claim's status.
    feed.send(3, claim=_claim(batch=99), ack_first=pb.AckMicroStepsRequest(batch_id=1, micro_step_ids=["c"]))
    got = await feed.answer(3)
    assert got.code == grpc.StatusCode.NOT_FOUND.value[0] and list(got.acked.duplicate) == [False]
    # With an ack instead of a claim: INVALID_ARGUMENT, nothing served.
    feed.send(4, ack=pb.AckMicroStepsRequest(micro_step_ids=["x"]), ack_first=pb.AckMicroStepsRequest())
    got = await feed.answer(4)
    assert got.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "ack_first" in got.message
    assert len(served) == 2
    feed.queue.put_nowait(None)
    await asyncio.wait_for(feed.task, 5)


async def test_an_ack_carried_with_a_claim_may_act_only_for_the_caller() -> None:
    token = auth._caller.set(Identity(Role.CELL_AGENT, "cell-1"))
    try:
        session, served = _ack_claim_session()
        feed = Feed(session)
        mine = pb.AckMicroStepsRequest(cell_id="cell-1", batch_id=1, micro_step_ids=["a"])
        theirs = pb.AckMicroStepsRequest(cell_id="cell-0", batch_id=1, micro_step_ids=["a"])
        feed.send(1, claim=_claim(cell="cell-1"), ack_first=theirs)
        feed.send(2, claim=_claim(cell="cell-0"), ack_first=mine)
        feed.send(3, claim=_claim(cell="cell-1"), ack_first=mine)
        codes = [(await feed.answer(t)).code for t in (1, 2, 3)]
        assert codes == [grpc.StatusCode.PERMISSION_DENIED.value[0]] * 2 + [OK]
        assert len(served) == 1
        feed.queue.put_nowait(None)
        await asyncio.wait_for(feed.task, 5)
    finally:
        auth._caller.reset(token)


async def test_a_session_without_ack_claim_refuses_ack_first() -> None:
    release = asyncio.Event()
    release.set()
    feed = Feed(_session(release))
    feed.send(1, claim=_claim(), ack_first=pb.AckMicroStepsRequest(micro_step_ids=["a"]))
    assert (await feed.answer(1)).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    feed.queue.put_nowait(None)
    await asyncio.wait_for(feed.task, 5)
