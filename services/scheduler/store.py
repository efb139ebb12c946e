"""The scheduler's etcd adapter: ledger records, routes and transitions, every write fenced.

Layout (gyre/etcd/keys.py): ``keys.burst(b)`` = a burst record (quota, tasks, versions);
``keys.execution(b, id)`` = one execution record, created at launch, rewritten once at close;
``keys.route(id)`` = the route (its version is the route epoch); ``keys.transition(cell)`` =
a transition under way (resumable). Per-execution records are independent (docs/design/tooling.md:
a shared counter key collapses under contention), and the counts are derived by reading them.

``keys.ledger_summary()`` = the :class:`~services.scheduler.accounts.ArchiveSummary` of the
archived bursts, whose burst and execution keys are gone (deleted in the same transaction
that folds them in), so the keys a takeover reads do not grow with the run. Takeover reads
are paged (``Etcd.get_prefix_paged``: ``READ_PAGE`` keys per request, one revision): one
request for the whole ledger would pass gRPC's message limit near 10k executions.

Every write is one :meth:`LeaderElection.fenced_txn`: it also compares the leader key's
create revision with our epoch, so a deposed (e.g. paused) leader changes nothing. A launch
is guarded by "the record does not exist", a close by "the record is at the revision we
read", a reroute by "the route is at the revision we wrote". Launches and closes in flight
at the same time share one transaction (:mod:`services.scheduler.group_commit`: each keeps
its own guards; a lost guard sends them one by one). A lost guard raises
:class:`~gyre.errors.Conflict`; a lost leadership raises :class:`~gyre.errors.StaleEpoch`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from gyre.errors import Conflict, InvalidArgument
from gyre.etcd import Etcd, Keys, LeaderElection, Op
from gyre.etcd.client import create_revision_is, mod_revision_is, prefix_end
from gyre.etcd.values import Route, decode_policy_record
from services.scheduler.accounts import ArchiveSummary
from services.scheduler.group_commit import GroupCommit
from services.scheduler.ledger import Burst, ExecutionRecord

MAX_TXN_OPS = 120
"""etcd refuses transactions with more than 128 operations (its default --max-txn-ops)."""
READ_PAGE = 1000
"""Keys per range request of a takeover (about 400 KiB of execution records)."""

log = logging.getLogger(__name__)


class Stored(NamedTuple):
    """Everything a new leader rebuilds from: the live bursts and their execution records,
    routes, the transitions under way (cell id -> record), and the summary of the archived
    bursts."""

    bursts: list[Burst]
    executions: list[ExecutionRecord]
    routes: list[Route]
    transitions: dict[str, dict[str, Any]]
    summary: ArchiveSummary = ArchiveSummary()


class Election(Protocol):
    """The part of the leader election the scheduler asks directly."""

    async def current_epoch(self) -> int: ...


class Store(Protocol):
    """The scheduler's persistence: reads for a rebuild, and fenced writes, each raising
    :class:`~gyre.errors.Conflict` for a lost guard and :class:`~gyre.errors.StaleEpoch`
    for a lost leadership. :class:`SchedulerStore` is the etcd one."""

    @property
    def election(self) -> Election: ...

    async def load(self) -> Stored: ...

    async def read_routes(self) -> list[Route]: ...

    async def read_execution(self, burst_id: int, execution_id: str) -> ExecutionRecord | None: ...

    async def read_policy(self) -> dict[str, Any] | None: ...

    async def dispatch(self, burst: Burst) -> int: ...

    async def launch(self, rec: ExecutionRecord, route: Route) -> int: ...

    async def close(self, rec: ExecutionRecord, expected_revision: int) -> int: ...

    async def restamp(self, rec: ExecutionRecord, expected_revision: int) -> int: ...

    async def move_routes(self, routes: Sequence[tuple[Route, Route]]) -> list[int]: ...

    async def put_transition(self, cell_id: str, body: dict[str, Any]) -> int: ...

    async def delete_transition(self, cell_id: str) -> int: ...

    async def archive(self, summary: ArchiveSummary, expected_revision: int) -> int: ...


class SchedulerStore:
    """Reads and fenced writes of the scheduler's keys (etcd)."""

    def __init__(self, etcd: Etcd, keys: Keys, election: LeaderElection) -> None:
        self.etcd = etcd
        self.keys = keys
        self.election = election
        # Launches and closes in flight together share fenced transactions (group commit).
        self.group = GroupCommit(election.fenced_txn, MAX_TXN_OPS)

    # Rebuild ------------------------------------------------------------------------------

    async def load(self) -> Stored:
        """Everything a new leader needs, read in pages. The summary is read first: an
        archive that lands between the reads only removes keys it already counts (a record
        of a burst the summary covers is skipped by the ledger)."""
        skv = await self.etcd.get(self.keys.ledger_summary())
        summary = ArchiveSummary() if skv is None else ArchiveSummary.from_json(skv.value, skv.mod_revision)
        _, burst_kvs = await self.etcd.get_prefix_paged(self.keys.bursts(), READ_PAGE)
        _, exec_kvs = await self.etcd.get_prefix_paged(self.keys.executions(), READ_PAGE)
        _, route_kvs = await self.etcd.get_prefix_paged(self.keys.routes(), READ_PAGE)
        _, trans_kvs = await self.etcd.get_prefix_paged(self.keys.transitions(), READ_PAGE)
        bursts = sorted(
            (b for b in map(Burst.from_json, (kv.value for kv in burst_kvs)) if b.burst_id > summary.through),
            key=lambda b: b.burst_id,
        )
        execs = [ExecutionRecord.from_json(kv.value, kv.mod_revision) for kv in exec_kvs]
        routes = [Route.from_json(kv.value, kv.version, mod_revision=kv.mod_revision) for kv in route_kvs]
        transitions = {}
        for kv in trans_kvs:
            body = json.loads(kv.value)
            transitions[str(body["cell_id"])] = body
        return Stored(
            bursts, [r for r in execs if r.burst_id > summary.through], routes, transitions, summary
        )

    async def read_routes(self) -> list[Route]:
        _, kvs = await self.etcd.get_prefix_paged(self.keys.routes(), READ_PAGE)
        return [Route.from_json(kv.value, kv.version, mod_revision=kv.mod_revision) for kv in kvs]

    async def read_execution(self, burst_id: int, execution_id: str) -> ExecutionRecord | None:
        kv = await self.etcd.get(self.keys.execution(burst_id, execution_id))
        return None if kv is None else ExecutionRecord.from_json(kv.value, kv.mod_revision)

    async def read_policy(self) -> dict[str, Any] | None:
        kv = await self.etcd.get(self.keys.policy())
        if kv is None:
            return None
        try:
            return decode_policy_record(kv.value)
        except InvalidArgument as exc:
            log.warning("malformed policy key ignored", extra={"error": str(exc)})
            return None

    # Writes -------------------------------------------------------------------------------

    async def dispatch(self, burst: Burst) -> int:
        """Creates the burst record (only if absent: a burst is dispatched once)."""
        key = self.keys.burst(burst.burst_id)
        ok, rev = await self.election.fenced_txn([create_revision_is(key, 0)], [Op(key, burst.to_json())])
        if not ok:
            raise Conflict(f"burst {burst.burst_id} already dispatched")
        return rev

    async def launch(self, rec: ExecutionRecord, route: Route) -> int:
        """Creates the execution record and its route in one transaction; returns the revision."""
        key = self.keys.execution(rec.burst_id, rec.execution_id)
        rkey = self.keys.route(rec.execution_id)
        ok, rev = await self.group.write(
            [create_revision_is(key, 0)], [Op(key, rec.to_json()), Op(rkey, route.to_json())]
        )
        if not ok:
            raise Conflict(f"{rec.execution_id} already launched")
        return rev

    async def close(self, rec: ExecutionRecord, expected_revision: int) -> int:
        """Writes the final record (if unchanged since ``expected_revision``; 0: if absent, a
        queued execution withdrawn) and deletes the route, in one transaction."""
        key = self.keys.execution(rec.burst_id, rec.execution_id)
        ok, rev = await self.group.write(
            [mod_revision_is(key, expected_revision)],
            [Op(key, rec.to_json()), Op(self.keys.route(rec.execution_id), None)],
        )
        if not ok:
            raise Conflict(f"{rec.execution_id} changed since revision {expected_revision}")
        return rev

    async def restamp(self, rec: ExecutionRecord, expected_revision: int) -> int:
        """Writes a running record with its new stamp (the partial rule), if unchanged since
        ``expected_revision``; its route stays as it is."""
        key = self.keys.execution(rec.burst_id, rec.execution_id)
        ok, rev = await self.group.write([mod_revision_is(key, expected_revision)], [Op(key, rec.to_json())])
        if not ok:
            raise Conflict(f"{rec.execution_id} changed since revision {expected_revision}")
        return rev

    async def archive(self, summary: ArchiveSummary, expected_revision: int) -> int:
        """Folds burst ``summary.through`` (fully closed) into the stored summary and
        deletes its burst key and every execution key under it (one range delete), in one
        transaction, if the stored summary is still at ``expected_revision`` (0: none yet).
        Returns the revision. Bursts are archived one at a time, oldest first."""
        skey = self.keys.ledger_summary()
        prefix = self.keys.executions(summary.through)
        ops = [
            Op(skey, summary.to_json()),
            Op(self.keys.burst(summary.through)),
            Op(prefix, range_end=prefix_end(prefix)),
        ]
        ok, rev = await self.election.fenced_txn([mod_revision_is(skey, expected_revision)], ops)
        if not ok:
            raise Conflict(f"the ledger summary changed since revision {expected_revision}")
        return rev

    async def move_routes(self, routes: Sequence[tuple[Route, Route]]) -> list[int]:
        """Rewrites routes (old -> new), each guarded by the old one's revision, in chunks of
        at most MAX_TXN_OPS; returns each new route's revision. A chunk is all-or-nothing."""
        revs: list[int] = []
        for i in range(0, len(routes), MAX_TXN_OPS):
            chunk = routes[i : i + MAX_TXN_OPS]
            compares = [
                mod_revision_is(self.keys.route(old.execution_id), old.mod_revision) for old, _ in chunk
            ]
            ops = [Op(self.keys.route(new.execution_id), new.to_json()) for _, new in chunk]
            ok, rev = await self.election.fenced_txn(compares, ops)
            if not ok:
                raise Conflict("a route changed under a reroute")
            revs += [rev] * len(chunk)
        return revs

    async def put_transition(self, cell_id: str, body: dict[str, Any]) -> int:
        key = self.keys.transition(cell_id)
        _, rev = await self.election.fenced_txn(
            [], [Op(key, json.dumps({"cell_id": cell_id, **body}).encode())]
        )
        return rev

    async def delete_transition(self, cell_id: str) -> int:
        _, rev = await self.election.fenced_txn([], [Op(self.keys.transition(cell_id), None)])
        return rev
