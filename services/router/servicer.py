"""The gRPC Router service: thin translation between gyre.v1 messages and the CallManager;
domain errors become statuses through @rpc / @rpc_stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from gyre.errors import InvalidArgument
from gyre.etcd.election import verified_fence
from gyre.fencing import FenceGuard
from gyre.grpcx.auth import AccessTable, allow
from gyre.grpcx.errors import bearer_token, rpc, rpc_stream
from gyre.identity import Role
from gyre.ids import check_idempotency_key
from gyre.telemetry import tag_execution
from gyre.v1 import router_pb2, router_pb2_grpc
from services.router.call_stream import CallStreamSession, Part
from services.router.calls import ModelCall
from services.router.engine import Sampling
from services.router.limits import CallLimits
from services.router.manager import CallManager
from services.router.store import RouteStore
from services.router.turns import TurnRecorder


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7")."""
    peer = context.peer() or ""
    return peer.rpartition(":")[0] or peer


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate (token level), GenerateStream (many calls answered once on one stream),
    MoveExecutions (fenced, from the scheduler), GetRouterStatus."""

    ACCESS = AccessTable(
        "gyre.v1.Router",
        {
            "Generate": allow(Role.HARNESS),  # and the execution's token
            "GenerateStream": allow(Role.HARNESS),  # and each call's execution token
            "MoveExecutions": allow(Role.SCHEDULER),
            "GetRouterStatus": allow(Role.SCHEDULER, Role.DASHBOARD, Role.OPERATOR),
        },
    )

    def __init__(
        self,
        *,
        manager: CallManager,
        store: RouteStore | None,
        turns: TurnRecorder,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_prompt_tokens: int,
        max_tokens_limit: int,
        request_timeout_s: float,
        move_route_wait_s: float,
        context_tokens: int = 0,
        turn_tokens: int = 0,
        max_stream_calls: int = 4096,
    ) -> None:
        self._manager = manager
        self._max_stream_calls = max_stream_calls
        self._store = store
        self._turns = turns
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._max_prompt_tokens = max_prompt_tokens
        self._limits = CallLimits(max_prompt_tokens, max_tokens_limit, context_tokens, turn_tokens)
        self._max_tokens_limit = max_tokens_limit
        self._request_timeout_s = request_timeout_s
        self._move_route_wait_s = move_route_wait_s
        # The fence floor comes from etcd only (a read when a command brings a newer epoch,
        # and this mirror of the leader key: __main__ runs it), never from a command.
        self.leader_mirror = None
        if store is not None:
            self.fence, self.leader_mirror = verified_fence(store.etcd, store.keys.leader())
        else:
            self.fence = FenceGuard()

    @rpc_stream
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        remaining = context.time_remaining()
        timeout_s = self._request_timeout_s if remaining is None else min(remaining, self._request_timeout_s)
        async for response in self._generate(bearer_token(context), request, _peer_host(context), timeout_s):
            yield response

    @rpc_stream
    async def GenerateStream(
        self, requests: AsyncIterator[router_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateStreamResponse]:
        peer = _peer_host(context)

        async def serve(
            token: str, request: router_pb2.GenerateRequest, part: Part | None
        ) -> list[router_pb2.GenerateResponse]:
            request.answer_once = part is None
            responses = self._generate(token, request, peer, self._request_timeout_s)
            if part is None:
                return [r async for r in responses]
            last = None
            async for response in responses:  # every message but the last goes out as a part
                if last is not None:
                    part(last)
                last = response
            return [last] if last is not None else []

        async for message in CallStreamSession(serve, self._max_stream_calls).serve(requests):
            yield message

    async def _generate(
        self, token: str, request: router_pb2.GenerateRequest, peer: str, timeout_s: float
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """One model call (Generate's, or one on a GenerateStream): authorized by the
        execution's token, checked, run; raises a GyreError."""
        if not request.execution_id:
            raise InvalidArgument("execution_id is required")
        if self._store is not None:
            route = await self._store.authorize(token, request.execution_id, peer=peer)
        else:
            route = self._manager.routes.authorize(token, request.execution_id)
        tag_execution(route.execution_id, cell_id=route.cell_id)
        prompt = list(request.prompt_token_ids)
        if not 1 <= len(prompt) <= self._max_prompt_tokens:
            raise InvalidArgument(f"prompt_token_ids must hold 1..{self._max_prompt_tokens} tokens")
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise InvalidArgument(f"prompt token ids must be in [0, {self._vocab_size})")
        if request.prompt_loss_mask and len(request.prompt_loss_mask) != len(prompt):
            raise InvalidArgument("prompt_loss_mask must be empty or as long as the prompt")
        sampling = Sampling.from_proto(request.sampling, self._max_tokens_limit, self._stop_token_ids)
        sampling = self._limits.fit(len(prompt), sampling)
        idempotency_key = check_idempotency_key(request.idempotency_key)
        box: list[ModelCall] = []
        # answer_once: the call wakes this task only when it ended, and its buffer yields one
        # chunk per policy version (one message, unless a move crossed a weight update).
        async for chunk in self._manager.generate(
            route,
            prompt,
            sampling,
            timeout_s,
            box,
            whole=request.answer_once,
            idempotency_key=idempotency_key,
        ):
            yield router_pb2.GenerateResponse(chunk=chunk.to_proto(), reroutes=box[0].reroutes)

    @rpc
    async def MoveExecutions(
        self, request: router_pb2.MoveExecutionsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.MoveExecutionsResponse:
        for move in request.moves:
            if not move.execution_id or move.route_epoch < 0:
                raise InvalidArgument("each move needs an execution_id and a route_epoch >= 0")
        await self.fence.admit(request.fence.epoch)
        # The announced epoch may not have reached the watch yet: read it from etcd.
        if self._store is not None:
            await asyncio.gather(*(self._await_epoch(m.execution_id, m.route_epoch) for m in request.moves))
        moved, remaining = await self._manager.move(
            [m.execution_id for m in request.moves], {m.from_cell for m in request.moves if m.from_cell}
        )
        return router_pb2.MoveExecutionsResponse(moved_requests=moved, remaining_at_source=remaining)

    async def _await_epoch(self, execution_id: str, epoch: int) -> None:
        assert self._store is not None
        loop = asyncio.get_running_loop()
        until = loop.time() + self._move_route_wait_s
        while True:
            route = await self._store.refresh(execution_id)
            if route is None or route.epoch >= epoch or loop.time() >= until:
                return
            await asyncio.sleep(0.02)

    @rpc
    async def GetRouterStatus(
        self, request: router_pb2.GetRouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        s = self._manager.stats
        return router_pb2.RouterStatus(
            inflight=s.inflight,
            reroutes=s.reroutes,
            failed_calls=s.failed_calls,
            turn_records=self._turns.sent,
            kv_handoffs=s.kv_handoffs,
            kv_recomputes=s.kv_recomputes,
        )
