"""A packer run as a real process in a test: a client that follows it across restarts, the
feeder that records six groups' turns and finishes through it while a test kills it, and a
worker that claims and acks a batch's micro-steps through it to the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from apps.procs import ServiceProcess
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.servicer import PackerServicer
from testkit import packer_kit as tk
from testkit.tls import RoleStubs

CLAIMED = packer_pb2.CLAIM_OUTCOME_CLAIMED
CLOSED = packer_pb2.CLAIM_OUTCOME_CLOSED


class Reconnecting:
    """A packer stub that follows the packer across restarts (its port changes)."""

    def __init__(self, proc: ServiceProcess) -> None:
        self.proc = proc
        self._target = ""
        self._channel: grpc.aio.Channel | None = None
        self._stub: packer_pb2_grpc.PackerStub | None = None

    async def call(self, method: str, request, timeout: float = 5.0):
        while True:
            if self._target != self.proc.target:
                if self._channel is not None:
                    await self._channel.close()
                self._target = self.proc.target
                self._stub = RoleStubs(self._target, packer_pb2_grpc.PackerStub, PackerServicer.ACCESS)
                self._channel = self._stub
            try:
                return await getattr(self._stub, method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                await asyncio.sleep(0.1)  # the packer is down: retry (every call is idempotent)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class SixGroups:
    """Records 6 groups of 2 executions (3 turns each, then the execution's finish) through
    ``client``, one call at a time; ``sent`` counts the turns recorded so far (36 in all)."""

    def __init__(self, client: Reconnecting) -> None:
        self.client = client
        self.sent = 0

    async def run(self) -> None:
        for g in range(6):
            for k in range(2):
                x = f"g{g}-x{k}"
                for i in range(3):
                    await self.client.call("RecordTurn", tk.turn_proto(x, f"g{g}", i, prompt=5, output=3 + k))
                    self.sent += 1
                await self.client.call("ReportFinish", tk.finish_proto(x, f"g{g}", 2, reward=float(k)))

    async def until(self, turns: int, poll_s: float = 0.005) -> None:
        """Returns once ``turns`` turns were recorded."""
        while self.sent < turns:
            await asyncio.sleep(poll_s)


async def worked(
    client: Reconnecting, batch_id: int = 1, cell_id: str = "worker"
) -> AsyncIterator[packer_pb2.MicroStep]:
    """Claims the micro-steps of ``batch_id`` one at a time (ClaimMicroSteps of one) as
    ``cell_id`` until the batch is closed; yields each micro-step, then acks it
    (AckMicroSteps of one; the caller's checks come before the ack)."""
    while True:
        r = await client.call(
            "ClaimMicroSteps",
            packer_pb2.ClaimMicroStepsRequest(
                cell_id=cell_id, batch_id=batch_id, wait_s=2.0, max_micro_steps=1
            ),
        )
        if r.outcome == CLOSED:
            return
        if r.outcome != CLAIMED:
            continue
        (ms,) = r.micro_steps
        yield ms
        await client.call(
            "AckMicroSteps",
            packer_pb2.AckMicroStepsRequest(
                cell_id=cell_id, batch_id=batch_id, micro_step_ids=[ms.micro_step_id]
            ),
        )
