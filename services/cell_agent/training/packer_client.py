"""The packer's claim API for one training cell, over gRPC (the real MicroStepSource)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import grpc

from gyre.errors import DeadlineExceeded, Unavailable, from_status
from gyre.grpcx.channel import dial, unary
from gyre.grpcx.server import channel_options
from gyre.grpcx.tls import process_tls
from gyre.identity import Role
from gyre.v1 import packer_pb2 as ppb
from gyre.v1 import packer_pb2_grpc as ppb_grpc
from services.cell_agent.training.microstep import Claim, MicroStep, Outcome


class PackerSource:
    """Claims, acks and keeps micro-steps at the packer for ``cell_id``."""

    def __init__(
        self,
        target: str,
        cell_id: str,
        rpc_timeout_s: float = 10.0,
        channel: grpc.aio.Channel | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.cell_id = cell_id
        self.rpc_timeout_s = rpc_timeout_s
        self._own = channel is None
        self._channel = channel or dial(
            target, process_tls(), Role.PACKER, channel_options(max_message_bytes)
        )
        self._stub = ppb_grpc.PackerStub(self._channel)

    async def claim(self, batch_id: int, policy_version: int, wait_s: float, claim_id: str = "") -> Claim:
        resp = await unary(
            self._stub.ClaimMicroStep,
            ppb.ClaimMicroStepRequest(
                cell_id=self.cell_id,
                batch_id=batch_id,
                policy_version=policy_version,
                wait_s=wait_s,
                claim_id=claim_id,
            ),
            timeout_s=wait_s + self.rpc_timeout_s,
        )
        outcome = Outcome.from_proto(resp.outcome)
        step = MicroStep.from_proto(resp.micro_step) if outcome is Outcome.CLAIMED else None
        return Claim(outcome, step, resp.claim_ttl_s)

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        """Claims up to ``max_micro_steps`` in one ClaimMicroSteps call: one CLAIMED claim per
        micro-step, or a single WAIT / CLOSED claim. Idempotent on ``claim_id`` like
        :meth:`claim`."""
        resp = await unary(
            self._stub.ClaimMicroSteps,
            _claims_request(self.cell_id, batch_id, policy_version, wait_s, claim_id, max_micro_steps),
            timeout_s=wait_s + self.rpc_timeout_s,
        )
        return _claims(resp)

    async def ack_many(self, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        """Acknowledges several micro-steps in one AckMicroSteps call (all or nothing, one
        WAL flush at the packer); per micro-step, True when it had been acknowledged before."""
        resp = await unary(
            self._stub.AckMicroSteps,
            ppb.AckMicroStepsRequest(cell_id=self.cell_id, batch_id=batch_id, micro_step_ids=micro_step_ids),
            timeout_s=self.rpc_timeout_s,
        )
        return list(resp.duplicate)

    async def ack(self, batch_id: int, micro_step_id: str) -> None:
        await unary(
            self._stub.AckMicroStep,
            ppb.AckMicroStepRequest(cell_id=self.cell_id, batch_id=batch_id, micro_step_id=micro_step_id),
            timeout_s=self.rpc_timeout_s,
        )

    async def open_batch(self, batch_id: int) -> None:
        await unary(
            self._stub.OpenBatch,
            ppb.OpenBatchRequest(cell_id=self.cell_id, batch_id=batch_id),
            timeout_s=self.rpc_timeout_s,
        )

    async def commit(self, batch_id: int) -> None:
        await unary(
            self._stub.CommitBatch,
            ppb.CommitBatchRequest(cell_id=self.cell_id, batch_id=batch_id),
            timeout_s=self.rpc_timeout_s,
        )

    async def keep(self) -> None:
        await unary(
            self._stub.KeepClaims, ppb.KeepClaimsRequest(cell_id=self.cell_id), timeout_s=self.rpc_timeout_s
        )

    async def close(self) -> None:
        if self._own:
            await self._channel.close()


class _Stream:
    """One ClaimStream call: the answers awaited by tag, and the task that reads them."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.pending: dict[int, asyncio.Future[ppb.ClaimStreamResponse]] = {}
        self.write_lock = asyncio.Lock()
        self.broken: Unavailable | None = None
        self.reader = asyncio.create_task(self._read(), name="packer-claim-stream.read")

    async def _read(self) -> None:
        why = "the packer ended the claim stream"
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    break
                fut = self.pending.pop(msg.tag, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except grpc.aio.AioRpcError as err:
            why = f"the claim stream broke: {err.code().name} {err.details()}"
        except asyncio.CancelledError:
            why = "the claim stream was closed"
            raise
        finally:
            self.fail(why)

    def fail(self, why: str) -> None:
        """Marks the call broken and fails every request in flight on it with UNAVAILABLE."""
        if self.broken is None:
            self.broken = Unavailable(why)
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(why))


