"""In-memory fakes of the scheduler's store and peers, for unit tests and the simulator.

:class:`FakeStore` keeps the same keys as :class:`~services.scheduler.store.SchedulerStore`
with etcd-like revisions and the same guards (create-if-absent, compare mod revision), and
refuses every write once :meth:`FakeStore.depose` was called (a newer leader exists).
:class:`FakePeers` records every command and plays a cell agent's lifecycle; it can be
scripted to fail a number of calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gyre.errors import Conflict, StaleEpoch, Unavailable
from services.scheduler.ledger import Burst, ExecutionRecord
from services.scheduler.peers import FinishReport, MoveOrder, SupplyUpdate
from services.scheduler.placement import RouteRecord
from services.scheduler.policy import CellState


class _FakeElection:
    def __init__(self, store: FakeStore) -> None:
        self._store = store

    async def current_epoch(self) -> int:
        return self._store.leader_epoch


@dataclasses.dataclass
class _Val:
    value: Any
    mod_revision: int
    version: int


class FakeStore:
    """The scheduler's keys in memory, with revisions and fencing."""

    def __init__(self, epoch: int = 1) -> None:
        self.revision = 1
        self.epoch = epoch
        self.leader_epoch = epoch
        self.bursts: dict[int, _Val] = {}
        self.execs: dict[str, _Val] = {}
        self.routes: dict[str, _Val] = {}
        self.transitions: dict[str, dict[str, Any]] = {}
        self.policy: dict[str, Any] | None = None
        self.fail_next = 0
        self.launch_delay_s = 0.0
        self.election = _FakeElection(self)
        self.writes = 0

    def depose(self, new_epoch: int | None = None) -> None:
        self.leader_epoch = new_epoch or self.epoch + 1000

    def as_leader(self, epoch: int) -> FakeStore:
        """The same data seen by another leader (a failover)."""
        other = FakeStore.__new__(FakeStore)
        other.__dict__.update(self.__dict__)
        other.epoch = epoch
        other.leader_epoch = epoch
        other.election = _FakeElection(other)
        self.leader_epoch = epoch
        return other

    def _write(self) -> int:
        if self.leader_epoch != self.epoch:
            raise StaleEpoch("deposed: the leader key changed")
        if self.fail_next > 0:
            self.fail_next -= 1
            raise Unavailable("etcd (fake) unavailable")
        self.revision += 1
        self.writes += 1
        return self.revision

    async def load(self) -> tuple[list[Burst], list[ExecutionRecord], list[RouteRecord], dict[str, dict[str,
            Any]]]:
        bursts = [Burst.from_json(v.value) for _, v in sorted(self.bursts.items())]
        execs = [ExecutionRecord.from_json(v.value, v.mod_revision) for v in self.execs.values()]
        routes = [RouteRecord.from_json(v.value, v.version, v.mod_revision) for v in self.routes.values()]
        return bursts, execs, routes, {k: dict(v) for k, v in self.transitions.items()}

    async def read_routes(self) -> list[RouteRecord]:
        return [RouteRecord.from_json(v.value, v.version, v.mod_revision) for v in self.routes.values()]

    async def read_execution(self, burst_id: int, execution_id: str) -> ExecutionRecord | None:
        v = self.execs.get(execution_id)
        return None if v is None else ExecutionRecord.from_json(v.value, v.mod_revision)

    async def read_policy(self) -> dict[str, Any] | None:
        return self.policy

    async def dispatch(self, burst: Burst) -> int:
        if burst.burst_id in self.bursts:
            self._write()  # the fence is checked before the guard, as in one etcd txn
            raise Conflict("already dispatched")
        rev = self._write()
        self.bursts[burst.burst_id] = _Val(burst.to_json(), rev, 1)
        return rev

    async def launch(self, rec: ExecutionRecord, route: RouteRecord) -> int:
        if self.launch_delay_s:
            await asyncio.sleep(self.launch_delay_s)  # a slow etcd: launches overlap
        rev = self._write()
        if rec.execution_id in self.execs:
            raise Conflict("already launched")
        self.execs[rec.execution_id] = _Val(rec.to_json(), rev, 1)
        self.routes[rec.execution_id] = _Val(route.to_json(), rev, 1)
        return rev

    async def close(self, rec: ExecutionRecord, expected_revision: int) -> int:
        rev = self._write()
        cur = self.execs.get(rec.execution_id)
        if cur is None or cur.mod_revision != expected_revision:
            raise Conflict("changed")
        self.execs[rec.execution_id] = _Val(rec.to_json(), rev, cur.version + 1)
        self.routes.pop(rec.execution_id, None)
        return rev

    async def move_routes(self, routes: Sequence[tuple[RouteRecord, RouteRecord]]) -> list[int]:
        rev = self._write()
        for old, _ in routes:
            cur = self.routes.get(old.execution_id)
            if cur is None or cur.mod_revision != old.mod_revision:
                raise Conflict("a route changed")
        for _, new in routes:
            cur = self.routes[new.execution_id]
            self.routes[new.execution_id] = _Val(new.to_json(), rev, cur.version + 1)
        return [rev] * len(routes)

    async def put_transition(self, cell_id: str, body: dict[str, Any]) -> int:
        rev = self._write()
        self.transitions[cell_id] = {"cell_id": cell_id, **body}
        return rev

    async def delete_transition(self, cell_id: str) -> int:
        rev = self._write()
        self.transitions.pop(cell_id, None)
        return rev

    def route_of(self, execution_id: str) -> tuple[dict[str, Any], int] | None:
        v = self.routes.get(execution_id)
        return None if v is None else (json.loads(v.value), v.version)


