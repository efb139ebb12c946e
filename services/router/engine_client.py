"""The gRPC clients the router uses: cell agents' Engine service (one cached channel per
target) and the packer's RecordTurn and GetTrajectory. Every call carries a deadline;
failures come back as domain errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from gyre.config import ServiceConfig
from gyre.errors import from_rpc_error
from gyre.grpcx.channel import open_channel, unary
from gyre.identity import Role
from gyre.tokens import Chunk
from gyre.v1 import cell_agent_pb2, cell_agent_pb2_grpc, packer_pb2, packer_pb2_grpc
from services.router.engine import EngineRequest, KvHandle
from services.router.turns import Turn


class GrpcEngineClient:
    """Engine calls over gRPC; channels are opened lazily and kept per target."""

    def __init__(self, config: ServiceConfig) -> None:
        self._config = config
        self._stubs: dict[str, cell_agent_pb2_grpc.EngineStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, target: str) -> cell_agent_pb2_grpc.EngineStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = open_channel(target, self._config, Role.CELL_AGENT)
            self._channels[target] = channel
            stub = self._stubs[target] = cell_agent_pb2_grpc.EngineStub(channel)
        return stub

    async def generate(self, target: str, request: EngineRequest, timeout_s: float) -> AsyncIterator[Chunk]:
        call = self._stub(target).Generate(request.to_proto(), timeout=timeout_s)
        try:
            async for msg in call:
                yield Chunk.from_proto(msg)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        finally:
            call.cancel()  # no-op when the stream already ended; aborts the engine request otherwise

    async def abort(self, target: str, request_id: str, timeout_s: float) -> None:
        await unary(self._stub(target).Abort, cell_agent_pb2.AbortRequest(request_id=request_id), timeout_s)

    async def export_kv(self, target: str, request_id: str, timeout_s: float) -> KvHandle | None:
        reply = await unary(
            self._stub(target).ExportKv, cell_agent_pb2.ExportKvRequest(request_id=request_id), timeout_s
        )
        return (
            KvHandle.from_proto(reply.handle) if reply.HasField("handle") and reply.handle.handle_id else None
        )

    async def release_kv(self, target: str, handle_id: str, timeout_s: float) -> None:
        await unary(
            self._stub(target).ReleaseKv, cell_agent_pb2.ReleaseKvRequest(handle_id=handle_id), timeout_s
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


class PackerTurnSink:
    """Packer.RecordTurn and GetTrajectory with a deadline."""

    def __init__(self, target: str, config: ServiceConfig) -> None:
        self._channel = open_channel(target, config, Role.PACKER)
        self._stub = packer_pb2_grpc.PackerStub(self._channel)
        self._timeout_s = config.rpc_timeout_s

    async def record(self, turn: Turn) -> None:
        await unary(self._stub.RecordTurn, turn.to_proto(), self._timeout_s)

    async def trajectory(self, execution_id: str, idempotency_key: str) -> tuple[Turn | None, int]:
        request = packer_pb2.GetTrajectoryRequest(execution_id=execution_id, idempotency_key=idempotency_key)
        reply = await unary(self._stub.GetTrajectory, request, self._timeout_s)
        return (Turn.from_proto(reply.last) if reply.HasField("last") else None), reply.next_turn_index

    async def close(self) -> None:
        await self._channel.close()
