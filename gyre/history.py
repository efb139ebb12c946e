"""An operation history: one JSON object a line, appended by a service (checker input).

Every service config has ``history_file`` (gyre/config.py); empty turns the history off.
Each line is ``{"op": ..., "t": unix seconds, "epoch": fencing epoch, ...fields}``, plus
``"svc"`` when the writer names its service (the scheduler's lines have none) and the
writer's tags (a cell agent's ``"cell"``). Several processes (a restarted one, a successor
leader, every cell) may append to the same file: a line is one ``write`` of less than a
pipe buffer to a file opened for append. ``python -m apps.checker``
reads and verifies merged histories.

Rotation (``history_max_bytes``, ``history_keep``): once the file reaches ``max_bytes`` the
writer that notices renames it to ``<file>.<n>`` (n = 1, 2, ... in the order they were
rotated: the lowest is the oldest) and starts a new ``<file>``. The writers of one file
rotate under an ``flock`` on ``<file>.lock``; a writer whose file was rotated by another
reopens ``<file>`` at its next line (a line or two may land at the end of the rotated
segment: readers order lines by time). With ``keep`` > 0 only the newest ``keep`` segments
are kept; :func:`pruned` tells a reader that the oldest ones are gone. :func:`read` reads a
history's segments, oldest first, then the file itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from pathlib import Path
from typing import Any, TextIO


class History:
    """Appends operations to a JSONL file (line-buffered; a no-op without a path), rotated
    at ``max_bytes`` (0: never) keeping the newest ``keep`` rotated segments (0: all)."""

    def __init__(self, path: str = "", svc: str = "", max_bytes: int = 0, keep: int = 0, **tags: Any) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._keep = keep
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._svc = {"svc": svc, **tags} if svc else dict(tags)
        if self._file is not None and svc:
            self.append("start", 0, pid=os.getpid())

    @classmethod
    def of(cls, cfg: Any, svc: str = "", **tags: Any) -> History:
        """The history a service config asks for (``history_file``, ``history_max_bytes``,
        ``history_keep``)."""
        return cls(cfg.history_file, svc=svc, max_bytes=cfg.history_max_bytes, keep=cfg.history_keep, **tags)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def append(self, op: str, epoch: int, **fields: Any) -> None:
        if self._file is not None:
            line = {"op": op, "t": round(time.time(), 6), "epoch": epoch, **self._svc, **fields}
            data = json.dumps(line) + "\n"
            if self._max_bytes:
                self._roll(len(data))
            self._file.write(data)

    def _roll(self, incoming: int) -> None:
        """Rotates the file when this line would take it past ``max_bytes``, or reopens it
        when another writer rotated it."""
        assert self._file is not None
        mine = os.fstat(self._file.fileno())
        try:
            current = os.stat(self._path)
        except FileNotFoundError:
            current = None
        rotated_by_another = current is None or current.st_ino != mine.st_ino
        if not rotated_by_another and (mine.st_size == 0 or mine.st_size + incoming <= self._max_bytes):
            return
        with open(f"{self._path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current = os.stat(self._path) if os.path.exists(self._path) else None
                if current is not None and current.st_ino == mine.st_ino:
                    n = max((i for i, _ in segments(self._path)), default=0) + 1
                    os.rename(self._path, f"{self._path}.{n}")
                    if self._keep:
                        for _, old in segments(self._path)[: -self._keep]:
                            old.unlink(missing_ok=True)
                self._file.close()
                self._file = open(self._path, "a", buffering=1)  # noqa: SIM115
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

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


def segments(path: str | Path) -> list[tuple[int, Path]]:
    """The rotated segments of the history ``path`` (``<path>.<n>``), oldest first."""
    path = Path(path)
    pattern = re.compile(re.escape(path.name) + r"\.(\d+)")
    found = []
    if path.parent.is_dir():
        for p in path.parent.iterdir():
            if m := pattern.fullmatch(p.name):
                found.append((int(m.group(1)), p))
    return sorted(found)


def base(path: str | Path) -> Path:
    """The history a file belongs to: ``x.jsonl`` for a segment ``x.jsonl.3``, else itself."""
    path = Path(path)
    stem, _, n = path.name.rpartition(".")
    if stem and n.isdigit() and "." in stem:
        return path.with_name(stem)
    return path


def pruned(path: str | Path) -> bool:
    """True when retention (``history_keep``) deleted the oldest segments of this history."""
    segs = segments(path)
    return bool(segs) and segs[0][0] > 1


def read(path: str | Path) -> list[dict[str, Any]]:
    """The operations of one history: its rotated segments, oldest first, then the file
    itself; a torn line (a process killed mid-write) is skipped."""
    files = [p for _, p in segments(path)]
    if Path(path).exists() or not files:
        files.append(Path(path))  # a history with neither raises FileNotFoundError
    ops: list[dict[str, Any]] = []
    for file in files:
        for line in file.read_text().splitlines():
            if line.strip():
                try:
                    ops.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return ops