class FakePeers:
    """Cell agents, routers and the packer, in memory. ``states`` is what agents would write."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.states: dict[str, CellState] = {}
        self.reports: dict[str, FinishReport] = {}
        self.report_failures = 0
        self.running: dict[str, int] = {}
        self.batch_id = 1
        self.supply: asyncio.Queue[SupplyUpdate] = asyncio.Queue()
        self.fail_commands = 0
        self.hold_set_state: asyncio.Event | None = None
        self.on_state: Any = None

    async def report_finish(self, report: FinishReport) -> None:
        if self.report_failures > 0:
            self.report_failures -= 1
            raise Unavailable("packer down (fake)")
        self.reports[report.execution_id] = report

    async def watch_supply(self) -> AsyncIterator[SupplyUpdate]:
        while True:
            yield await self.supply.get()

    async def current_batch(self) -> int:
        return self.batch_id

    async def seal_batch(self, epoch: int, batch_id: int) -> None:
        self.calls.append(("seal_batch", (epoch, batch_id)))

    async def set_state(self, target: str, epoch: int, state: CellState, reason: str) -> CellState:
        if self.hold_set_state is not None:
            await self.hold_set_state.wait()
        if self.fail_commands > 0:
            self.fail_commands -= 1
            raise Unavailable("cell agent unreachable (fake)")
        self.calls.append(("set_state", (target, epoch, state)))
        self.states[target] = state
        if self.on_state is not None:
            self.on_state(target, state)
        return state

    async def load_policy(self, target: str, epoch: int, version: int, source_target: str) -> int:
        self.calls.append(("load_policy", (target, epoch, version, source_target)))
        return version

    async def join_batch(self, target: str, epoch: int, batch_id: int, policy_version: int, prefix_size: int,
            core_target: str) -> bool:
        self.calls.append(("join_batch", (target, epoch, batch_id, policy_version, prefix_size, core_target)))
        return True

    async def running_requests(self, target: str) -> int:
        return self.running.get(target, 0)

    async def move_executions(self, router_targets: Sequence[str], epoch: int,
            moves: Sequence[MoveOrder]) -> int:
        self.calls.append(("move_executions", (tuple(router_targets), epoch, tuple(moves))))
        return 0

    async def close(self) -> None:
        return None

    def commands(self, name: str) -> list[Any]:
        return [args for n, args in self.calls if n == name]
