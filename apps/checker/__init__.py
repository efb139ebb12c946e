"""The offline history checker: ``python -m apps.checker [--complete] HISTORY...``.

Reads the JSONL histories services append when ``history_file`` is set (gyre/history.py),
merges them, and verifies the promises of docs/reliability.md:

- scheduler (services/scheduler/history.py): every dispatched execution launched and closed
  exactly once, within its burst's quota; no write by a fenced-out leader;
- packer (services/packer/history.py): no finish report accepted twice (acknowledged, then
  forgotten); no group assigned to two batches (trained twice); no batch committed twice
  (exactly one optimizer step per batch); every micro-step of a committed batch acknowledged
  in the committed attempt (none lost); every claim of a batch on the batch's one policy
  version (no mixed weight versions); no micro-step claimed again after its acknowledgement
  without its batch reopened (an ack lost); no micro-step acknowledged twice in one attempt;
- cells (apps/checker/cells.py): role changes follow the lifecycle and a deposed leader's
  epoch; a cell never serves two versions at once nor goes back; every micro-step trains
  on its batch's version, none is acknowledged twice in one attempt, a batch is stepped at
  most once; what a cell saw acknowledged is in the packer's history;
- router (services/router/turns.py): no turn record dropped (a full buffer loses training
  data); turns recorded and refused are counted; with the packer's history, no turn refused
  as late (after its group's finish reports) when that group was trained: the batch trained
  without it;
- across scheduler and packer, with ``complete`` (the run ended quiet): every execution the scheduler closed
  reached the packer (or was refused by it, recorded), and the packer accepted no finish of
  an execution the scheduler never closed.

Context a crash took from a history (the packer writes after its WAL fsync) is unknown,
never a violation by itself.

A rotated history (``history_max_bytes``) is read whole: naming a history, or any of its
segments, reads ``<file>.1``, ``<file>.2``, ... and then ``<file>``. When retention
(``history_keep``) deleted its oldest segments, the checker checks what is left and says
so: the verdict's ``pruned`` names those histories, and a violation may then be an
operation whose first half was deleted (a close whose launch was in a deleted segment).
Keep every segment (``history_keep: 0``, the default) for a run you want verified.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.checker.cells import check_cells
from gyre.history import base, pruned, read
from services.packer.packer import LATE_TURN
from services.scheduler import history as scheduler_history


@dataclass
class Verdict:
    """What the checker found: violations (empty: every promise kept) and counts."""

    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    pruned: list[str] = field(default_factory=list)
    """Histories whose oldest rotated segments retention deleted: checked as far as kept."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "violations": self.violations, "counts": self.counts, "pruned": self.pruned}


