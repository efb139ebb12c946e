"""gRPC servicers of the cell agent (Engine, CellControl): proto <-> domain, nothing more.

Input is validated before it reaches the cell; domain errors become statuses through
``@rpc`` / ``@rpc_stream``. Cancelling a Generate call closes the cell's stream, which
aborts the engine request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from gyre.errors import InvalidArgument, ResourceExhausted
from gyre.grpcx.auth import AccessTable, allow
from gyre.grpcx.errors import rpc, rpc_stream
from gyre.identity import Role
from gyre.telemetry import tag_execution
from gyre.v1 import cell_agent_pb2 as pb
from gyre.v1 import cell_agent_pb2_grpc as pb_grpc
from gyre.v1 import common_pb2
from services.cell_agent.cell import Cell, CellStatus
from services.cell_agent.engine_stream import EngineStreamSession
from services.cell_agent.engines.base import Chunk, KvHandle, Sampling
from services.cell_agent.hooks import JoinBatch
from services.cell_agent.lifecycle import CellState

MAX_ID_CHARS = 256
MAX_STREAM_REQUESTS = 4096
"""Requests one GenerateStream call may hold at once (a router's share of one engine)."""


def _check_id(value: str, what: str) -> str:
    if not value:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{what} is longer than {MAX_ID_CHARS} characters")
    return value


def _fence(msg: common_pb2.Fence, has: bool) -> int:
    if not has or msg.epoch <= 0:
        raise InvalidArgument("fence.epoch must be > 0")
    return int(msg.epoch)


def load_to_proto(s: CellStatus) -> pb.EngineLoad:
    return pb.EngineLoad(
        cell_id=s.identity.cell_id,
        slots=s.identity.slots,
        running_requests=s.running_requests,
        policy_version=s.policy_version,
        accepting=s.accepting,
        engine=s.identity.engine,
    )


def status_to_proto(s: CellStatus) -> pb.CellStatus:
    return pb.CellStatus(
        cell_id=s.identity.cell_id,
        kind=s.identity.kind.to_proto(),
        index=s.identity.index,
        state=s.state.to_proto(),
        load=load_to_proto(s),
        epoch=s.epoch,
    )


class EngineServicer(pb_grpc.EngineServicer):
    """The token-level engine API; only the router calls it (the scheduler reads loads)."""

    ACCESS = AccessTable(
        "gyre.v1.Engine",
        {
            "Generate": allow(Role.ROUTER),
            "GenerateStream": allow(Role.ROUTER),
            "Abort": allow(Role.ROUTER),
            "GetLoad": allow(Role.ROUTER, Role.SCHEDULER, Role.DASHBOARD, Role.OPERATOR),
            "ExportKv": allow(Role.ROUTER),
            "ReleaseKv": allow(Role.ROUTER),
        },
    )

    def __init__(
        self, cell: Cell, max_prompt_tokens: int, max_tokens_limit: int, vocab_limit: int = 1 << 24
    ) -> None:
        self._cell = cell
        self._max_prompt = max_prompt_tokens
        self._max_tokens = max_tokens_limit
        self._vocab_limit = vocab_limit
        self._sessions: set[EngineStreamSession] = set()
        self._draining = False

    async def drain_streams(self) -> None:
        """The cell is stopping (a stop-intake hook): every GenerateStream call refuses new
        starts and ends once its running requests have finished."""
        self._draining = True
        for session in self._sessions:
            session.drain()

    @rpc_stream
    async def Generate(
        self, request: pb.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TokenChunk]:
        stream = self._start(request)
        tag_execution(request.execution_id, request_id=request.request_id)
        async for chunk in stream:
            yield chunk.to_proto()

    @rpc_stream
    async def GenerateStream(
        self, requests: AsyncIterator[pb.EngineStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineStep]:
        session = EngineStreamSession(self._start, MAX_STREAM_REQUESTS)
        if self._draining:
            session.drain()
        self._sessions.add(session)
        try:
            async for step in session.serve(requests):
                yield step
        finally:
            self._sessions.discard(session)

    def _start(self, request: pb.EngineGenerateRequest) -> AsyncIterator[Chunk]:
        """Validates a generate request and starts it at the cell (raises for bad input)."""
        request_id = _check_id(request.request_id, "request_id")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise InvalidArgument("prompt_token_ids is empty")
        if len(prompt) > self._max_prompt:
            raise ResourceExhausted(f"prompt of {len(prompt)} tokens exceeds {self._max_prompt}")
        if any(t < 0 or t >= self._vocab_limit for t in prompt):
            raise InvalidArgument("prompt_token_ids out of range")
        if not request.HasField("sampling"):
            raise InvalidArgument("sampling is required (max_tokens >= 1)")
        sampling = Sampling.from_proto(request.sampling, self._max_tokens)
        if request.required_policy_version < 0:
            raise InvalidArgument("required_policy_version must be >= 0")
        kv = KvHandle.from_proto(request.kv_handle) if request.HasField("kv_handle") else None
        return self._cell.generate(request_id, prompt, sampling, int(request.required_policy_version), kv)

    @rpc
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=await self._cell.abort(_check_id(request.request_id, "request_id")))

    @rpc
    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.EngineLoad:
        return load_to_proto(self._cell.status())

    @rpc
    async def ExportKv(
        self, request: pb.ExportKvRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExportKvResponse:
        handle = await self._cell.export_kv(_check_id(request.request_id, "request_id"))
        return pb.ExportKvResponse(handle=handle.to_proto()) if handle else pb.ExportKvResponse()

    @rpc
    async def ReleaseKv(
        self, request: pb.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseKvResponse:
        await self._cell.release_kv(_check_id(request.handle_id, "handle_id"))
        return pb.ReleaseKvResponse()


class CellControlServicer(pb_grpc.CellControlServicer):
    """Role control; only the scheduler leader calls it, every call fenced."""

    ACCESS = AccessTable(
        "gyre.v1.CellControl",
        {
            "SetState": allow(Role.SCHEDULER),
            "GetCellStatus": allow(Role.SCHEDULER, Role.DASHBOARD, Role.OPERATOR),
            "LoadPolicy": allow(Role.SCHEDULER),
            "JoinBatch": allow(Role.SCHEDULER),
        },
    )

    def __init__(self, cell: Cell) -> None:
        self._cell = cell

    @rpc
    async def SetState(
        self, request: pb.SetStateRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetStateResponse:
        epoch = _fence(request.fence, request.HasField("fence"))
        if request.target == common_pb2.CELL_STATE_UNSPECIFIED:
            raise InvalidArgument("target state is required")
        target = CellState.from_proto(request.target)
        if len(request.reason) > 1024:
            raise InvalidArgument("reason is longer than 1024 characters")
        state = await self._cell.set_state(target, epoch, request.reason)
        return pb.SetStateResponse(state=state.to_proto())

    @rpc
    async def GetCellStatus(
        self, request: pb.GetCellStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.CellStatus:
        return status_to_proto(self._cell.status())

    @rpc
    async def LoadPolicy(
        self, request: pb.LoadPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadPolicyResponse:
        epoch = _fence(request.fence, request.HasField("fence"))
        if request.version < 0:
            raise InvalidArgument("version must be >= 0")
        version, seconds = await self._cell.load_policy(epoch, int(request.version), request.source_target)
        return pb.LoadPolicyResponse(policy_version=version, seconds=seconds)

    @rpc
    async def JoinBatch(
        self, request: pb.JoinBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinBatchResponse:
        epoch = _fence(request.fence, request.HasField("fence"))
        if request.prefix_size < 1:
            raise InvalidArgument("prefix_size must be >= 1")
        cmd = JoinBatch(
            epoch,
            int(request.batch_id),
            int(request.policy_version),
            int(request.prefix_size),
            request.core_target,
        )
        return pb.JoinBatchResponse(joined=await self._cell.join_batch(cmd))
