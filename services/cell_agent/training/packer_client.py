"""The packer's claim API for one training cell, over gRPC (the real MicroStepSource)."""

from __future__ import annotations

import grpc

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

    async def claim_many(
        self, batch_id: int, policy_version: int, wait_s: float, max_micro_steps: int, claim_id: str = ""
    ) -> list[Claim]:
        """Claims up to ``max_micro_steps`` in one ClaimMicroSteps call: one CLAIMED claim per
        micro-step, or a single WAIT / CLOSED claim. Idempotent on ``claim_id``: a retry
        answers the micro-steps the first call claimed that this cell still holds."""
        resp = await unary(
            self._stub.ClaimMicroSteps,
            ppb.ClaimMicroStepsRequest(
                cell_id=self.cell_id,
                batch_id=batch_id,
                policy_version=policy_version,
                wait_s=wait_s,
                claim_id=claim_id,
                max_micro_steps=max_micro_steps,
            ),
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


def _claims(resp: ppb.ClaimMicroStepsResponse) -> list[Claim]:
    """One CLAIMED claim per micro-step, or a single WAIT / CLOSED claim."""
    outcome = Outcome.from_proto(resp.outcome)
    if outcome is not Outcome.CLAIMED:
        return [Claim(outcome, None, resp.claim_ttl_s)]
    return [Claim(outcome, MicroStep.from_proto(m), resp.claim_ttl_s) for m in resp.micro_steps]
