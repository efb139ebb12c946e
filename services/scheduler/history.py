"""The scheduler's operation history (JSONL) and the offline checker of its invariants.

With ``history_file`` set, every persisted change is appended as one JSON line after its
etcd write succeeded: ``{"op": "dispatch"|"launch"|"close"|"reroute"|"leader", "t": unix
seconds, "epoch": fencing epoch, "rev": etcd revision of the write, ...}``. Several
scheduler processes (a leader and its successors) may append to the same file. :func:`check`
replays a history and returns the violations of docs/reliability.md promise 1: an execution
launched twice, closed twice, closed without a launch or beyond its burst's quota, or
(``complete=True``) dispatched and never closed; and of promise 4: a write at a revision
after a newer leader was elected.

A leader killed after a write landed and before its line was appended leaves only the
``{"op": "invoke", "of": ...}`` line it wrote first (gyre/history.py): that operation is
indeterminate, and taken to have happened exactly when a later operation needs it (a close
of an execution whose launch was indeterminate; a launch in a burst whose dispatch was),
like Jepsen's *info* operations. An indeterminate close counts as a close when the run is
``complete`` (its successor found it closed in etcd and never closed it again); the cross
check against the packer (apps/checker) then wants its finish report delivered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gyre.history import History, read

__all__ = ["History", "check", "indeterminate_closes", "read"]


def check(ops: Iterable[dict[str, Any]], complete: bool = False) -> list[str]:
    """Violations found in a history (empty: the history keeps the promises)."""
    bad: list[str] = []
    quota: dict[int, int] = {}
    launched: set[str] = set()
    closed: dict[str, str] = {}
    pending_launch: set[str] = set()  # indeterminate launches: invoked, never completed
    pending_quota: dict[int, int] = {}  # indeterminate dispatches
    ops = list(ops)
    epochs = sorted({int(op["epoch"]) for op in ops if op.get("op") == "leader"})
    for n, op in enumerate(ops):
        kind, epoch, rev = op.get("op"), int(op.get("epoch", 0)), int(op.get("rev", 0))
        # Fencing: a write by epoch e happened before any newer leader's key was created.
        newer = [e for e in epochs if e > epoch]
        if rev and newer and rev > newer[0]:
            bad.append(f"#{n} {kind} by epoch {epoch} at revision {rev}, after epoch {newer[0]} was elected")
        if kind == "invoke":
            if op.get("of") == "launch":
                pending_launch.add(str(op["execution_id"]))
            elif op.get("of") == "dispatch":
                pending_quota[int(op["burst_id"])] = int(op["quota"])
        elif kind == "dispatch":
            b = int(op["burst_id"])
            if b in quota:
                bad.append(f"#{n} burst {b} dispatched twice")
            quota[b] = int(op["quota"])
        elif kind == "launch":
            eid = op["execution_id"]
            if eid in launched:
                bad.append(f"#{n} {eid} launched twice")
            pending_launch.discard(eid)
            b = int(op.get("burst_id", 0))
            if b not in quota and b in pending_quota:
                quota[b] = pending_quota.pop(b)  # its dispatch landed, its line was lost
            if b not in quota:
                bad.append(f"#{n} {eid} launched in an undispatched burst")
            launched.add(eid)
        elif kind == "close":
            eid = op["execution_id"]
            if eid in pending_launch:
                launched.add(eid)  # its launch landed, its line was lost
            if eid not in launched:
                bad.append(f"#{n} {eid} closed without a launch")
            if eid in closed:
                bad.append(f"#{n} {eid} closed twice ({closed[eid]}, then {op.get('status')})")
            closed[eid] = str(op.get("status"))
    per_burst: dict[int, int] = {}
    for eid in launched:
        b = int(eid.split("-", 1)[0][1:]) if eid.startswith("b") else 0
        per_burst[b] = per_burst.get(b, 0) + 1
    for b, n_launched in per_burst.items():
        if b in quota and n_launched > quota[b]:
            bad.append(f"burst {b}: {n_launched} launches > quota {quota[b]}")
    if complete:
        d, f = sum(quota.values()), len(closed.keys() | indeterminate_closes(ops))
        if d != f:
            bad.append(f"dispatched {d} != finished {f}")
    return bad


def indeterminate_closes(ops: Iterable[dict[str, Any]]) -> set[str]:
    """Executions whose close was invoked and never completed in this history."""
    invoked, done = set(), set()
    for op in ops:
        if op.get("op") == "invoke" and op.get("of") == "close":
            invoked.add(str(op["execution_id"]))
        elif op.get("op") == "close":
            done.add(str(op["execution_id"]))
    return invoked - done
