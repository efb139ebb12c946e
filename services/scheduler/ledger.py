"""The execution ledger: bursts, executions, D / L / F, exactly-once close, heartbeats.
:class:`Ledger` plans and applies the changes; what it counts (and the records it counts
from) are its :mod:`accounts` (:class:`~services.scheduler.accounts.LedgerAccounts`).

Pure (no I/O): the live scheduler asks for a *plan* (the next record), persists it in etcd
with a fenced transaction, then *applies* it; a rebuild after failover applies every record
read back from etcd. The counts are derived from the records, never stored apart from them:

* a burst record fixes its quota and task list at dispatch (D += quota);
* an execution record exists from its launch on (L = number of records);
* a record with a final status is closed (F = number of final records).

So an execution is launched at most once (its record is created only if absent) and closed at
most once (a close is a compare on the record's revision), and model-request retries, which
never touch the ledger, change no count. Queued executions are the members of a burst with no
record yet, launched in order (oldest burst first).

Heartbeat deadlines live in memory only (a heartbeat costs no etcd write): after a failover
the new leader gives every running execution a fresh deadline, which can only delay a
time-out, never cause a wrong one (heartbeats that went to the old leader, or nowhere during
the gap, time nothing out).

Idempotent acquire: a launch made with an acquire key stores the key's SHA-256, and the
execution's token is derived from the key (:func:`derive_token`), so a retried acquire, on
this leader or a new one, finds the same record and hands back the same token; no secret is
stored.

Bounded state: a burst older than the newest, with every execution closed (and reported to
the packer, the caller's condition), is *archived*: its counts fold into one
:class:`~services.scheduler.accounts.ArchiveSummary` (kept at ``keys.ledger_summary()``)
and its burst and execution records are deleted, so memory, etcd space and takeover time
depend on the live bursts only, never on how many executions a run has made.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import json
import math
from collections.abc import Iterable
from typing import Any

from gyre.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unauthenticated
from gyre.etcd.values import token_sha256
from gyre.evolve import evolve
from gyre.execution import FINAL, ExecutionStatus
from services.scheduler.accounts import ArchiveSummary, LedgerAccounts, parse_group
from services.scheduler.policy import LedgerCounts as LedgerCounts  # the counts' type, re-exported

HARNESS_FINAL = frozenset({ExecutionStatus.COMPLETED, ExecutionStatus.FAILED, ExecutionStatus.CANCELLED})
"""The statuses a harness may report (TIMED_OUT is the scheduler's own)."""

_ALLOWED: dict[ExecutionStatus, frozenset[ExecutionStatus]] = {
    ExecutionStatus.QUEUED: frozenset({ExecutionStatus.RUNNING, ExecutionStatus.CANCELLED}),
    ExecutionStatus.RUNNING: FINAL,
}
"""The one table of allowed execution transitions; final states go nowhere. QUEUED ->
CANCELLED is the scheduler withdrawing a queued execution (its group can no longer be
trained within the staleness bound): the record is created closed, so L counts executions
that left the queue (launched, or withdrawn before launch)."""
CANCEL_KEY = "scheduler-cancel"
"""The idempotency key of a close the scheduler made (cancel rule, or a withdrawal)."""


ACQUIRE_KEY_MIN = 16
ACQUIRE_KEY_MAX = 128


def validate_acquire_key(key: str) -> str:
    """An acquire idempotency key: empty (none) or a 16..128-character secret."""
    if key and not ACQUIRE_KEY_MIN <= len(key) <= ACQUIRE_KEY_MAX:
        raise InvalidArgument(
            f"idempotency_key must have {ACQUIRE_KEY_MIN}..{ACQUIRE_KEY_MAX} characters (a random secret)"
        )
    return key


def derive_token(acquire_key: str, execution_id: str) -> str:
    """The token of an execution launched with ``acquire_key``: HMAC-SHA256 of the
    execution id under the key (only the key's holder can compute it; any leader can
    reproduce it for a retried acquire)."""
    mac = hmac.new(acquire_key.encode(), b"gyre/execution-token/" + execution_id.encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a burst: every member execution of its group runs it."""

    task_id: str
    task_json: str = "{}"


@dataclasses.dataclass(frozen=True)
class Burst:
    """A burst record: quota = len(tasks) * group_size, fixed at dispatch."""

    burst_id: int
    policy_version: int
    target_version: int
    group_size: int
    tasks: tuple[Task, ...]
    dispatched_s: float = 0.0

    @property
    def quota(self) -> int:
        return len(self.tasks) * self.group_size

    def member(self, seq: int) -> tuple[str, str, Task]:
        """(execution_id, group_id, task) of the ``seq``-th execution of the burst."""
        t, m = divmod(seq, self.group_size)
        group = f"b{self.burst_id}-t{t}"
        return f"{group}-{m}", group, self.tasks[t]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "burst_id": self.burst_id,
                "policy_version": self.policy_version,
                "target_version": self.target_version,
                "group_size": self.group_size,
                "tasks": [[t.task_id, t.task_json] for t in self.tasks],
                "dispatched_s": self.dispatched_s,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Burst:
        d = json.loads(raw)
        return cls(
            int(d["burst_id"]),
            int(d["policy_version"]),
            int(d["target_version"]),
            int(d["group_size"]),
            tuple(Task(str(a), str(b)) for a, b in d["tasks"]),
            float(d.get("dispatched_s", 0.0)),
        )


@dataclasses.dataclass(frozen=True)
class ExecutionRecord:
    """One launched execution (persisted at ``keys.execution(burst_id, execution_id)``)."""

    execution_id: str
    burst_id: int
    seq: int
    group_id: str
    task_id: str
    policy_version: int
    state: ExecutionStatus
    token_sha256: str
    harness_id: str = ""
    launched_s: float = 0.0
    finished_s: float = 0.0
    reward: float = 0.0
    idempotency_key: str = ""
    acquire_key_sha256: str = ""
    """SHA-256 of the acquire idempotency key ("" when the acquire had none)."""
    revision: int = 0
    """etcd mod revision of the stored record (0: not stored yet); not serialized."""

    def to_json(self) -> bytes:
        # A shallow copy of the fields (all scalars), in field order: dataclasses.asdict
        # deep-copies each one and was a quarter of the close path's CPU (bench/scheduler_ledger.py).
        d = dict(vars(self))
        del d["revision"]
        d["state"] = self.state.value
        return json.dumps(d).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> ExecutionRecord:
        d: dict[str, Any] = json.loads(raw)
        d["state"] = ExecutionStatus(d["state"])
        d["revision"] = revision
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Finish:
    """What FinishExecution reports, validated."""

    status: ExecutionStatus
    reward: float
    idempotency_key: str


@dataclasses.dataclass(frozen=True)
class FinishOutcome:
    """The answer to a finish: the recorded status, and whether it was a repeat."""

    record: ExecutionRecord
    duplicate: bool


def validate_finish(
    status: ExecutionStatus, reward: float, key: str, reward_min: float, reward_max: float
) -> Finish:
    """Checks a harness's finish report; raises InvalidArgument with the reason.

    Rewards must be finite and within [reward_min, reward_max] for COMPLETED (a NaN, an
    infinity or an out-of-range value is refused, not clamped); other statuses carry no
    reward (stored as 0)."""
    if status not in HARNESS_FINAL:
        raise InvalidArgument(f"status must be COMPLETED, FAILED or CANCELLED, not {status.value}")
    if not 1 <= len(key) <= 128:
        raise InvalidArgument("idempotency_key must have 1..128 characters")
    if status is ExecutionStatus.COMPLETED:
        if not math.isfinite(reward):
            raise InvalidArgument(f"reward must be finite, got {reward}")
        if not reward_min <= reward <= reward_max:
            raise InvalidArgument(f"reward {reward} outside [{reward_min}, {reward_max}]")
    else:
        reward = 0.0
    return Finish(status, float(reward), key)


def _parse_member(execution_id: str) -> tuple[int, int, int]:
    """(burst, task, member) of "b<burst>-t<task>-<member>"; ValueError otherwise."""
    parts = execution_id.split("-")
    if len(parts) != 3 or not parts[0].startswith("b") or not parts[1].startswith("t"):
        raise ValueError(execution_id)
    return int(parts[0][1:]), int(parts[1][1:]), int(parts[2])


class Ledger(LedgerAccounts):
    """Bursts and executions of one scheduler: plans each change (the next record, not
    applied) and applies persisted ones; the counts are the accounts'."""

    def __init__(self) -> None:
        super().__init__()
        self._by_token: dict[str, str] = {}
        self._deadline: dict[str, float] = {}
        self._cursor: dict[int, int] = {}  # burst -> lowest seq that may still be queued
        self._reserved: set[str] = set()  # launches whose write is in flight
        self._by_acquire_key: dict[str, str] = {}  # sha256(acquire key) -> execution

    # Bursts -------------------------------------------------------------------------------

    def plan_burst(
        self, tasks: Iterable[Task], group_size: int, policy_version: int, batches: int, now_s: float
    ) -> Burst:
        """The next burst (not applied): id = newest + 1."""
        tasks = tuple(tasks)
        if not tasks or group_size < 1:
            raise InvalidArgument("a burst needs tasks and group_size >= 1")
        burst_id = max([*self.bursts, self.archived.through]) + 1
        return Burst(burst_id, policy_version, policy_version + batches, group_size, tasks, now_s)

    def apply_burst(self, burst: Burst) -> None:
        if burst.burst_id in self.bursts:
            return
        self.bursts[burst.burst_id] = burst
        self._cursor.setdefault(burst.burst_id, 0)

    # Launch -------------------------------------------------------------------------------

    def next_queued(self) -> tuple[Burst, int] | None:
        """The oldest queued execution: (burst, seq), or None when nothing is queued."""
        for b in sorted(self.bursts):
            burst = self.bursts[b]
            seq = self._cursor.get(b, 0)
            while seq < burst.quota and (
                (eid := burst.member(seq)[0]) in self.records or eid in self._reserved
            ):
                seq += 1
            self._cursor[b] = seq
            if seq < burst.quota:
                return burst, seq
        return None

    def reserve(self, execution_id: str) -> None:
        """Marks a queued execution as being launched (its write is in flight): the queue
        skips it. Counts do not change until the launch is applied."""
        self._reserved.add(execution_id)

    def unreserve(self, burst: Burst, seq: int) -> None:
        """A launch write failed or was refused: the execution is queued again (if it was
        not launched after all)."""
        self._reserved.discard(burst.member(seq)[0])
        self._cursor[burst.burst_id] = min(self._cursor.get(burst.burst_id, 0), seq)

    def plan_launch(
        self,
        burst: Burst,
        seq: int,
        token_sha256: str,
        harness_id: str,
        now_s: float,
        acquire_key_sha256: str = "",
    ) -> ExecutionRecord:
        execution_id, group_id, task = burst.member(seq)
        if execution_id in self.records or execution_id in self._reserved:
            raise FailedPrecondition(f"{execution_id} already launched")
        return ExecutionRecord(
            execution_id,
            burst.burst_id,
            seq,
            group_id,
            task.task_id,
            self.stamp(group_id, burst),
            ExecutionStatus.RUNNING,
            token_sha256,
            harness_id,
            now_s,
            acquire_key_sha256=acquire_key_sha256,
        )

    def acquired_with(self, acquire_key_sha256: str) -> ExecutionRecord | None:
        """The execution an earlier acquire with this key launched (None: none, or archived)."""
        eid = self._by_acquire_key.get(acquire_key_sha256) if acquire_key_sha256 else None
        return None if eid is None else self.records.get(eid)

    # Close --------------------------------------------------------------------------------

    def authorize(self, execution_id: str, token: str) -> ExecutionRecord:
        """The record of ``execution_id`` if ``token`` holds it. NOT_FOUND for an unknown
        execution; UNAUTHENTICATED for a token that names no execution; PERMISSION_DENIED
        for a token of another execution."""
        rec = self.records.get(execution_id)
        if rec is None:
            if self.is_queued(execution_id):
                raise FailedPrecondition(f"{execution_id} is queued, not launched")
            raise self._unknown(execution_id)
        digest = token_sha256(token)
        if digest != rec.token_sha256:
            if digest in self._by_token:
                raise PermissionDenied(f"the token does not hold {execution_id}")
            raise Unauthenticated("the token names no execution")
        return rec

    def is_archived(self, execution_id: str) -> bool:
        """True for an execution id ("b<burst>-t<task>-<member>") of an archived burst: it
        was closed, and its record is gone (only the burst's counts remain)."""
        try:
            b, _, _ = _parse_member(execution_id)
        except ValueError:
            return False
        return 0 < b <= self.archived.through

    def _unknown(self, execution_id: str) -> NotFound:
        """NOT_FOUND for an execution without a record, saying why when its burst was
        archived (a late report of an execution the scheduler closed, e.g. cancelled under
        the staleness bound while its harness waited on a long tool call)."""
        if self.is_archived(execution_id):
            return NotFound(
                f"execution {execution_id!r} was closed and its burst archived; its record is gone"
            )
        return NotFound(f"unknown execution {execution_id!r}")

    def is_queued(self, execution_id: str) -> bool:
        """True for a dispatched execution ("b<burst>-t<task>-<member>") with no record yet."""
        try:
            b, t, m = _parse_member(execution_id)
        except ValueError:
            return False
        burst = self.bursts.get(b)
        if burst is None or not (0 <= t < len(burst.tasks) and 0 <= m < burst.group_size):
            return False
        return execution_id not in self.records

    def plan_finish(self, execution_id: str, finish: Finish, now_s: float) -> FinishOutcome:
        """The closed record, or (duplicate=True) the first outcome when already closed."""
        rec = self.records.get(execution_id)
        if rec is None:
            raise self._unknown(execution_id)
        if rec.state.final:
            return FinishOutcome(rec, True)
        closed = evolve(
            rec,
            state=finish.status,
            reward=finish.reward,
            idempotency_key=finish.idempotency_key,
            finished_s=now_s,
        )
        return FinishOutcome(closed, False)

    def plan_cancel(self, execution_id: str, now_s: float) -> ExecutionRecord | None:
        """The execution closed as CANCELLED by the scheduler (not applied): a running one
        keeps its record's fields; a queued one gets a record with no token or harness.
        None when it is already closed, not dispatched, or its launch is in flight."""
        rec = self.records.get(execution_id)
        if rec is not None:
            if rec.state.final:
                return None
            return dataclasses.replace(
                rec, state=ExecutionStatus.CANCELLED, idempotency_key=CANCEL_KEY, finished_s=now_s
            )
        if execution_id in self._reserved or not self.is_queued(execution_id):
            return None
        burst_id, t, m = _parse_member(execution_id)
        burst = self.bursts[burst_id]
        seq = t * burst.group_size + m
        _, group_id, task = burst.member(seq)
        return ExecutionRecord(
            execution_id,
            burst_id,
            seq,
            group_id,
            task.task_id,
            self.stamp(group_id, burst),
            ExecutionStatus.CANCELLED,
            "",
            idempotency_key=CANCEL_KEY,
            finished_s=now_s,
        )

    def plan_restamp(self, execution_id: str, version: int) -> ExecutionRecord | None:
        """The running execution's record restamped with ``version`` (the partial rule; not
        applied). None when it is not running or already carries that stamp or a newer one."""
        rec = self.records.get(execution_id)
        if rec is None or rec.state is not ExecutionStatus.RUNNING or rec.policy_version >= version:
            return None
        return dataclasses.replace(rec, policy_version=version)

    def plan_timeouts(self, now_s: float) -> list[ExecutionRecord]:
        """Running executions past their heartbeat deadline, closed as TIMED_OUT (not applied)."""
        out = []
        for eid, deadline in self._deadline.items():
            rec = self.records[eid]
            if now_s >= deadline and rec.state is ExecutionStatus.RUNNING:
                out.append(
                    dataclasses.replace(
                        rec, state=ExecutionStatus.TIMED_OUT, finished_s=now_s, idempotency_key="timeout"
                    )
                )
        return out

    # Apply --------------------------------------------------------------------------------

    def apply(self, rec: ExecutionRecord, deadline_s: float | None = None) -> None:
        """Applies a persisted record (from our own write or a rebuild). Refuses a
        transition the table does not allow; re-applying the same state is a no-op."""
        if rec.burst_id not in self.bursts:
            raise FailedPrecondition(f"{rec.execution_id}: unknown burst {rec.burst_id}")
        if rec.policy_version > self.stamp(rec.group_id, self.bursts[rec.burst_id]):
            self.restamps += rec.group_id not in self.restamped
            self.restamped[rec.group_id] = rec.policy_version
        old = self.records.get(rec.execution_id)
        old_state = old.state if old is not None else ExecutionStatus.QUEUED
        if old is not None and old_state is rec.state:
            self.records[rec.execution_id] = rec
            return
        if rec.state not in _ALLOWED.get(old_state, frozenset()):
            raise FailedPrecondition(
                f"{rec.execution_id}: {old_state.value} -> {rec.state.value} not allowed"
            )
        self.records[rec.execution_id] = rec
        self._reserved.discard(rec.execution_id)
        if old is None:
            self._launched[rec.burst_id] = self._launched.get(rec.burst_id, 0) + 1
            if rec.token_sha256:
                self._by_token[rec.token_sha256] = rec.execution_id
            if rec.acquire_key_sha256:
                self._by_acquire_key[rec.acquire_key_sha256] = rec.execution_id
        if rec.state is ExecutionStatus.RUNNING:
            if deadline_s is not None:
                self._deadline[rec.execution_id] = deadline_s
        else:  # a final state
            self._finished[rec.burst_id] = self._finished.get(rec.burst_id, 0) + 1
            self._last_close[rec.burst_id] = max(self._last_close.get(rec.burst_id, 0.0), rec.finished_s)
            self._by_status[rec.state.value] = self._by_status.get(rec.state.value, 0) + 1
            self._deadline.pop(rec.execution_id, None)
            if rec.idempotency_key == CANCEL_KEY:
                self.cancelled_groups[rec.group_id] = rec.policy_version

    def load(self, rec: ExecutionRecord, deadline_s: float) -> None:
        """Rebuild: applies a record read back from etcd (any state); a record of an
        archived burst is ignored."""
        if rec.burst_id <= self.archived.through:
            return
        if rec.execution_id in self.records:
            self.apply(rec, deadline_s)
            return
        if rec.state.final:
            # QUEUED -> RUNNING -> final, in one go.
            self.apply(dataclasses.replace(rec, state=ExecutionStatus.RUNNING))
        self.apply(rec, deadline_s if rec.state is ExecutionStatus.RUNNING else None)

    # Archive ------------------------------------------------------------------------------

    def plan_archive(self, burst: Burst) -> ArchiveSummary:
        """The summary with ``burst`` folded in (not applied)."""
        cancelled = sum(1 for g in self.cancelled_groups if parse_group(g)[0] == burst.burst_id)
        return self.archived.add(burst, self.finished_by_status(burst.burst_id), cancelled)

    def apply_archive(self, summary: ArchiveSummary) -> None:
        """Drops the bursts the (persisted) summary covers, and their records."""
        for b in [b for b in self.bursts if b <= summary.through]:
            del self.bursts[b]
            self._cursor.pop(b, None)
            self._launched.pop(b, None)
            self._finished.pop(b, None)
            self._last_close.pop(b, None)
        for group in [g for g in self.cancelled_groups if parse_group(g)[0] <= summary.through]:
            del self.cancelled_groups[group]  # counted in summary.cancelled_groups
        for eid in [e for e, r in self.records.items() if r.burst_id <= summary.through]:
            rec = self.records.pop(eid)
            self.restamped.pop(rec.group_id, None)
            self._by_token.pop(rec.token_sha256, None)
            self._by_acquire_key.pop(rec.acquire_key_sha256, None)
            self._deadline.pop(eid, None)
            if rec.state.final:
                self._by_status[rec.state.value] -= 1
                if not self._by_status[rec.state.value]:
                    del self._by_status[rec.state.value]
        self.archived = summary

    # Heartbeats ---------------------------------------------------------------------------

    def heartbeat(self, execution_id: str, now_s: float, deadline_after_s: float) -> float:
        """Pushes the deadline of a running execution; returns seconds left."""
        rec = self.records.get(execution_id)
        if rec is None:
            raise self._unknown(execution_id)
        if rec.state is ExecutionStatus.RUNNING:
            self._deadline[execution_id] = now_s + deadline_after_s
            return deadline_after_s
        return 0.0

    def deadline(self, execution_id: str) -> float | None:
        return self._deadline.get(execution_id)

    def running_ids(self) -> list[str]:
        return [e for e, r in self.records.items() if r.state is ExecutionStatus.RUNNING]
