"""In-memory fakes of the scheduler's store and peers, for unit tests and the simulator.

:class:`FakeStore` keeps the same keys as :class:`~services.scheduler.store.SchedulerStore`
with etcd-like revisions and the same guards (create-if-absent, compare mod revision), and
refuses every write once :meth:`FakeStore.depose` was called (a newer leader exists).
Stand-in peers live in :mod:`testkit.recording_peers`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from gyre.errors import Conflict, StaleEpoch, Unavailable
from gyre.etcd.values import Route
from services.scheduler.ledger import ArchiveSummary, Burst, ExecutionRecord
from services.scheduler.store import Stored


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
        self.summary: _Val | None = None
        self.fail_next = 0
        self.lose_next_close_answer = 0
        self.lose_next_launch_answer = 0
        """Closes whose write lands but whose answer is lost (Unavailable after the write)."""
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

    async def load(self) -> Stored:
        summary = (
            ArchiveSummary()
            if self.summary is None
            else ArchiveSummary.from_json(self.summary.value, self.summary.mod_revision)
        )
        bursts = [Burst.from_json(v.value) for _, v in sorted(self.bursts.items())]
        execs = [ExecutionRecord.from_json(v.value, v.mod_revision) for v in self.execs.values()]
        routes = [
            Route.from_json(v.value, v.version, mod_revision=v.mod_revision) for v in self.routes.values()
        ]
        return Stored(bursts, execs, routes, {k: dict(v) for k, v in self.transitions.items()}, summary)

    async def archive(self, summary: ArchiveSummary, expected_revision: int) -> int:
        rev = self._write()
        if (self.summary.mod_revision if self.summary else 0) != expected_revision:
            raise Conflict("the summary changed")
        self.summary = _Val(summary.to_json(), rev, (self.summary.version if self.summary else 0) + 1)
        self.bursts.pop(summary.through, None)
        for eid in [e for e, v in self.execs.items() if json.loads(v.value)["burst_id"] == summary.through]:
            del self.execs[eid]
        return rev

    async def read_routes(self) -> list[Route]:
        return [
            Route.from_json(v.value, v.version, mod_revision=v.mod_revision) for v in self.routes.values()
        ]

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

    async def launch(self, rec: ExecutionRecord, route: Route) -> int:
        if self.launch_delay_s:
            await asyncio.sleep(self.launch_delay_s)  # a slow etcd: launches overlap
        rev = self._write()
        if rec.execution_id in self.execs:
            raise Conflict("already launched")
        self.execs[rec.execution_id] = _Val(rec.to_json(), rev, 1)
        self.routes[rec.execution_id] = _Val(route.to_json(), rev, 1)
        if self.lose_next_launch_answer > 0:
            self.lose_next_launch_answer -= 1
            raise Unavailable("etcd (fake) applied the launch, then its answer was lost")
        return rev

    async def close(self, rec: ExecutionRecord, expected_revision: int) -> int:
        rev = self._write()
        cur = self.execs.get(rec.execution_id)
        if (cur.mod_revision if cur is not None else 0) != expected_revision:
            raise Conflict("changed")
        self.execs[rec.execution_id] = _Val(rec.to_json(), rev, (cur.version if cur is not None else 0) + 1)
        self.routes.pop(rec.execution_id, None)
        if self.lose_next_close_answer > 0:
            self.lose_next_close_answer -= 1
            raise Unavailable("etcd (fake) applied the close, then its answer was lost")
        return rev

    async def restamp(self, rec: ExecutionRecord, expected_revision: int) -> int:
        rev = self._write()
        cur = self.execs.get(rec.execution_id)
        if cur is None or cur.mod_revision != expected_revision:
            raise Conflict("changed")
        self.execs[rec.execution_id] = _Val(rec.to_json(), rev, cur.version + 1)
        return rev

    async def move_routes(self, routes: Sequence[tuple[Route, Route]]) -> list[int]:
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
