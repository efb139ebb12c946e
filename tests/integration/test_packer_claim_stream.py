"""Packer.ClaimStream against a real packer process over loopback mTLS: claims and acks on
one stream per cell answer exactly what ClaimMicroSteps / AckMicroSteps answer (idempotent
retries by claim_id included); every bad request gets its unary status in its own answer
while the stream goes on (NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT,
PERMISSION_DENIED for another cell's id, RESOURCE_EXHAUSTED past the bound on requests in
flight); a reused tag in flight or a malformed message ends the call with INVALID_ARGUMENT;
a role other than a cell agent is refused when the call opens; and a stream cut mid-way
leaves the packer consistent (lapsed claims are retaken, resent acks are idempotent), with
the trainer-side StreamingPackerSource failing what was in flight with UNAVAILABLE and
reopening on the next request."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gyre.errors import FailedPrecondition, Unavailable
from gyre.identity import Role
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.cell_agent.training.microstep import Outcome
from services.cell_agent.training.packer_client import StreamingPackerSource
from services.packer.servicer import PackerServicer
from testkit import packer_kit as tk
from testkit.packer_process import CLAIMED, CLOSED
from testkit.tls import RoleStubs, channel

Code = grpc.StatusCode


class Cell:
    """A raw ClaimStream call as one identity: send tagged requests, read answers by tag."""

    def __init__(self, target: str, name: str, role: Role = Role.CELL_AGENT) -> None:
        self.ch = channel(target, name, role)
        self.stub = packer_pb2_grpc.PackerStub(self.ch)
        self.call = self.stub.ClaimStream()
        self.answers: dict[int, packer_pb2.ClaimStreamResponse] = {}

    async def send(self, tag: int, **request) -> None:
        await self.call.write(packer_pb2.ClaimStreamRequest(tag=tag, **request))

    async def answer(self, tag: int, timeout: float = 10.0) -> packer_pb2.ClaimStreamResponse:
        async def read() -> packer_pb2.ClaimStreamResponse:
            while tag not in self.answers:
                msg = await self.call.read()
                assert msg is not grpc.aio.EOF, f"the call ended before answering tag {tag}"
                self.answers[msg.tag] = msg
            return self.answers.pop(tag)

        return await asyncio.wait_for(read(), timeout)

    async def ask(self, tag: int, **request) -> packer_pb2.ClaimStreamResponse:
        await self.send(tag, **request)
        return await self.answer(tag)

    async def close(self) -> None:
        self.call.cancel()
        await self.ch.close()


def claim(cell: str, batch: int = 1, n: int = 4, key: str = "", wait_s: float = 1.0, version: int = 0):
    return packer_pb2.ClaimMicroStepsRequest(
        cell_id=cell, batch_id=batch, policy_version=version, wait_s=wait_s, claim_id=key, max_micro_steps=n
    )


def ack(cell: str, ids: list[str], batch: int = 1):
    return packer_pb2.AckMicroStepsRequest(cell_id=cell, batch_id=batch, micro_step_ids=ids)


async def _code(call) -> Code:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


@pytest.mark.parametrize("pre_encode", [True, False])
async def test_claims_and_acks_on_the_stream_equal_the_unary_ones(packer_proc, pre_encode):
    proc = packer_proc(batch_size=4, pre_encode=pre_encode)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    cell = Cell(proc.target, "cell0")
    try:
        await tk.feed_stub(stub, 4, size=3, turns=2)
        got = await cell.ask(7, claim=claim("cell0", key="k"))
        assert got.tag == 7 and got.code == 0 and got.WhichOneof("response") == "claim"
        assert got.claim.outcome == CLAIMED and 1 <= len(got.claim.micro_steps) <= 4
        # The unary RPC, retried with the same claim_id, answers the very same claim...
        unary = await stub.ClaimMicroSteps(claim("cell0", key="k"), timeout=10)
        assert unary == got.claim
        # ... and so does a retry on the stream (idempotent on (cell_id, claim_id)).
        again = await cell.ask(8, claim=claim("cell0", key="k"))
        assert again.claim == got.claim
        ids = [m.micro_step_id for m in got.claim.micro_steps]
        acked = await cell.ask(9, ack=ack("cell0", ids))
        assert acked.code == 0 and list(acked.ack.duplicate) == [False] * len(ids)
        assert list((await stub.AckMicroSteps(ack("cell0", ids), timeout=10)).duplicate) == [True] * len(ids)
        assert list((await cell.ask(9, ack=ack("cell0", ids))).ack.duplicate) == [True] * len(ids)

        # Two more cells drain the batch over their streams, claims and acks interleaved on
        # each stream: every micro-step once, every turn trained once.

        async def drain(name: str) -> list[str]:
            source = StreamingPackerSource(proc.target, name, channel=channel(proc.target, name))
            mine: list[str] = []
            try:
                while True:
                    claims = await source.claim_many(1, 0, 0.5, 2, f"{name}-{len(mine)}")
                    if claims[0].outcome is Outcome.CLOSED:
                        return mine
                    steps = [c.micro_step for c in claims if c.micro_step is not None]
                    ids = [m.micro_step_id for m in steps]
                    if ids:
                        assert await source.ack_many(1, ids) == [False] * len(ids)
                        mine.extend(ids)
            finally:
                await source.close()
                await source._channel.close()

        mine = await asyncio.gather(drain("cell1"), drain("cell2"))
        claimed = ids + mine[0] + mine[1]
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.done and len(claimed) == len(set(claimed)) == status.micro_steps == status.acked
        c = status.counters
        assert c.produced == c.consumed == 4 * 3 * 2 and c.buffered == 0
    finally:
        await cell.close()
        await stub.close()


async def test_bad_requests_get_their_unary_status_and_the_stream_goes_on(packer_proc):
    proc = packer_proc(batch_size=2, max_stream_requests=3, claim_ttl_s=60.0)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    cell = Cell(proc.target, "cell0")
    try:
        await tk.feed_stub(stub, 2, size=2, turns=1)
        held: list[str] = []  # every micro-step of batch 1 (version 1): batch 2 becomes current
        for tag in range(1, 20):
            ok = await cell.ask(tag, claim=claim("cell0", n=64, version=1, wait_s=0.5))
            assert ok.code == 0
            if ok.claim.outcome == CLOSED:
                break
            held += [m.micro_step_id for m in ok.claim.micro_steps]
        mine = held[0]
        before = (await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)).counters

        bad = {
            "unknown batch": (dict(claim=claim("cell0", batch=99)), Code.NOT_FOUND),
            "unknown micro-step": (dict(ack=ack("cell0", [mine, "nope"])), Code.NOT_FOUND),
            "wrong version": (dict(claim=claim("cell0", version=4)), Code.FAILED_PRECONDITION),
            "max_micro_steps 0": (dict(claim=claim("cell0", n=0)), Code.INVALID_ARGUMENT),
            "repeated ack": (dict(ack=ack("cell0", [mine, mine])), Code.INVALID_ARGUMENT),
            "another cell's claim": (dict(claim=claim("cell1")), Code.PERMISSION_DENIED),
            "another cell's ack": (dict(ack=ack("cell1", [mine])), Code.PERMISSION_DENIED),
            "neither claim nor ack": ({}, Code.INVALID_ARGUMENT),
        }
        for tag, (what, (request, code)) in enumerate(bad.items(), start=20):
            got = await cell.ask(tag, **request)
            assert (got.tag, got.code, got.WhichOneof("response")) == (tag, code.value[0], None), what
            assert got.message, what
            for kind, method in (("claim", "ClaimMicroSteps"), ("ack", "AckMicroSteps")):
                if kind in request:  # the unary RPC, as cell0 too, fails with the same status
                    assert await _code(getattr(cell.stub, method)(request[kind], timeout=5)) == code, what
        after = (await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)).counters
        assert after == before  # nothing changed

        # The bound on requests in flight: claims waiting for work (batch 2 has none).
        for tag in (40, 41, 42):
            await cell.send(tag, claim=claim("cell0", batch=0, n=1, wait_s=3.0, version=1))
        over = await cell.ask(43, ack=ack("cell0", [mine]))
        assert over.code == Code.RESOURCE_EXHAUSTED.value[0]
        waited = [await cell.answer(tag) for tag in (40, 41, 42)]
        assert all(w.code == 0 and w.claim.outcome == packer_pb2.CLAIM_OUTCOME_WAIT for w in waited)
        assert {w.claim.batch_id for w in waited} == {2}
        # The stream goes on.
        acked = await cell.ask(44, ack=ack("cell0", held))
        assert list(acked.ack.duplicate) == [False] * len(held)

        # A tag reused while its request is in flight ends the call.
        await cell.send(50, claim=claim("cell0", batch=0, n=1, wait_s=10.0, version=1))
        await cell.send(50, ack=ack("cell0", [mine]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cell.answer(99)
        assert err.value.code() == Code.INVALID_ARGUMENT and "tag 50" in err.value.details()
    finally:
        await cell.close()
        await stub.close()


async def test_malformed_messages_and_other_roles_end_the_call(packer_proc):
    proc = packer_proc()
    # Bytes that do not parse as a ClaimStreamRequest: INVALID_ARGUMENT ends the call.
    async with channel(proc.target, "cell0") as ch:
        raw = ch.stream_stream(
            "/gyre.v1.Packer/ClaimStream",
            request_serializer=None,
            response_deserializer=packer_pb2.ClaimStreamResponse.FromString,
        )
        call = raw()
        await call.write(b"\xff\xff\xff")
        assert await _code(call.read()) == Code.INVALID_ARGUMENT
        # A string field that is not UTF-8, inside a claim.
        call = raw()
        await call.write(bytes([0x12, 0x03, 0x0A, 0x01, 0xFF]))
        assert await _code(call.read()) == Code.INVALID_ARGUMENT
    # Only cell agents may open the stream (the role is checked when it opens).
    for role in (Role.SCHEDULER, Role.ROUTER, Role.OPERATOR, Role.DASHBOARD):
        other = Cell(proc.target, role.value, role)
        try:
            assert await _code(other.call.read()) == Code.PERMISSION_DENIED, role  # nothing sent
        finally:
            await other.close()


async def test_a_stream_cut_mid_way_leaves_the_packer_consistent(packer_proc):
    proc = packer_proc(batch_size=2, claim_ttl_s=1.0)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    try:
        await tk.feed_stub(stub, 2, size=2, turns=1)
        # Cell 0 claims everything on a stream, and the stream is cut before it acks.
        cell = Cell(proc.target, "cell0")
        got = await cell.ask(1, claim=claim("cell0", n=64, key="all"))
        lost = [m.micro_step_id for m in got.claim.micro_steps]
        assert lost
        await cell.close()
        # Its claims lapse after their TTL (a claim by the cell would keep them: wait it out),
        # and cell 0, a participant of the batch (closed to new cells), retakes them on a new
        # stream.
        await asyncio.sleep(1.5)
        again = Cell(proc.target, "cell0")
        retaken: list[str] = []
        for tag in range(1, 50):
            r = await again.ask(tag, claim=claim("cell0", n=64, wait_s=0.5))
            assert r.code == 0
            if r.claim.outcome == CLOSED:  # every micro-step held: not lapsed yet
                await asyncio.sleep(0.2)
                continue
            retaken += [m.micro_step_id for m in r.claim.micro_steps]
            if sorted(retaken) == sorted(lost):
                break
        assert sorted(retaken) == sorted(lost)
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.counters.claims_expired >= len(lost) and status.acked == 0
        # An ack whose answer is lost with its stream (sent, the call cut at once) ...
        await again.send(100, ack=ack("cell0", retaken))
        await again.close()
        # ... is resent on a new stream: applied once, whichever way the first one went.
        third = Cell(proc.target, "cell0")
        try:
            first = await third.ask(1, ack=ack("cell0", retaken))
            assert first.code == 0 and len(set(first.ack.duplicate)) == 1
            second = await third.ask(2, ack=ack("cell0", retaken))
            assert list(second.ack.duplicate) == [True] * len(retaken)
        finally:
            await third.close()
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.done and status.acked == status.micro_steps == len(lost)
        c = status.counters
        assert c.produced == c.buffered + c.consumed + sum(c.dropped.values())
        assert c.produced == c.consumed == 4 and c.packed == 0
        # Another cell may not ack what cell 0 trained (as with the unary AckMicroSteps).
        other = Cell(proc.target, "cell1")
        try:
            refused = await other.ask(1, ack=ack("cell1", lost))
            assert refused.code == Code.FAILED_PRECONDITION.value[0]
        finally:
            await other.close()
    finally:
        await stub.close()


async def test_the_streaming_client_fails_in_flight_requests_and_reopens(packer_proc):
    proc = packer_proc(batch_size=2)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    ch = channel(proc.target, "cell3")
    source = StreamingPackerSource(proc.target, "cell3", channel=ch)
    try:
        # The stream breaks while a claim waits for work on it: UNAVAILABLE.
        in_flight = asyncio.create_task(source.claim_many(1, 0, 10.0, 64, "w"))  # pins version 0
        await asyncio.sleep(0.3)
        first = source._stream
        assert first is not None
        first.call.cancel()
        with pytest.raises(Unavailable):
            await asyncio.wait_for(in_flight, 5)
        # The next request opens a new stream. Concurrent requests on it: a claim waits for
        # work (retried with its claim_id) while another request is answered (here refused).
        waiting = asyncio.create_task(source.claim_many(1, 0, 10.0, 64, "w"))
        await asyncio.sleep(0.3)
        assert source._stream is not first
        with pytest.raises(FailedPrecondition):
            await source.claim_many(1, 5, 0.0, 1)
        await tk.feed_stub(stub, 2, size=2, turns=1)
        claims = await asyncio.wait_for(waiting, 10)
        assert claims[0].outcome is Outcome.CLAIMED
        ids = [c.micro_step.micro_step_id for c in claims]
        assert await source.ack_many(1, ids) == [False] * len(ids)
        assert await source.ack_many(1, ids) == [True] * len(ids)
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.acked == len(ids)
    finally:
        await source.close()
        await ch.close()
        await stub.close()


async def test_an_ack_carried_with_the_next_claim(packer_proc):
    """ClaimStream's ``ack_first``: the ack, then the claim, one request and one answer; a
    failing ack makes no claim; a claim failing after its ack leaves the ack done; cells
    draining a batch that way train every micro-step once, and what was answered survives
    a crash of the packer (one WAL flush made both durable before the answer)."""
    proc = packer_proc(batch_size=4, claim_ttl_s=30.0)
    stub = RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
    cell, other = Cell(proc.target, "cell0"), Cell(proc.target, "cell1")
    try:
        await tk.feed_stub(stub, 4, size=3, turns=2)
        first = await cell.ask(1, claim=claim("cell0", n=2, key="c0"))
        ids = [m.micro_step_id for m in first.claim.micro_steps]
        assert first.code == 0 and len(ids) == 2
        # Another cell's ack (of cell 0's micro-steps) fails: its status, nothing claimed.
        refused = await other.ask(1, claim=claim("cell1", n=2, key="c1"), ack_first=ack("cell1", ids))
        assert refused.code == Code.FAILED_PRECONDITION.value[0]
        assert not refused.HasField("acked") and not refused.HasField("claim")
        assert (await stub.KeepClaims(packer_pb2.KeepClaimsRequest(cell_id="cell1"), timeout=5)).claims == 0
        # The ack goes through, the claim fails (another policy version): `acked`, the claim's status.
        half = await cell.ask(2, claim=claim("cell0", n=2, version=7), ack_first=ack("cell0", ids[:1]))
        assert half.code == Code.FAILED_PRECONDITION.value[0] and list(half.acked.duplicate) == [False]
        # Both go through: one answer.
        both = await cell.ask(3, claim=claim("cell0", n=2, key="c2"), ack_first=ack("cell0", ids))
        assert both.code == 0 and list(both.acked.duplicate) == [True, False]
        assert both.claim.outcome == CLAIMED and len(both.claim.micro_steps) == 2
        held = [m.micro_step_id for m in both.claim.micro_steps]
        # The same retried (its claim_id): the ack answers duplicate, the claim the same micro-steps.
        retry = await cell.ask(4, claim=claim("cell0", n=2, key="c2"), ack_first=ack("cell0", ids))
        assert list(retry.acked.duplicate) == [True, True] and retry.claim == both.claim

        async def drain(name: str, start: list[str]) -> list[str]:
            source = StreamingPackerSource(proc.target, name, channel=channel(proc.target, name))
            mine, pending = list(start), list(start)
            try:
                claims = await source.claim_many(1, 0, 0.5, 3, f"{name}-0") if not pending else None
                while True:
                    if claims is not None:
                        if claims[0].outcome is Outcome.CLOSED:
                            return mine
                        pending = [c.micro_step.micro_step_id for c in claims if c.micro_step is not None]
                        mine += pending
                    if not pending:
                        claims = await source.claim_many(1, 0, 0.5, 3, f"{name}-{len(mine)}")
                        continue
                    dups, claims = await source.ack_and_claim_many(
                        1, pending, 0, 0.5, 3, f"{name}-{len(mine)}"
                    )
                    assert dups == [False] * len(pending)
                    pending = []
            finally:
                await source.close()
                await source._channel.close()

        mine = await asyncio.gather(drain("cell0", held), drain("cell2", []))
        trained = ids + mine[0] + mine[1]
        status = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert status.done and len(trained) == len(set(trained)) == status.micro_steps == status.acked
    finally:
        await cell.close()
        await other.close()
        await stub.close()
    # Every answered ack was durable: a crash loses none of them.
    proc.kill()
    proc = packer_proc(batch_size=4, claim_ttl_s=30.0)
    async with RoleStubs(proc.target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS) as stub:
        again = await stub.GetBatch(packer_pb2.GetBatchRequest(batch_id=1), timeout=5)
        assert again.done and again.acked == again.micro_steps == status.micro_steps
