"""An operation history: one JSON object a line, appended by a service (checker input).

Every service config has ``history_file`` (gyre/config.py); empty turns the history off.
Each line is ``{"op": ..., "t": unix seconds, "epoch": fencing epoch, ...fields}``, plus
``"svc"`` when the writer names its service (the scheduler's lines have none) and the
writer's tags (a cell agent's ``"cell"``). Several processes (a restarted one, a successor
leader, every cell) may append to the same file: a line is one ``write`` of less than a
pipe buffer to a file opened for append. ``python -m apps.checker``
reads and verifies merged histories.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, TextIO


class History:
    """Appends operations to a JSONL file (line-buffered; a no-op without a path)."""

    def __init__(self, path: str = "", svc: str = "", **tags: Any) -> None:
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._svc = {"svc": svc, **tags} if svc else dict(tags)
        if self._file is not None and svc:
            self.append("start", 0, pid=os.getpid())

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def append(self, op: str, epoch: int, **fields: Any) -> None:
        if self._file is not None:
            line = {"op": op, "t": round(time.time(), 6), "epoch": epoch, **self._svc, **fields}
            self._file.write(json.dumps(line) + "\n")

    def invoke(self, op: str, epoch: int, **fields: Any) -> None:
        """Written just before a write whose outcome a crash can hide (Jepsen's *invoke*): a
        process killed after its write landed and before it appended ``op`` leaves only this
        line. The checker reads an invoke without its completion as indeterminate: it took
        effect exactly when a later operation shows it did."""
        self.append("invoke", epoch, of=op, **fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(path: str | Path) -> list[dict[str, Any]]:
    """The operations of one history file; a torn last line (a process killed mid-write) is skipped."""
    ops: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                ops.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return ops