class StreamingPackerSource(PackerSource):
    """A :class:`PackerSource` whose ``claim_many`` and ``ack_many`` go over one long-lived
    ``ClaimStream`` call instead of a unary call each (the same requests, answers and
    statuses; see docs/benchmarks/packer.md for what it saves). Requests may be issued
    concurrently: each gets a tag and its answer resolves it. A request whose answer does
    not come within its timeout raises DEADLINE_EXCEEDED (its answer, if it comes, is
    dropped). When the stream breaks, the requests in flight on it raise UNAVAILABLE and the
    next request opens a new stream; both are safe to retry (a claim with its claim_id, an
    ack as it is). The other calls (claim, ack, keep, open_batch, commit) stay unary."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream: _Stream | None = None
        self._tags = itertools.count(1)

    def _open(self) -> _Stream:
        if self._stream is None or self._stream.broken is not None:
            self._stream = _Stream(self._stub.ClaimStream())
        return self._stream

    async def _request(self, timeout_s: float, **request: Any) -> ppb.ClaimStreamResponse:
        stream = self._open()
        tag = next(self._tags)
        fut: asyncio.Future[ppb.ClaimStreamResponse] = asyncio.get_running_loop().create_future()
        stream.pending[tag] = fut
        try:
            async with stream.write_lock:
                await stream.call.write(ppb.ClaimStreamRequest(tag=tag, **request))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            stream.fail(f"the claim stream broke: {err!r}")
        try:
            msg = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            stream.pending.pop(tag, None)
            raise DeadlineExceeded(f"no answer on the claim stream within {timeout_s:.1f} s") from None
        if msg.code:
            raise from_status(msg.code, msg.message)
        return msg

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        """:meth:`PackerSource.claim_many` over the stream."""
        msg = await self._request(
            wait_s + self.rpc_timeout_s,
            claim=_claims_request(self.cell_id, batch_id, policy_version, wait_s, claim_id, max_micro_steps),
        )
        return _claims(msg.claim)

    async def ack_many(self, batch_id: int, micro_step_ids: list[str]) -> list[bool]:
        """:meth:`PackerSource.ack_many` over the stream."""
        msg = await self._request(
            self.rpc_timeout_s,
            ack=ppb.AckMicroStepsRequest(
                cell_id=self.cell_id, batch_id=batch_id, micro_step_ids=micro_step_ids
            ),
        )
        return list(msg.ack.duplicate)

    async def ack_and_claim_many(
        self,
        batch_id: int,
        ack_ids: list[str],
        policy_version: int,
        wait_s: float,
        max_micro_steps: int,
        claim_id: str = "",
    ) -> tuple[list[bool], list[Claim]]:
        """``ack_many(batch_id, ack_ids)`` and then ``claim_many(...)`` in one request and one
        answer (ClaimStream's ``ack_first``): the ack's duplicate flags and the claims. The
        ack is done first, all or nothing: when it fails its error is raised and nothing was
        claimed; when it went through and the claim failed, the claim's error is raised (the
        ack stands; resent, it answers duplicate). A packer that predates ``ack_first``
        answers the claim alone; the ack is then sent by itself."""
        msg = await self._request(
            wait_s + self.rpc_timeout_s,
            claim=_claims_request(self.cell_id, batch_id, policy_version, wait_s, claim_id, max_micro_steps),
            ack_first=ppb.AckMicroStepsRequest(
                cell_id=self.cell_id, batch_id=batch_id, micro_step_ids=ack_ids
            ),
        )
        if msg.HasField("acked"):
            dups = list(msg.acked.duplicate)
        else:  # an older packer: it claimed and ignored the ack
            dups = await self.ack_many(batch_id, ack_ids)
        return dups, _claims(msg.claim)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            stream.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream.reader
        await super().close()


def _claims_request(
    cell_id: str, batch_id: int, policy_version: int, wait_s: float, claim_id: str, max_micro_steps: int
) -> ppb.ClaimMicroStepsRequest:
    """The ClaimMicroSteps request, the same unary and on the claim stream."""
    return ppb.ClaimMicroStepsRequest(
        cell_id=cell_id,
        batch_id=batch_id,
        policy_version=policy_version,
        wait_s=wait_s,
        claim_id=claim_id,
        max_micro_steps=max_micro_steps,
    )


def _claims(resp: ppb.ClaimMicroStepsResponse) -> list[Claim]:
    """One CLAIMED claim per micro-step, or a single WAIT / CLOSED claim."""
    outcome = Outcome.from_proto(resp.outcome)
    if outcome is not Outcome.CLAIMED:
        return [Claim(outcome, None, resp.claim_ttl_s)]
    return [Claim(outcome, MicroStep.from_proto(m), resp.claim_ttl_s) for m in resp.micro_steps]
