"""The ledger's accounts: the burst and execution records, the tallies kept as records are
applied, and what is counted from them, archived bursts included: D / L / F of one burst or
of all, and per stamp (the version a group was dispatched with, or the newer one the partial
rule gave it); dispatched groups per stamp; the open bursts and groups; closes by status;
which burst may be archived, and the groups cancelled over the run; the invariants.
:class:`ArchiveSummary` is what remains of archived bursts.

Read-only: :class:`~services.scheduler.ledger.Ledger`, built on these accounts, plans and
applies every change.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from services.scheduler.policy import LedgerCounts

if TYPE_CHECKING:
    from services.scheduler.ledger import Burst, ExecutionRecord


@dataclasses.dataclass(frozen=True)
class ArchiveSummary:
    """What remains of archived bursts: their counts (each was fully launched and closed),
    in one small record however many there were. Bursts are archived oldest first, so
    ``through`` (the newest archived burst id) says which burst records are gone."""

    through: int = 0
    bursts: int = 0
    tasks: int = 0
    executions: int = 0
    by_status: tuple[tuple[str, int], ...] = ()
    revision: int = 0
    """etcd mod revision of the stored summary (0: none stored); not serialized."""
    by_version: tuple[tuple[int, int], ...] = ()
    """Executions per policy version the bursts were dispatched with."""
    cancelled_groups: int = 0
    """Groups of the archived bursts the scheduler cancelled: the dispatch gate counts every
    cancelled group of the run, and a new leader rebuilds the others from the records."""

    def status_counts(self) -> dict[str, int]:
        return dict(self.by_status)

    def add(self, burst: Burst, by_status: dict[str, int], cancelled_groups: int = 0) -> ArchiveSummary:
        """The summary with ``burst`` (fully closed, ``cancelled_groups`` of its groups
        cancelled) folded in."""
        merged = self.status_counts()
        for k, v in by_status.items():
            merged[k] = merged.get(k, 0) + v
        versions = dict(self.by_version)
        versions[burst.policy_version] = versions.get(burst.policy_version, 0) + burst.quota
        return ArchiveSummary(
            burst.burst_id,
            self.bursts + 1,
            self.tasks + len(burst.tasks),
            self.executions + burst.quota,
            tuple(sorted(merged.items())),
            self.revision,
            tuple(sorted(versions.items())),
            self.cancelled_groups + cancelled_groups,
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "through": self.through,
                "bursts": self.bursts,
                "tasks": self.tasks,
                "executions": self.executions,
                "by_status": dict(self.by_status),
                "by_version": {str(v): n for v, n in self.by_version},
                "cancelled_groups": self.cancelled_groups,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> ArchiveSummary:
        d = json.loads(raw)
        return cls(
            int(d["through"]),
            int(d["bursts"]),
            int(d["tasks"]),
            int(d["executions"]),
            tuple(sorted((str(k), int(v)) for k, v in d["by_status"].items())),
            revision,
            tuple(sorted((int(k), int(v)) for k, v in d.get("by_version", {}).items())),
            int(d.get("cancelled_groups", 0)),
        )


def parse_group(group_id: str) -> tuple[int, int]:
    """(burst, task) of "b<burst>-t<task>"; ValueError otherwise."""
    parts = group_id.split("-")
    if len(parts) != 2 or not parts[0].startswith("b") or not parts[1].startswith("t"):
        raise ValueError(group_id)
    return int(parts[0][1:]), int(parts[1][1:])


class LedgerAccounts:
    """The records of one scheduler's bursts and executions, and the counts derived from them."""

    def __init__(self) -> None:
        self.bursts: dict[int, Burst] = {}
        self.records: dict[str, ExecutionRecord] = {}
        self._launched: dict[int, int] = {}  # burst -> records
        self._finished: dict[int, int] = {}  # burst -> final records
        self._by_status: dict[str, int] = {}
        self._last_close: dict[int, float] = {}  # burst -> latest finished_s of its records
        self.cancelled_groups: dict[str, int] = {}
        """Groups of the live bursts the scheduler cancelled (cancel early) -> their stamp
        version. Archiving a burst folds its cancelled groups into
        ``archived.cancelled_groups`` and drops them here, as a new leader (which rebuilds
        the dict from the unarchived records) never had them: the dict is bounded by the live
        bursts, and :attr:`groups_cancelled` counts the run's every one."""
        self.restamped: dict[str, int] = {}
        """Groups the partial rule restamped -> their stamp (newer than their burst's): the
        newest ``policy_version`` among their members' records, so a rebuild recovers it."""
        self.restamps = 0
        """Groups restamped so far, each counted once (archived ones stay counted; a new
        leader counts those of the records it rebuilt from)."""
        self.archived = ArchiveSummary()

    # Counts -------------------------------------------------------------------------------

    def counts(self, burst_id: int | None = None) -> LedgerCounts:
        """D / L / F of one burst, or of all bursts (None, archived ones included)."""
        ids = [burst_id] if burst_id is not None else list(self.bursts)
        d = sum(self.bursts[b].quota for b in ids if b in self.bursts)
        lc = sum(self._launched.get(b, 0) for b in ids)
        f = sum(self._finished.get(b, 0) for b in ids)
        if burst_id is None:
            n = self.archived.executions
            d, lc, f = d + n, lc + n, f + n
        return LedgerCounts(d, lc, f)

    def counts_by_version(self) -> dict[int, LedgerCounts]:
        """D / L / F per stamp (the version each burst was dispatched with, or the one the
        partial rule restamped a group with), archived bursts included (counted at their
        bursts' versions)."""
        out: dict[int, list[int]] = {v: [n, n, n] for v, n in self.archived.by_version}
        for b, burst in self.bursts.items():
            c = out.setdefault(burst.policy_version, [0, 0, 0])
            c[0] += burst.quota
            c[1] += self._launched.get(b, 0)
            c[2] += self._finished.get(b, 0)
        for group, stamp in self.restamped.items():
            burst = self.bursts[parse_group(group)[0]]
            recs = [r for e in self.members(group) if (r := self.records.get(e)) is not None]
            moved = (burst.group_size, len(recs), sum(1 for r in recs if r.state.final))
            old, new = out[burst.policy_version], out.setdefault(stamp, [0, 0, 0])
            for i, n in enumerate(moved):
                old[i] -= n
                new[i] += n
        return {v: LedgerCounts(*c) for v, c in sorted(out.items())}

    def groups_by_version(self) -> dict[int, int]:
        """Dispatched groups of the live bursts per stamp."""
        out: dict[int, int] = {}
        for burst in self.bursts.values():
            out[burst.policy_version] = out.get(burst.policy_version, 0) + len(burst.tasks)
        for group, stamp in self.restamped.items():
            old = self.bursts[parse_group(group)[0]].policy_version
            out[old] -= 1
            out[stamp] = out.get(stamp, 0) + 1
        return out

    def open_bursts(self) -> list[int]:
        """Bursts with an execution not yet closed (several while bursts overlap)."""
        return [b for b, burst in sorted(self.bursts.items()) if self._finished.get(b, 0) < burst.quota]

    def open_groups(self) -> list[tuple[int, str, list[str]]]:
        """(stamp version, group id, open members) of every group with a member queued or
        running, oldest burst first."""
        out = []
        for b in self.open_bursts():
            burst = self.bursts[b]
            for t in range(len(burst.tasks)):
                group = f"b{b}-t{t}"
                members = [f"{group}-{m}" for m in range(burst.group_size)]
                left = [e for e in members if (r := self.records.get(e)) is None or not r.state.final]
                if left:
                    out.append((self.stamp(group, burst), group, left))
        return out

    def finished_by_status(self, burst_id: int | None = None) -> dict[str, int]:
        """Closed executions by final status, of one burst or of all (None, archived ones
        included)."""
        if burst_id is None:
            out = self.archived.status_counts()
            for k, v in self._by_status.items():
                out[k] = out.get(k, 0) + v
            return out
        out = {}
        for r in self.records.values():
            if r.burst_id == burst_id and r.state.final:
                out[r.state.value] = out.get(r.state.value, 0) + 1
        return out

    @property
    def bursts_total(self) -> int:
        """Bursts dispatched so far, archived ones included."""
        return len(self.bursts) + self.archived.bursts

    @property
    def tasks_taken(self) -> int:
        """Tasks dispatched so far, archived bursts included (the task source's position)."""
        return sum(len(b.tasks) for b in self.bursts.values()) + self.archived.tasks

    @property
    def current_burst(self) -> Burst | None:
        return self.bursts[max(self.bursts)] if self.bursts else None

    # Stamps -------------------------------------------------------------------------------

    def dispatched_version(self, group_id: str) -> int:
        """The version a group of a live burst was dispatched with (its burst's)."""
        return self.bursts[parse_group(group_id)[0]].policy_version

    def stamp(self, group_id: str, burst: Burst) -> int:
        """A group's stamp: its burst's, or the newer one the partial rule gave it."""
        return self.restamped.get(group_id, burst.policy_version)

    def members(self, group_id: str) -> list[str]:
        """The execution ids of a dispatched group ("b<burst>-t<task>"); [] if unknown."""
        try:
            b, t = parse_group(group_id)
        except ValueError:
            return []
        burst = self.bursts.get(b)
        if burst is None or not 0 <= t < len(burst.tasks):
            return []
        return [f"{group_id}-{m}" for m in range(burst.group_size)]

    # Archive ------------------------------------------------------------------------------

    def archivable(
        self, unsettled: AbstractSet[str] = frozenset(), closed_before_s: float = math.inf
    ) -> Burst | None:
        """The oldest burst, if it can be archived: not the newest, every execution launched
        and closed (the last close before ``closed_before_s``, wall clock), none in
        ``unsettled`` (e.g. finish reports not yet delivered)."""
        if len(self.bursts) < 2:
            return None
        b = min(self.bursts)
        burst = self.bursts[b]
        if self._finished.get(b, 0) != burst.quota or self._last_close.get(b, 0.0) > closed_before_s:
            return None
        if any(self.records[e].burst_id == b for e in unsettled if e in self.records):
            return None
        return burst

    @property
    def groups_cancelled(self) -> int:
        """Groups the scheduler cancelled over the run, archived bursts' included (what the
        dispatch gate subtracts). ``len(cancelled_groups)`` is not that: a new leader
        rebuilds the dict from the unarchived records only, so after a failover the gate
        counted every archived cancellation as a live group, and a long run with more of
        them than the gate's margin ((eta + 1) x B + X groups) could never dispatch again."""
        live = sum(1 for g in self.cancelled_groups if parse_group(g)[0] > self.archived.through)
        return self.archived.cancelled_groups + live

    # Invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """D = Q + R + F and 0 <= F <= L <= D, per burst and in total (raises AssertionError)."""
        for b in [*self.bursts, None]:
            c = self.counts(b)
            assert c.dispatched == c.queued + c.running + c.finished, c
            assert 0 <= c.finished <= c.launched <= c.dispatched, c
        n_final = sum(1 for r in self.records.values() if r.state.final)
        assert n_final == sum(self._finished.values()) == sum(self._by_status.values())
        assert len(self.records) == sum(self._launched.values())
