"""Scriptable gRPC stand-ins for the scheduler's peers, for integration and fault tests.

:class:`FakeCellAgent` serves CellControl + Engine.GetLoad on one port, registers
``keys.cell`` under its own lease (``lease_ttl_s``, refreshed every second) and writes
``keys.cell_state`` with the same fenced transaction as the real agent (leader create
revision == command epoch), so a deposed leader's command is refused. It records every
command and can hold a target state or JoinBatch (the command hangs until released;
``waiting`` counts the held ones) to freeze a transition at a chosen step. :class:`FakeRouter`
records MoveExecutions (the packer: :class:`testkit.fake_packer.FakePacker`). Both
bind 127.0.0.1 on a free port. :class:`Harness` is a minimal
harness over gRPC; :func:`write_config` writes a cluster YAML for scheduler processes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from gyre.errors import GyreError, StaleEpoch
from gyre.etcd import Etcd, Keys, Op
from gyre.etcd.client import create_revision_is
from gyre.etcd.values import CellKind, CellRecord
from gyre.fencing import FenceGuard
from gyre.grpcx.errors import rpc
from gyre.identity import Role
from gyre.v1 import (
    cell_agent_pb2,
    cell_agent_pb2_grpc,
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from testkit.loopback import Registrar, serve_loopback
from testkit.tls import channel, tls

log = logging.getLogger(__name__)
_NAMES = {v: k for k, v in common_pb2.CellState.items()}


async def _serve(register: list[tuple[Any, Registrar]], identity: str) -> tuple[grpc.aio.Server, str]:
    """A server presenting ``identity``'s certificate (the scheduler checks its peers' roles)."""
    return await serve_loopback(register, tls(identity))


class FakeCellAgent(cell_agent_pb2_grpc.CellControlServicer, cell_agent_pb2_grpc.EngineServicer):
    """One fake cell: registration, fenced state writes, command log."""

    def __init__(
        self, etcd: Etcd, keys: Keys, cell_id: str, kind: str, index: int, slots: int, lease_ttl_s: int = 5
    ) -> None:
        self.etcd, self.keys = etcd, keys
        self.lease_ttl_s = lease_ttl_s
        self.cell_id, self.kind, self.index, self.slots = cell_id, kind, index, slots
        self.state = "ROLLOUT"
        self.fence = FenceGuard()
        self.commands: list[tuple[str, int, Any]] = []
        self.policy_version = 0
        self.running = 0
        self.hold: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, int] = {}
        """Commands held right now, by ``hold`` key."""
        self.target = ""
        self.lease = 0
        self._server: grpc.aio.Server | None = None
        self._keep: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> FakeCellAgent:
        self._server, self.target = await _serve(
            [
                (self, cell_agent_pb2_grpc.add_CellControlServicer_to_server),
                (self, cell_agent_pb2_grpc.add_EngineServicer_to_server),
            ],
            self.cell_id,
        )
        self.lease = await self.etcd.grant(self.lease_ttl_s)
        self._keep = asyncio.create_task(self._keepalive())
        await self._register()
        await self.etcd.put(self.keys.cell_state(self.cell_id), self._state_json(0), lease=self.lease)
        return self

    async def _register(self) -> None:
        record = CellRecord(
            self.cell_id,
            CellKind.from_name(self.kind),
            self.index,
            self.slots,
            self.target,
            "mock",
            self.policy_version,
        )
        await self.etcd.put(self.keys.cell(self.cell_id), record.to_json(), lease=self.lease)

    async def _keepalive(self) -> None:
        """Refreshes the lease; a lease that lapsed (this loop was held up longer than its
        TTL) is replaced by a new session with the registration and state put again, as
        the real agent does after an etcd outage."""
        while True:
            await asyncio.sleep(1.0)
            try:
                if await self.etcd.refresh(self.lease) > 0:
                    continue
                self.lease = await self.etcd.grant(self.lease_ttl_s)
                await self._register()
                await self.etcd.put(self.keys.cell_state(self.cell_id), self._state_json(0), lease=self.lease)
                log.warning("fake cell %s: lease lapsed; registered again", self.cell_id)
            except GyreError as exc:  # etcd away (a test pausing it): try again next round
                log.info("fake cell %s: keepalive failed: %s", self.cell_id, exc)

    def _state_json(self, epoch: int, state: str | None = None) -> bytes:
        state = self.state if state is None else state
        return json.dumps({"state": state, "epoch": epoch, "updated_s": time.time()}).encode()

    async def stop(self) -> None:
        if self._keep is not None:
            self._keep.cancel()
            await asyncio.gather(self._keep, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(0)
        if self.lease:
            try:
                await self.etcd.revoke(self.lease)
            except GyreError as exc:  # etcd may be gone at teardown: the lease expires anyway
                log.info("lease revoke at teardown failed: %s", exc)

    async def _held(self, key: str) -> None:
        """Waits while ``hold[key]`` (a target state, or JOIN_BATCH) is held."""
        if key in self.hold:
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                await self.hold[key].wait()
            finally:
                self.waiting[key] -= 1

    def epochs(self) -> set[int]:
        return {e for _, e, _ in self.commands}

    @rpc
    async def SetState(self, request: Any, context: Any) -> Any:
        epoch = self.fence.check(request.fence.epoch)
        want = _NAMES[request.target].removeprefix("CELL_STATE_")
        await self._held(want)
        async with self._lock:
            if want != self.state:
                ok, _ = await self.etcd.txn(
                    [create_revision_is(self.keys.leader(), epoch)],
                    [Op(self.keys.cell_state(self.cell_id), self._state_json(epoch, want), self.lease)],
                )
                if not ok:
                    raise StaleEpoch(f"epoch {epoch} is not the leader's")
            # The state and its command change together (no await between them): a test
            # that sees the new state also sees the command.
            self.state = want
            self.commands.append(("set_state", epoch, want))
        return cell_agent_pb2.SetStateResponse(state=request.target)

    @rpc
    async def LoadPolicy(self, request: Any, context: Any) -> Any:
        epoch = self.fence.check(request.fence.epoch)
        self.policy_version = max(self.policy_version, request.version)
        self.commands.append(("load_policy", epoch, request.version))
        return cell_agent_pb2.LoadPolicyResponse(policy_version=self.policy_version, seconds=0.0)

    @rpc
    async def JoinBatch(self, request: Any, context: Any) -> Any:
        epoch = self.fence.check(request.fence.epoch)
        await self._held("JOIN_BATCH")
        self.commands.append(
            ("join_batch", epoch, (request.batch_id, request.prefix_size, request.core_target))
        )
        return cell_agent_pb2.JoinBatchResponse(joined=True)

    @rpc
    async def GetCellStatus(self, request: Any, context: Any) -> Any:
        return cell_agent_pb2.CellStatus(cell_id=self.cell_id, epoch=self.fence.highest)

    @rpc
    async def GetLoad(self, request: Any, context: Any) -> Any:
        return cell_agent_pb2.EngineLoad(
            cell_id=self.cell_id,
            slots=self.slots,
            running_requests=self.running,
            policy_version=self.policy_version,
            accepting=self.state == "ROLLOUT",
        )


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Records MoveExecutions (fenced); registers under services/router/."""

    def __init__(self, etcd: Etcd, keys: Keys, name: str = "router-fake") -> None:
        self.etcd, self.keys, self.name = etcd, keys, name
        self.fence = FenceGuard()
        self.moves: list[tuple[int, str, str, str, int]] = []
        self.target = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> FakeRouter:
        self._server, self.target = await _serve(
            [(self, router_pb2_grpc.add_RouterServicer_to_server)], "router"
        )
        await self.etcd.put(
            self.keys.service("router", self.name), json.dumps({"target": self.target}).encode()
        )
        return self

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    @rpc
    async def MoveExecutions(self, request: Any, context: Any) -> Any:
        epoch = self.fence.check(request.fence.epoch)
        for m in request.moves:
            self.moves.append((epoch, m.execution_id, m.from_cell, m.to_cell, m.route_epoch))
        return router_pb2.MoveExecutionsResponse(moved_requests=0, remaining_at_source=0)


