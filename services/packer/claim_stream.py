"""One training cell's claims and acks over one stream (``Packer.ClaimStream``).

A unary call costs the packer about as much CPU as the claim it carries (mTLS, the access
guard, a call object and its task; see docs/benchmarks/packer.md), so a cell keeps one
stream and sends every ClaimMicroSteps and AckMicroSteps request on it, each with a tag of
its own; the answer carries the tag and either the unary RPC's response or the status that
RPC would have failed with.

Each request runs in a task of its own, through the same code the unary RPCs run (the
servicer passes it in), so a claim waiting for work does not hold up an ack behind it; the
answers go out in the order they are ready. Per request, the access rule of the unary RPC
(``own="cell_id"``: a cell acts only for itself) is checked with
:func:`gyre.grpcx.auth.check_own` and a refusal answers PERMISSION_DENIED for that request
(the caller's role was checked when the call opened, so the stream goes on). At most
``max_requests`` are in flight: one beyond is answered RESOURCE_EXHAUSTED. A tag reused
while its request is in flight ends the call with INVALID_ARGUMENT (the two answers could
not be told apart), as a message that does not parse does (the guard). The end of the
cell's request stream lets the requests in flight finish, then ends the call; the call's
cancellation cancels them (a claim whose answer is lost is a lease that expires; an ack is
idempotent and resent).

A claim may carry the cell's previous ack (``ack_first``): one request and one answer for
both, served by ``ack_claim`` (the servicer's ``_ack_then_claim``: the ack, all or nothing,
then the claim, one WAL flush for both). The ack's cell id is checked like the claim's; a
failed ack is the answer (no claim made); a claim that fails after its ack went through is
answered with ``acked`` and the claim's status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gyre.errors import GyreError, InvalidArgument, ResourceExhausted, status_for
from gyre.grpcx.auth import check_own
from gyre.grpcx.tagged import TaggedRequests
from gyre.v1 import packer_pb2 as pb
from services.packer.model import length_delimited

log = logging.getLogger(__name__)

Serve = Callable[[Any], Awaitable[Any]]
"""Serves one request as its unary RPC does: the response (a message, or for a claim the
serialized ClaimMicroStepsResponse when the packer pre-encodes), or raises a GyreError."""

Answer = pb.ClaimStreamResponse | bytes
"""One answer: a message, or its serialization (the service passes bytes through)."""

_KINDS = ("claim", "ack")


def answer(tag: int, kind: str, response: Any, acked: pb.AckMicroStepsResponse | None = None) -> Answer:
    """The answer to request ``tag`` of ``kind`` with the unary RPC's ``response`` (and,
    for a claim that carried an ack, the ack's response ``acked``); bytes (a pre-encoded
    ClaimMicroStepsResponse) become the serialized ClaimStreamResponse."""
    if isinstance(response, bytes):
        head = pb.ClaimStreamResponse(tag=tag, acked=acked).SerializeToString()
        return head + length_delimited(_FIELDS[kind], response)
    return pb.ClaimStreamResponse(tag=tag, acked=acked, **{kind: response})


_FIELDS = {"claim": pb.ClaimStreamResponse.CLAIM_FIELD_NUMBER, "ack": pb.ClaimStreamResponse.ACK_FIELD_NUMBER}


def failure(
    tag: int, error: BaseException, acked: pb.AckMicroStepsResponse | None = None
) -> pb.ClaimStreamResponse:
    """The answer to request ``tag`` that failed with ``error``: the status its unary RPC
    would have ended with (``acked``: a claim that failed after the ack it carried went
    through)."""
    code, message = status_for(error)
    return pb.ClaimStreamResponse(tag=tag, code=code.value[0], message=message, acked=acked)


AckClaim = Callable[[Any, Any], Awaitable[tuple[Any, Any]]]
"""Serves an ack carried with a claim (``ack_first``): the ack first, raising a GyreError
when it fails (no claim made), then the claim; returns the ack's response and the claim's
(as :data:`Serve` gives it) or the exception the claim failed with, both durable."""


class ClaimStreamSession:
    """The state of one ClaimStream call: its requests in flight and the answers not yet sent."""

    def __init__(
        self, claim: Serve, ack: Serve, max_requests: int, ack_claim: AckClaim | None = None
    ) -> None:
        self._serve = {"claim": claim, "ack": ack}
        self._ack_claim = ack_claim
        self._requests: TaggedRequests[Answer] = TaggedRequests(max_requests)

    async def serve(self, requests: AsyncIterator[pb.ClaimStreamRequest]) -> AsyncIterator[Answer]:
        async def read() -> None:
            async for msg in requests:
                self._begin(msg)

        async for out in self._requests.serve(read):
            for item in out:
                yield item

    def _begin(self, msg: pb.ClaimStreamRequest) -> None:
        tag = int(msg.tag)
        self._requests.check_tag(tag)  # the two answers could not be told apart: the call ends
        kind = msg.WhichOneof("request")
        if kind not in _KINDS:
            self._send(failure(tag, InvalidArgument("the request carries neither a claim nor an ack")))
            return
        if self._requests.full():
            limit = self._requests.max_requests
            self._send(failure(tag, ResourceExhausted(f"more than {limit} requests in flight")))
            return
        request = getattr(msg, kind)
        ack_first = msg.ack_first if msg.HasField("ack_first") else None
        if ack_first is not None and (kind != "claim" or self._ack_claim is None):
            self._send(failure(tag, InvalidArgument("ack_first goes with a claim")))
            return
        try:
            check_own(request, "cell_id")  # the unary RPCs' rule: allow(CELL_AGENT, own="cell_id")
            if ack_first is not None:
                check_own(ack_first, "cell_id")
        except GyreError as exc:
            self._send(failure(tag, exc))
            return
        run = (
            self._run(tag, kind, request)
            if ack_first is None
            else self._run_ack_claim(tag, ack_first, request)
        )
        self._requests.start(tag, run, f"claim-stream.{tag}")

    async def _run(self, tag: int, kind: str, request: Any) -> None:
        try:
            response = await self._serve[kind](request)
        except asyncio.CancelledError:
            return  # the call ended: nothing to send
        except GyreError as exc:
            self._send(failure(tag, exc))
        except Exception as exc:  # a bug fails this request (INTERNAL), never the others
            log.exception("claim stream request crashed", extra={"tag": tag, "kind": kind})
            self._send(failure(tag, exc))
        else:
            self._send(answer(tag, kind, response))

    async def _run_ack_claim(self, tag: int, ack: Any, claim: Any) -> None:
        assert self._ack_claim is not None
        try:
            acked, claimed = await self._ack_claim(ack, claim)
        except asyncio.CancelledError:
            return
        except GyreError as exc:  # the ack failed: nothing was done
            self._send(failure(tag, exc))
        except Exception as exc:
            log.exception("claim stream request crashed", extra={"tag": tag, "kind": "ack+claim"})
            self._send(failure(tag, exc))
        else:
            if isinstance(claimed, BaseException):
                if not isinstance(claimed, GyreError):
                    log.error("claim stream claim crashed", exc_info=claimed, extra={"tag": tag})
                self._send(failure(tag, claimed, acked))
            else:
                self._send(answer(tag, "claim", claimed, acked))

    def _send(self, item: Answer) -> None:
        self._requests.send(item)
