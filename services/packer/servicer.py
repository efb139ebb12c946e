"""The packer's gRPC edge: protos to domain calls and back; errors become statuses in @rpc."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from gyre.fencing import FenceGuard
from gyre.grpcx.auth import AccessTable, allow
from gyre.grpcx.errors import rpc, rpc_stream
from gyre.identity import Role
from gyre.v1 import packer_pb2, packer_pb2_grpc
from services.packer.config import PackerConfig
from services.packer.model import Finish, Turn
from services.packer.packer import Packer
from services.packer.wal import WAL_NAME, encode_event, read_durable

SERVICE_NAME = "gyre.v1.Packer"


def counters_to_proto(c: dict[str, Any]) -> packer_pb2.PackerCounters:
    return packer_pb2.PackerCounters(
        produced=c["produced"],
        consumed=c["consumed"],
        buffered=c["buffered"],
        dropped=c["dropped"],
        pending=c["pending"],
        ready=c["ready"],
        assigned=c["assigned"],
        packed=c["packed"],
        claims_expired=c["claims_expired"],
        policy_version=c["policy_version"],
        late_turns=c.get("late_turns", 0),
        turns_replaced=c.get("turns_replaced", 0),
    )


def batch_to_proto(s: dict[str, Any]) -> packer_pb2.BatchStatus:
    fields = {k: v for k, v in s.items() if k != "counters"}
    return packer_pb2.BatchStatus(**fields, counters=counters_to_proto(s["counters"]))


def supply_to_proto(s: dict[str, Any]) -> packer_pb2.SupplySignal:
    fields = {k: v for k, v in s.items() if k != "counters"}
    return packer_pb2.SupplySignal(**fields, counters=counters_to_proto(s["counters"]))


PRE_ENCODED = ("ClaimMicroSteps",)
"""Methods that may answer an already serialized response (bytes; see ``pre_encode``)."""


def _bytes_or(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serializer(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serializer


class _PassBytes:
    """Stands in for the server while the generated registrar adds the handlers: the
    :data:`PRE_ENCODED` methods get a response serializer that passes bytes through."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def _fix(self, handlers: Mapping[str, grpc.RpcMethodHandler]) -> dict[str, grpc.RpcMethodHandler]:
        return {
            m: h._replace(response_serializer=_bytes_or(h.response_serializer)) if m in PRE_ENCODED else h
            for m, h in handlers.items()
        }

    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        for h in handlers:
            prefix = f"/{h.service_name()}/"
            methods = {k[len(prefix) :]: v for k, v in h._method_handlers.items()}
            generic = grpc.method_handlers_generic_handler(h.service_name(), self._fix(methods))
            self._server.add_generic_rpc_handlers((generic,))

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(service, self._fix(handlers))


def add_to_server(servicer: Any, server: Any) -> None:
    """``packer_pb2_grpc.add_PackerServicer_to_server``, where ClaimMicroSteps may answer
    pre-encoded bytes (the wire contract is the generated one: same messages)."""
    packer_pb2_grpc.add_PackerServicer_to_server(servicer, _PassBytes(server))


