"""The scheduler's outgoing calls (packer, cell agents, routers) behind one small interface.

:class:`Peers` is the interface the scheduler codes against; :class:`GrpcPeers` is the real
one (channels cached per target, a deadline on every call). Tests pass a fake. Every call
that changes another service's state carries the leader's fence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc

from gyre.config import ServiceConfig
from gyre.errors import from_rpc_error
from gyre.execution import ExecutionStatus
from gyre.grpcx.channel import open_channel, unary
from gyre.identity import Role
from gyre.v1 import (
    cell_agent_pb2,
    cell_agent_pb2_grpc,
    common_pb2,
    packer_pb2,
    packer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from services.scheduler.policy import CellState

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FinishReport:
    """What the packer needs to know of a closed execution."""

    execution_id: str
    group_id: str
    group_size: int
    status: ExecutionStatus
    reward: float
    policy_version: int


@dataclasses.dataclass(frozen=True)
class SupplyUpdate:
    """One packer supply signal (gyre.v1.SupplySignal; tokens are packed tokens)."""

    ready_groups: int
    """Ready groups not yet fully claimed, capped by what the current batch needs."""
    batch_needs: int
    batch_id: int
    ready_unassigned: int = 0
    """Ready groups not assigned to a batch (uncapped: supply beyond the current batch)."""
    ready_tokens: float = 0.0
    backlog_tokens: float = 0.0
    """Tokens assigned to a batch and not trained yet."""
    tokens_trained: float = 0.0
    """Tokens trained since the packer started (rates are measured on it)."""
    optimizing: bool = False
    groups_ready_total: int = 0
    """Groups that became ready since the packer started (the arrival rate)."""
    batch_assigned: int = 0
    """Groups assigned to the current batch."""
    groups_filtered: int = 0
    """Groups the packer dropped that the scheduler did not cancel (over the run)."""
    open_context_tokens: float = 0.0
    """Mean context of the open executions, tokens (0: none open, or an older packer)."""


@dataclasses.dataclass(frozen=True)
class MoveOrder:
    """One execution to move (router.Move)."""

    execution_id: str
    from_cell: str
    to_cell: str
    route_epoch: int


class Peers(Protocol):
    """Everything the scheduler asks of other services."""

    async def report_finish(self, report: FinishReport) -> None: ...

    def watch_supply(self) -> AsyncIterator[SupplyUpdate]: ...

    async def current_batch(self) -> int: ...

    async def seal_batch(self, epoch: int, batch_id: int) -> None: ...

    async def set_state(self, target: str, epoch: int, state: CellState, reason: str) -> CellState: ...

    async def load_policy(self, target: str, epoch: int, version: int, source_target: str) -> int: ...

    async def join_batch(
        self, target: str, epoch: int, batch_id: int, policy_version: int, prefix_size: int, core_target: str
    ) -> bool: ...

    async def running_requests(self, target: str) -> int: ...

    async def move_executions(
        self, router_targets: Sequence[str], epoch: int, moves: Sequence[MoveOrder]
    ) -> int: ...

    async def close(self) -> None: ...


_CELL_STATE = {s: getattr(common_pb2, f"CELL_STATE_{s.value}") for s in CellState}
_CELL_STATE_BACK = {v: k for k, v in _CELL_STATE.items()}


class GrpcPeers:
    """The real peers over gRPC."""

    def __init__(
        self, config: ServiceConfig, packer_target: str, timeout_s: float, command_timeout_s: float
    ) -> None:
        self._config = config
        self._packer_target = packer_target
        self._timeout_s = timeout_s
        self._command_timeout_s = command_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, target: str, expect: Role) -> grpc.aio.Channel:
        """One channel per target; the server must hold a certificate of role ``expect``."""
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = open_channel(target, self._config, expect)
        return ch

    def _packer(self) -> packer_pb2_grpc.PackerStub:
        return packer_pb2_grpc.PackerStub(self._channel(self._packer_target, Role.PACKER))

    async def report_finish(self, report: FinishReport) -> None:
        if not self._packer_target:
            return
        req = packer_pb2.FinishReport(
            execution_id=report.execution_id,
            group_id=report.group_id,
            group_size=report.group_size,
            status=report.status.to_proto(),
            reward=report.reward,
            policy_version=report.policy_version,
        )
        await unary(self._packer().ReportFinish, req, self._timeout_s)

    async def watch_supply(self) -> AsyncIterator[SupplyUpdate]:
        if not self._packer_target:
            return
        call = self._packer().WatchSupply(packer_pb2.WatchSupplyRequest())
        try:
            async for sig in call:
                yield SupplyUpdate(
                    int(sig.ready_groups),
                    int(sig.batch_needs),
                    int(sig.batch_id),
                    int(sig.ready_unassigned),
                    float(sig.ready_tokens),
                    float(sig.backlog_tokens),
                    float(sig.tokens_trained),
                    bool(sig.optimizing),
                    int(sig.groups_ready_total),
                    int(sig.batch_assigned),
                    int(sig.groups_filtered),
                    float(sig.open_context_tokens),
                )
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        finally:
            call.cancel()

    async def current_batch(self) -> int:
        if not self._packer_target:
            return 0
        got = await unary(self._packer().GetBatch, packer_pb2.GetBatchRequest(batch_id=0), self._timeout_s)
        return int(got.batch_id)

    async def seal_batch(self, epoch: int, batch_id: int) -> None:
        if not self._packer_target:
            return
        req = packer_pb2.SealBatchRequest(fence=common_pb2.Fence(epoch=epoch), batch_id=batch_id)
        await unary(self._packer().SealBatch, req, self._timeout_s)

    async def set_state(self, target: str, epoch: int, state: CellState, reason: str) -> CellState:
        stub = cell_agent_pb2_grpc.CellControlStub(self._channel(target, Role.CELL_AGENT))
        req = cell_agent_pb2.SetStateRequest(
            fence=common_pb2.Fence(epoch=epoch), target=_CELL_STATE[state], reason=reason
        )
        got = await unary(stub.SetState, req, self._command_timeout_s)
        return _CELL_STATE_BACK.get(got.state, CellState.STARTING)

    async def load_policy(self, target: str, epoch: int, version: int, source_target: str) -> int:
        stub = cell_agent_pb2_grpc.CellControlStub(self._channel(target, Role.CELL_AGENT))
        req = cell_agent_pb2.LoadPolicyRequest(
            fence=common_pb2.Fence(epoch=epoch), version=version, source_target=source_target
        )
        got = await unary(stub.LoadPolicy, req, self._command_timeout_s)
        return int(got.policy_version)

    async def join_batch(
        self, target: str, epoch: int, batch_id: int, policy_version: int, prefix_size: int, core_target: str
    ) -> bool:
        stub = cell_agent_pb2_grpc.CellControlStub(self._channel(target, Role.CELL_AGENT))
        req = cell_agent_pb2.JoinBatchRequest(
            fence=common_pb2.Fence(epoch=epoch),
            batch_id=batch_id,
            policy_version=policy_version,
            prefix_size=prefix_size,
            core_target=core_target,
        )
        got = await unary(stub.JoinBatch, req, self._command_timeout_s)
        return bool(got.joined)

    async def running_requests(self, target: str) -> int:
        stub = cell_agent_pb2_grpc.EngineStub(self._channel(target, Role.CELL_AGENT))
        got = await unary(stub.GetLoad, cell_agent_pb2.GetLoadRequest(), self._timeout_s)
        return int(got.running_requests)

    async def move_executions(
        self, router_targets: Sequence[str], epoch: int, moves: Sequence[MoveOrder]
    ) -> int:
        """Asks every router, concurrently, to move these executions; returns requests still
        at the sources of the routers that answered. Raises only when no router answered."""
        req = router_pb2.MoveExecutionsRequest(
            fence=common_pb2.Fence(epoch=epoch),
            moves=[
                router_pb2.Move(
                    execution_id=m.execution_id,
                    from_cell=m.from_cell,
                    to_cell=m.to_cell,
                    route_epoch=m.route_epoch,
                )
                for m in moves
            ],
        )
        results = await asyncio.gather(
            *(self._move_at(target, req) for target in router_targets), return_exceptions=True
        )
        failed = [
            (t, r) for t, r in zip(router_targets, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed and len(failed) == len(results):
            raise failed[0][1]
        for target, exc in failed:
            # A router that is gone (its registration not lapsed yet) or slow must not keep
            # the others from moving their calls; it follows the route keys in etcd anyway.
            log.warning("MoveExecutions failed at one router", extra={"target": target, "error": repr(exc)})
        return sum(r for r in results if isinstance(r, int))

    async def _move_at(self, target: str, req: router_pb2.MoveExecutionsRequest) -> int:
        stub = router_pb2_grpc.RouterStub(self._channel(target, Role.ROUTER))
        got = await unary(stub.MoveExecutions, req, self._command_timeout_s)
        return int(got.remaining_at_source)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