def split(ops: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Operations by service (a line without ``svc`` is the scheduler's), each in time order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        out.setdefault(str(op.get("svc") or "scheduler"), []).append(op)
    for svc_ops in out.values():
        svc_ops.sort(key=lambda op: float(op.get("t", 0)))  # stable: one file's order is kept
    return out


@dataclass
class _Batch:
    version: int | None = None
    micro_steps: list[str] = field(default_factory=list)
    acked: dict[str, str] = field(default_factory=dict)  # this attempt: ms -> cell
    claim_versions: set[int] = field(default_factory=set)
    commits: int = 0


def check_packer(ops: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """Violations of the packer's promises in its history, and counts."""
    bad: list[str] = []
    finished: set[str] = set()
    assigned: dict[str, int] = {}
    batches: dict[int, _Batch] = {}
    ms_batch: dict[str, int] = {}
    counts = {
        "finishes": 0,
        "groups_assigned": 0,
        "groups_dropped": 0,
        "micro_steps": 0,
        "claims": 0,
        "acks": 0,
        "claims_returned": 0,
        "attempts_reopened": 0,
        "batches_committed": 0,
        "packer_starts": 0,
    }

    def batch_of(ms: str) -> _Batch | None:
        b = ms_batch.get(ms)
        return None if b is None else batches.setdefault(b, _Batch())

    for n, op in enumerate(ops):
        kind = op.get("op")
        if kind == "start":
            counts["packer_starts"] += 1
        elif kind == "finish":
            eid = str(op["execution_id"])
            counts["finishes"] += 1
            if eid in finished:
                bad.append(f"packer #{n}: finish of {eid} accepted twice (an acknowledged report was lost)")
            finished.add(eid)
        elif kind == "assign":
            g, b = str(op["g"]), int(op["b"])
            counts["groups_assigned"] += 1
            if g in assigned:
                bad.append(
                    f"packer #{n}: group {g} assigned to batch {b} after batch {assigned[g]} (trained twice)"
                )
            assigned[g] = b
        elif kind == "drop":
            counts["groups_dropped"] += 1
        elif kind == "emit":
            ms, b = str(op["ms"]), int(op["b"])
            counts["micro_steps"] += 1
            if ms in ms_batch:
                bad.append(f"packer #{n}: micro-step {ms} emitted twice")
            ms_batch[ms] = b
            batches.setdefault(b, _Batch()).micro_steps.append(ms)
        elif kind == "activate":
            batch = batches.setdefault(int(op["b"]), _Batch())
            if batch.version is not None and batch.version != int(op["v"]):
                bad.append(f"packer #{n}: batch {op['b']} activated on v{op['v']} after v{batch.version}")
            batch.version = int(op["v"])
        elif kind == "claim":
            counts["claims"] += 1
            _check_claim(n, op, batch_of(str(op["ms"])), bad)
        elif kind == "release":
            counts["claims_returned"] += 1
        elif kind == "ack":
            counts["acks"] += 1
            ms, acked_batch = str(op["ms"]), batch_of(str(op["ms"]))
            if acked_batch is not None:
                if ms in acked_batch.acked:
                    bad.append(f"packer #{n}: micro-step {ms} acknowledged twice in one attempt")
                acked_batch.acked[ms] = str(op.get("cell", ""))
        elif kind == "open":
            counts["attempts_reopened"] += 1
            batch = batches.setdefault(int(op["b"]), _Batch())
            if batch.commits:
                bad.append(f"packer #{n}: batch {op['b']} reopened after its commit")
            batch.acked.clear()
            batch.claim_versions.clear()
        elif kind == "commit":
            counts["batches_committed"] += 1
            _check_commit(n, int(op["b"]), batches.setdefault(int(op["b"]), _Batch()), bad)
    counts["groups_trained"] = sum(1 for b in assigned.values() if batches.get(b, _Batch()).commits)
    return bad, counts


def _check_claim(n: int, op: dict[str, Any], batch: _Batch | None, bad: list[str]) -> None:
    ms = str(op["ms"])
    if batch is None:
        return  # its emit is not in the history (written before a crash): unknown
    if ms in batch.acked:
        bad.append(f"packer #{n}: micro-step {ms} claimed again after its acknowledgement (an ack was lost)")
    if "v" in op:
        v = int(op["v"])
        if batch.version is not None and v != batch.version:
            bad.append(f"packer #{n}: micro-step {ms} claimed on v{v}, its batch trains on v{batch.version}")
        if batch.claim_versions and v not in batch.claim_versions:
            bad.append(
                f"packer #{n}: micro-step {ms} claimed on v{v} in an attempt on "
                f"v{sorted(batch.claim_versions)} (mixed weight versions)"
            )
        batch.claim_versions.add(v)


def _check_commit(n: int, b: int, batch: _Batch, bad: list[str]) -> None:
    batch.commits += 1
    if batch.commits > 1:
        bad.append(f"packer #{n}: batch {b} committed {batch.commits} times (one optimizer step per batch)")
    missing = [ms for ms in batch.micro_steps if ms not in batch.acked]
    if missing:
        bad.append(
            f"packer #{n}: batch {b} committed without acknowledgements of {missing} (micro-steps lost)"
        )


def check_router(ops: list[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """A dropped turn record is training data lost; recorded and refused ones are counted."""
    bad = [
        f"router #{n}: turn {op.get('turn_index')} of {op.get('execution_id')} dropped (turn buffer full)"
        for n, op in enumerate(ops)
        if op.get("op") == "turn_dropped"
    ]
    counts = {
        f"turns_{k}": sum(1 for op in ops if op.get("op") == f"turn_{k}")
        for k in ("recorded", "refused", "dropped")
    }
    return bad, counts


def check_late_turns(router: list[dict[str, Any]], packer: list[dict[str, Any]]) -> list[str]:
    """A turn the packer refused because its group was already complete is training data
    lost if that group was then trained (assigned to a batch and not dropped); a late turn of
    a dropped or cancelled group is not (nothing of the group was trained)."""
    group_of = {str(op["execution_id"]): str(op["group_id"]) for op in packer if op.get("op") == "finish"}
    trained = {str(op["g"]) for op in packer if op.get("op") == "assign"}
    dropped = {str(op["g"]) for op in packer if op.get("op") == "drop"}
    bad = []
    for op in router:
        if op.get("op") != "turn_refused" or LATE_TURN not in str(op.get("error", "")):
            continue
        g = group_of.get(str(op.get("execution_id")))
        if g is not None and g in trained and g not in dropped:
            bad.append(
                f"router: turn {op.get('turn_index')} of {op.get('execution_id')} refused as late, "
                f"and its group {g} was trained without it (training data lost)"
            )
    return bad


def closed_executions(sched: list[dict[str, Any]], complete: bool) -> set[str]:
    """The executions the scheduler closed. In a run that ended quiet (``complete``) that
    includes a close whose line a killed leader never wrote: it took effect only if its
    successor relayed it (it found the execution closed in etcd and never closed it again),
    which the cross check verifies at the packer."""
    closed = {str(op["execution_id"]) for op in sched if op.get("op") == "close"}
    if complete:
        closed |= scheduler_history.indeterminate_closes(sched)
    return closed


def check_cross(sched: list[dict[str, Any]], packer: list[dict[str, Any]]) -> list[str]:
    """With both histories of a run that ended quiet: every close reached the packer, and
    the packer trained nothing the scheduler did not close."""
    closed = closed_executions(sched, complete=True)
    refused = {str(op["execution_id"]) for op in sched if op.get("op") == "report_refused"}
    finished = {str(op["execution_id"]) for op in packer if op.get("op") == "finish"}
    # A retried report answered as a duplicate: the first one's line may be what a crash took.
    again = {str(op["execution_id"]) for op in packer if op.get("op") == "finish_again"}
    bad = [
        f"{eid} closed by the scheduler, never reported to the packer (lost)"
        for eid in sorted(closed - finished - again - refused)
    ]
    bad += [
        f"{eid} finished at the packer, never closed by the scheduler" for eid in sorted(finished - closed)
    ]
    return bad


def check(ops: Iterable[dict[str, Any]], complete: bool = False) -> Verdict:
    """Verifies merged histories (any services, any order of files)."""
    by_svc = split(ops)
    verdict = Verdict()
    sched = by_svc.get("scheduler", [])
    if sched:
        verdict.violations += [f"scheduler {v}" for v in scheduler_history.check(sched, complete=complete)]
        verdict.counts |= {
            "bursts_dispatched": sum(1 for op in sched if op.get("op") == "dispatch"),
            "executions_dispatched": sum(
                int(op.get("quota", 0)) for op in sched if op.get("op") == "dispatch"
            ),
            "executions_launched": sum(1 for op in sched if op.get("op") == "launch"),
            "executions_closed": len(closed_executions(sched, complete)),
            "reroutes": sum(1 for op in sched if op.get("op") == "reroute"),
            "leader_terms": sum(1 for op in sched if op.get("op") == "leader"),
        }
    packer = by_svc.get("packer", [])
    if packer:
        bad, counts = check_packer(packer)
        verdict.violations += bad
        verdict.counts |= counts
    if complete and sched and packer:
        verdict.violations += check_cross(sched, packer)
    cells = by_svc.get("cell", [])
    if cells:
        acks = [(str(op["ms"]), str(op.get("cell", ""))) for op in packer if op.get("op") == "ack"]
        bad, counts = check_cells(cells, acks if packer else None)
        verdict.violations += bad
        verdict.counts |= counts
    router = by_svc.get("router", [])
    if router:
        bad, counts = check_router(router)
        verdict.violations += bad
        verdict.counts |= counts
        if packer:
            verdict.violations += check_late_turns(router, packer)
    for svc, svc_ops in by_svc.items():
        if svc not in ("scheduler", "packer", "router", "cell"):
            verdict.counts[f"{svc}_ops"] = len(svc_ops)
    return verdict


def check_files(paths: Iterable[str | Path], complete: bool = False) -> Verdict:
    """The verdict over the named histories, each read whole (its rotated segments too)."""
    histories = list(dict.fromkeys(base(p) for p in paths))
    ops: list[dict[str, Any]] = []
    for path in histories:
        ops += read(path)
    verdict = check(ops, complete=complete)
    verdict.pruned = [str(p) for p in histories if pruned(p)]
    return verdict