class PackerServicer(packer_pb2_grpc.PackerServicer):
    """Implements gyre.v1.Packer on a :class:`Packer`."""

    ACCESS = AccessTable(
        SERVICE_NAME,
        {
            "RecordTurn": allow(Role.ROUTER),
            "GetTrajectory": allow(Role.ROUTER),
            "ReportFinish": allow(Role.SCHEDULER),
            "ClaimMicroSteps": allow(Role.CELL_AGENT, own="cell_id"),
            "AckMicroSteps": allow(Role.CELL_AGENT, own="cell_id"),
            "KeepClaims": allow(Role.CELL_AGENT, own="cell_id"),
            "CommitBatch": allow(Role.CELL_AGENT, own="cell_id"),
            "OpenBatch": allow(Role.CELL_AGENT, own="cell_id"),
            "GetBatch": allow(Role.SCHEDULER, Role.CELL_AGENT, Role.DASHBOARD, Role.OPERATOR),
            "WatchSupply": allow(Role.SCHEDULER, Role.DASHBOARD, Role.OPERATOR),
            "ReadLog": allow(Role.OPERATOR),
            "SealBatch": allow(Role.SCHEDULER),
        },
    )

    def __init__(self, packer: Packer, config: PackerConfig, fence: FenceGuard | None = None) -> None:
        self._packer = packer
        self._cfg = config
        # Verified against etcd's leader key (see gyre.fencing); a bare guard without etcd.
        self.fence = fence or FenceGuard()

    @rpc
    async def RecordTurn(self, request: packer_pb2.TurnRecord, context: grpc.aio.ServicerContext) -> Any:
        turn = Turn.from_proto(request, self._cfg.micro_step_token_budget)
        return packer_pb2.RecordTurnResponse(duplicate=await self._packer.record_turn(turn))

    @rpc
    async def ReportFinish(self, request: packer_pb2.FinishReport, context: grpc.aio.ServicerContext) -> Any:
        finish = Finish.from_proto(request, self._cfg.max_group_size, self._cfg.max_abs_reward)
        return packer_pb2.ReportFinishResponse(duplicate=await self._packer.report_finish(finish))

    @rpc
    async def ClaimMicroSteps(
        self, request: packer_pb2.ClaimMicroStepsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        """The response, or its bytes when ``pre_encode`` is on."""
        wait_s = request.wait_s
        remaining = context.time_remaining()
        if remaining is not None:
            # Answer WAIT before the caller's deadline rather than let the call fail.
            wait_s = max(0.0, min(wait_s, remaining - 0.2))
        first, views = await self._packer.claim_many(
            request.cell_id,
            request.batch_id,
            request.policy_version,
            wait_s,
            request.claim_id,
            request.max_micro_steps,
        )
        if self._cfg.pre_encode:
            return first.encode_many(self._packer.wire.micro_step(v) for v in views)
        return first.to_proto_many(views)

    @rpc
    async def AckMicroSteps(
        self, request: packer_pb2.AckMicroStepsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        dups = await self._packer.ack_many(request.cell_id, request.batch_id, list(request.micro_step_ids))
        return packer_pb2.AckMicroStepsResponse(duplicate=dups)

    @rpc
    async def CommitBatch(
        self, request: packer_pb2.CommitBatchRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        batch, _ = await self._packer.commit(request.cell_id, request.batch_id)
        return batch_to_proto(self._packer.batch_status(batch.id))

    @rpc
    async def OpenBatch(self, request: packer_pb2.OpenBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        batch = await self._packer.open_batch(request.cell_id, request.batch_id)
        return batch_to_proto(self._packer.batch_status(batch.id))

    @rpc
    async def KeepClaims(
        self, request: packer_pb2.KeepClaimsRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        return packer_pb2.KeepClaimsResponse(claims=await self._packer.keep(request.cell_id))

    @rpc
    async def GetBatch(self, request: packer_pb2.GetBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        return batch_to_proto(self._packer.batch_status(request.batch_id))

    @rpc
    async def GetTrajectory(
        self, request: packer_pb2.GetTrajectoryRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        turn, index = self._packer.trajectory(request.execution_id, request.idempotency_key)
        reply = packer_pb2.GetTrajectoryResponse(next_turn_index=index)
        if turn is not None:
            reply.last.CopyFrom(turn.to_proto())
        return reply

    @rpc
    async def SealBatch(self, request: packer_pb2.SealBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        await self.fence.admit(request.fence.epoch)
        batch = await self._packer.seal(request.batch_id, request.fence.epoch)
        return batch_to_proto(self._packer.batch_status(batch.id))

    @rpc_stream
    async def ReadLog(
        self, request: packer_pb2.ReadLogRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[packer_pb2.LogChunk]:
        chunks = read_durable(Path(self._cfg.wal_dir) / WAL_NAME)
        try:
            while (events := await asyncio.to_thread(next, chunks, None)) is not None:
                yield packer_pb2.LogChunk(events=[encode_event(e) for e in events])
        finally:
            chunks.close()  # a call that ends early closes the file now, not at collection

    @rpc_stream
    async def WatchSupply(
        self, request: packer_pb2.WatchSupplyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[packer_pb2.SupplySignal]:
        last: packer_pb2.SupplySignal | None = None
        while True:
            changes = self._packer.changes
            signal = supply_to_proto(self._packer.supply())
            key = packer_pb2.SupplySignal()
            key.CopyFrom(signal)
            key.ClearField("counters")  # counters move with every record: not a supply change
            if key != last:
                yield signal
                last = key
            if self._packer.changes == changes:
                await self._packer.wait_changed(None)
            else:
                await asyncio.sleep(0)