class Harness:
    """A minimal harness over gRPC."""

    def __init__(self, target: str, name: str = "harness") -> None:
        # Harness calls as a harness, status as an operator (each RPC admits its roles).
        self.channel = channel(target, name, Role.HARNESS, Role.SCHEDULER)
        self.operator = channel(target, "operator", expect=Role.SCHEDULER)
        self.h = scheduler_pb2_grpc.HarnessServiceStub(self.channel)
        self.c = scheduler_pb2_grpc.SchedulerControlStub(self.operator)

    async def status(self) -> scheduler_pb2.SchedulerStatus:
        return await self.c.GetStatus(scheduler_pb2.GetStatusRequest(), timeout=5)

    async def wait_leader(self, timeout_s: float = 20.0) -> scheduler_pb2.SchedulerStatus:
        for _ in range(int(timeout_s * 10)):
            try:
                st = await self.status()
                if st.leader and st.total.dispatched:
                    return st
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError("no leader")

    async def acquire(self, wait_s: float = 10.0) -> scheduler_pb2.Execution | None:
        # The call returns as soon as a slot is free: a long wait costs nothing when the
        # cluster is ready, and keeps tests from failing on a slow (loaded) start.
        r = await self.h.AcquireExecution(
            scheduler_pb2.AcquireExecutionRequest(harness_id="t", wait_s=wait_s), timeout=wait_s + 5
        )
        return r.execution if r.HasField("execution") else None

    async def finish(
        self,
        e: scheduler_pb2.Execution,
        reward: float = 1.0,
        status=common_pb2.EXECUTION_STATUS_COMPLETED,
        token: str | None = None,
        key: str = "k",
        execution_id: str | None = None,
    ) -> scheduler_pb2.FinishExecutionResponse:
        req = scheduler_pb2.FinishExecutionRequest(
            execution_id=execution_id or e.execution_id, status=status, reward=reward, idempotency_key=key
        )
        return await self.h.FinishExecution(
            req, metadata=(("authorization", f"Bearer {token or e.token}"),), timeout=5
        )

    async def close(self) -> None:
        await self.channel.close()
        await self.operator.close()


