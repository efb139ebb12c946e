"""The packer's operation history: its WAL events, written once they are durable.

:class:`HistoryLog` wraps the packer's event log. Events the controller appends are held
until :meth:`sync` has made them durable, then written to the history (``gyre.history``,
``svc: "packer"``) as operations the checker understands (``python -m apps.checker``):

==========  ==============================================================
op          fields
==========  ==============================================================
finish      execution_id, group_id, status (a finish report accepted)
finish_again execution_id, group_id (a retried report answered as a duplicate)
assign      b, g (a ready group placed in batch b)
drop        g, reason
emit        ms, b, executions (a micro-step packed)
activate    b, v (the batch trains on policy version v)
claim       ms, cell, v (the claimer's policy version)
release     ms, cell (a claim returned to the pool)
ack         ms, cell (a micro-step's gradient acknowledged)
open        b, cell (the core opens an attempt: unconsumed acks return)
seal        b
commit      b, cell (the optimizer step of batch b is durable)
policy      v
==========  ==============================================================

An operation is written only after the WAL holds it, so the history never shows what a
crash took back; a crash between the fsync and the history write leaves the history
missing that operation's line (the checker treats missing context as unknown, not bad).
A finish is the exception the cross check cannot treat so (a close the packer never saw is
an execution lost): the report's retry, answered as a duplicate, writes ``finish_again``
(:meth:`HistoryLog.note`), so a line a crash took is written again by the retry.
"""

from __future__ import annotations

from typing import Any

from gyre.history import History
from services.packer.records import Event
from services.packer.wal import EventLog

_FIELDS: dict[str, tuple[str, ...]] = {
    "assign": ("b", "g"),
    "drop": ("g", "reason"),
    "activate": ("b", "v"),
    "claim": ("ms", "cell", "v"),
    "release": ("ms", "cell"),
    "ack": ("ms", "cell"),
    "open": ("b", "cell"),
    "seal": ("b",),
    "commit": ("b", "cell"),
    "policy": ("v",),
}


def operation(ev: Event) -> dict[str, Any] | None:
    """The history operation of one WAL event (None: not one the checker reads)."""
    kind = ev.get("t")
    if kind == "finish":
        f = ev["finish"]
        return {"op": "finish", "execution_id": f.get("x"), "group_id": f.get("g"), "status": f.get("s")}
    if kind == "emit":
        executions = sorted({str(x) for x, _ in ev["seqs"]})
        return {"op": "emit", "ms": ev["ms"], "b": int(ev["b"]), "executions": executions}
    fields = _FIELDS.get(str(kind))
    if fields is None:
        return None
    return {"op": kind, **{k: ev[k] for k in fields if k in ev}}


class HistoryLog:
    """An :class:`EventLog` that also writes each durable event's operation to a history."""

    def __init__(self, inner: EventLog, history: History) -> None:
        self.inner = inner
        self.history = history
        self._pending: list[Event] = []

    def append(self, event: Event) -> None:
        self.inner.append(event)
        self._pending.append(event)

    def note(self, op: str, **fields: Any) -> None:
        """Writes an operation that changed nothing (what it reports is already durable)."""
        self.history.append(op, 0, **fields)

    async def sync(self) -> None:
        pending, self._pending = self._pending, []
        try:
            await self.inner.sync()
        except BaseException:
            self._pending = pending + self._pending
            raise
        for ev in pending:
            op = operation(ev)
            if op is not None:
                self.history.append(op.pop("op"), 0, **op)
