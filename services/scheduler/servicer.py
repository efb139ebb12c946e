"""gRPC edge of the scheduler: HarnessService and SchedulerControl (proto <-> domain).

Thin: validates and converts requests, calls :class:`~services.scheduler.scheduler.Scheduler`,
converts the answer. Domain errors become statuses in :func:`gyre.grpcx.errors.rpc`:
unknown execution -> NOT_FOUND; no token or a token that names no execution ->
UNAUTHENTICATED; another execution's token -> PERMISSION_DENIED; a bad status, NaN/inf or
out-of-range reward, bad key or id -> INVALID_ARGUMENT; not the leader -> UNAVAILABLE;
deposed (stale epoch) -> UNAVAILABLE naming the leader; no harness credential, an unknown API key or
an expired token -> UNAUTHENTICATED; another harness's execution or a caller of another role
-> PERMISSION_DENIED; over the harness's rate or in-flight limit -> RESOURCE_EXHAUSTED.
None of them changes anything. A standby, or a leader deposed under the call, answers
UNAVAILABLE with the leader's target in the details ("the leader is at HOST:PORT") and in
the trailing metadata ``x-gyre-leader``: the harness client retries there.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import TypeVar

import grpc

from gyre import apikeys
from gyre.errors import InvalidArgument, StaleEpoch, Unavailable
from gyre.execution import ExecutionStatus
from gyre.grpcx.auth import AccessTable, allow, caller
from gyre.grpcx.errors import bearer_token, metadata_value, rpc, rpc_stream
from gyre.identity import Role
from gyre.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.events import Event
from services.scheduler.policy import LedgerCounts
from services.scheduler.scheduler import Launched, Scheduler
from services.scheduler.status import CellStatus, TrainingDiagnostics

MAX_ID = 256
HARNESS_SERVICE = "gyre.v1.HarnessService"
T = TypeVar("T")


def _execution_id(value: str) -> str:
    if not value or len(value) > MAX_ID:
        raise InvalidArgument(f"execution_id must have 1..{MAX_ID} characters")
    return value


def execution_to_proto(got: Launched, s: Scheduler) -> scheduler_pb2.Execution:
    rec = got.record
    cfg = s.cfg
    return scheduler_pb2.Execution(
        execution_id=rec.execution_id,
        token=got.token,
        task_id=rec.task_id,
        group_id=rec.group_id,
        burst_id=rec.burst_id,
        policy_version=rec.policy_version,
        task_json=got.task_json,
        openai_base_url=cfg.router_http_url,
        router_target=cfg.router_target,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        heartbeat_deadline_s=cfg.heartbeat_deadline_s,
        model=cfg.model,
    )


def event_to_proto(e: Event) -> scheduler_pb2.SchedulerEvent:
    return scheduler_pb2.SchedulerEvent(
        seq=e.seq,
        time_s=e.time_s,
        kind=e.kind,
        message=e.message,
        cell_id=e.cell_id,
        execution_id=e.execution_id,
        waterlevel=e.waterlevel,
        capacity=e.capacity,
        ready_groups=e.ready_groups,
    )


LEADER_METADATA = "x-gyre-leader"


async def _at_leader(s: Scheduler, context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    """Runs a harness call; a write refused for a stale epoch (this process was deposed
    under it: nothing changed) becomes UNAVAILABLE. Every UNAVAILABLE names the leader in
    the trailing metadata when known, so the harness retries there."""
    try:
        return await call
    except StaleEpoch as exc:
        where = f"; the leader is at {s.lead.leader_target}" if s.lead.leader_target else ""
        _name_leader(s, context)
        raise Unavailable(f"this scheduler was deposed ({exc}){where}") from exc
    except Unavailable:
        _name_leader(s, context)
        raise


def _name_leader(s: Scheduler, context: grpc.aio.ServicerContext) -> None:
    if s.lead.leader_target and not s.leading:
        context.set_trailing_metadata(((LEADER_METADATA, s.lead.leader_target),))


def _ledger(
    burst_id: int, c: LedgerCounts, by_status: Mapping[str, int] | None = None, policy_version: int = 0
) -> scheduler_pb2.Ledger:
    return scheduler_pb2.Ledger(
        burst_id=burst_id,
        dispatched=c.dispatched,
        launched=c.launched,
        finished=c.finished,
        queued=c.queued,
        running=c.running,
        waterlevel=c.waterlevel,
        finished_by_status=dict(by_status or {}),
        policy_version=policy_version,
    )


def _training(t: TrainingDiagnostics | None) -> scheduler_pb2.TrainingDiagnostics | None:
    if t is None:
        return None  # unset: the newest policy record carries no diagnostics
    return scheduler_pb2.TrainingDiagnostics(
        policy_version=t.policy_version,
        tokens=t.tokens,
        clip_fraction=t.clip_fraction,
        behaviour_weight_mean=t.behaviour_weight_mean,
        behaviour_weight_max=t.behaviour_weight_max,
        behaviour_weight_capped_share=t.behaviour_weight_capped_share,
        entropy=t.entropy,
        logprob_gap_lag0=t.logprob_gap_lag0,
        lag_hist=list(t.lag_hist),
        lag_mean=t.lag_mean,
        grad_norm=t.grad_norm,
    )


def _cell(c: CellStatus) -> scheduler_pb2.CellInfo:
    return scheduler_pb2.CellInfo(
        cell_id=c.cell_id,
        kind=c.kind.to_proto(),
        index=c.index,
        state=c.state.to_proto(),
        slots=c.slots,
        routed=c.routed,
        target=c.target,
        policy_version=c.policy_version,
    )


class HarnessServicer(scheduler_pb2_grpc.HarnessServiceServicer):
    """What harnesses call."""

    ACCESS = AccessTable(
        HARNESS_SERVICE,
        {
            # A harness certificate names the harness; where harnesses share one certificate, each
            # also sends its API key (harness_gate). Heartbeats and finishes also need the
            # execution's token, held by the harness that acquired it.
            "AcquireExecution": allow(Role.HARNESS),
            "Heartbeat": allow(Role.HARNESS),
            "FinishExecution": allow(Role.HARNESS),
        },
    )

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    def _harness(self, context: grpc.aio.ServicerContext, claimed: str = "") -> str | None:
        return self.s.harnesses.principal(caller(), metadata_value(context, apikeys.METADATA_KEY), claimed)

    @rpc
    async def AcquireExecution(
        self, request: scheduler_pb2.AcquireExecutionRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AcquireExecutionResponse:
        if not 1 <= len(request.harness_id) <= 128:
            raise InvalidArgument("harness_id must have 1..128 characters")
        if not (math.isfinite(request.wait_s) and 0.0 <= request.wait_s <= 60.0):
            raise InvalidArgument("wait_s must be in [0, 60]")
        harness = self._harness(context, request.harness_id) or request.harness_id
        got, exhausted, retry = await _at_leader(
            self.s, context, self.s.acquire(harness, request.wait_s, request.idempotency_key)
        )
        if got is None:
            return scheduler_pb2.AcquireExecutionResponse(burst_exhausted=exhausted, retry_after_s=retry)
        return scheduler_pb2.AcquireExecutionResponse(execution=execution_to_proto(got, self.s))

    @rpc
    async def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatResponse:
        eid = _execution_id(request.execution_id)
        token = bearer_token(context)
        left, state = await _at_leader(self.s, context, self.s.heartbeat(eid, token, self._harness(context)))
        return scheduler_pb2.HeartbeatResponse(deadline_s=left, status=state.to_proto())

    @rpc
    async def FinishExecution(
        self, request: scheduler_pb2.FinishExecutionRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.FinishExecutionResponse:
        eid = _execution_id(request.execution_id)
        token = bearer_token(context)
        try:
            status = ExecutionStatus.from_proto(request.status)
        except InvalidArgument:
            raise InvalidArgument("status must be COMPLETED, FAILED or CANCELLED") from None
        out = await _at_leader(
            self.s,
            context,
            self.s.finish(
                eid, token, status, request.reward, request.idempotency_key, self._harness(context)
            ),
        )
        return scheduler_pb2.FinishExecutionResponse(
            status=out.record.state.to_proto(), duplicate=out.duplicate
        )


class ControlServicer(scheduler_pb2_grpc.SchedulerControlServicer):
    """What operators and dashboards call."""

    ACCESS = AccessTable(
        "gyre.v1.SchedulerControl",
        {
            "GetStatus": allow(Role.DASHBOARD, Role.OPERATOR),
            "WatchEvents": allow(Role.DASHBOARD, Role.OPERATOR),
            "ReportEngineFailure": allow(Role.ROUTER),
        },
    )

    def __init__(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    @rpc
    async def GetStatus(
        self, request: scheduler_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStatus:
        st = self.s.status()
        return scheduler_pb2.SchedulerStatus(
            epoch=st.epoch,
            ledger=_ledger(st.burst_id, st.burst, st.burst_by_status),
            capacity=st.capacity,
            ready_groups=st.ready_groups,
            batch_size=st.batch_size,
            cells=[_cell(c) for c in st.cells],
            policy_version=st.policy_version,
            reroutes=st.reroutes,
            bursts_completed=st.bursts_completed,
            transitions_to_training=st.to_training,
            transitions_to_rollout=st.to_rollout,
            total=_ledger(st.burst_id, st.total, st.total_by_status),
            policy=st.policy,
            leader=st.leader,
            versions=[_ledger(0, c, policy_version=v) for v, c in st.versions.items()],
            migrations=st.migrations,
            open_bursts=st.open_bursts,
            stale_rule=st.stale_rule,
            groups_cancelled=st.groups_cancelled,
            groups_restamped=st.groups_restamped,
            training=_training(st.training),
        )

    @rpc
    async def ReportEngineFailure(
        self, request: scheduler_pb2.ReportEngineFailureRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportEngineFailureResponse:
        dead, executions = await self.s.engine_failed(request.cell_id, request.target, request.reason)
        return scheduler_pb2.ReportEngineFailureResponse(dead=dead, executions=executions)

    @rpc_stream
    async def WatchEvents(
        self, request: scheduler_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SchedulerEvent]:
        if request.after_seq < 0:
            raise InvalidArgument("after_seq must be >= 0")
        seq = request.after_seq
        while True:
            for e in await self.s.events.wait_after(seq, 5.0):
                yield event_to_proto(e)
                seq = e.seq