def write_config(tmp_path: Path, endpoint: str, cluster: str, **scheduler) -> Path:
    base = dict(
        batch_size=3,
        group_size=2,
        over_provision=0.0,
        interval_s=0.3,
        fraction=0.5,
        reconcile_s=0.1,
        lease_ttl_s=2,
        log_json=False,
        drain_timeout_s=2.0,
        heartbeat_deadline_s=60.0,
    )
    base.update(scheduler)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        json.dumps({"cluster": {"name": cluster, "etcd_endpoints": [endpoint]}, "scheduler": base})
    )
    return path


async def connect(endpoint: str) -> Etcd:
    etcd = Etcd([endpoint], timeout_s=3.0)
    await etcd.connect()
    return etcd


async def read_events(h: Harness, idle_s: float = 0.5) -> list[scheduler_pb2.SchedulerEvent]:
    """Every event so far (the stream stays open: stop after ``idle_s`` without one)."""
    call = h.c.WatchEvents(scheduler_pb2.WatchEventsRequest(after_seq=0))
    it = call.__aiter__()
    events = []
    try:
        while True:
            events.append(await asyncio.wait_for(it.__anext__(), idle_s))
    except TimeoutError:
        pass
    finally:
        call.cancel()
    return events


async def wait_until(pred, timeout_s: float = 15.0, what: str = "condition"):
    """``pred()``'s first true value (``pred`` a plain or a coroutine function), polled
    every 50 ms for up to ``timeout_s``."""
    for _ in range(int(timeout_s * 20)):
        got = pred()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
