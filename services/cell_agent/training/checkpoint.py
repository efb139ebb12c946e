"""Durable core state on local disk: a checkpoint per committed step (weights + optimizer
state + the batch it committed) and a write-ahead record of a reduced gradient, so that a
core that crashes between its optimizer step and the step's record replays exactly once.

Every file is written to a temporary name, fsynced and renamed, so a reader sees a whole
file or none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_CKPT = re.compile(r"^step-(\d{8})-b(\d+)\.pt$")
_WAL = re.compile(r"^pending-b(\d+)\.pt$")


@dataclasses.dataclass
class CheckpointRecord:
    """A committed step: weights at ``version``, the optimizer state, the last batch."""

    version: int
    batch_id: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    steps: int


@dataclasses.dataclass
class PendingStep:
    """A reduced, not yet committed gradient: enough to redo the step after a crash."""

    batch_id: int
    base_version: int
    grad_sum: torch.Tensor
    tokens: int


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Checkpointer:
    """Checkpoints and write-ahead records of one core under ``directory``."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def save(self, rec: CheckpointRecord) -> Path:
        path = self.dir / f"step-{rec.version:08d}-b{rec.batch_id}.pt"
        _atomic_save(dataclasses.asdict(rec), path)
        for old in self._checkpoints()[: -self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> CheckpointRecord | None:
        for path in reversed(self._checkpoints()):
            try:
                data = torch.load(path, map_location="cpu", weights_only=False)
            except (OSError, RuntimeError, EOFError) as exc:  # a torn file cannot exist; a bad disk can
                log.error("unreadable checkpoint %s: %r", path, exc)
                continue
            return CheckpointRecord(**data)
        return None

    def write_pending(self, p: PendingStep) -> None:
        _atomic_save(dataclasses.asdict(p), self.dir / f"pending-b{p.batch_id}.pt")

    def pending(self) -> list[PendingStep]:
        out = []
        for path in sorted(self.dir.iterdir()):
            if _WAL.match(path.name):
                out.append(PendingStep(**torch.load(path, map_location="cpu", weights_only=False)))
        return sorted(out, key=lambda p: p.batch_id)

    def drop_pending(self, batch_id: int) -> None:
        (self.dir / f"pending-b{batch_id}.pt").unlink(missing_ok=True)

    def _checkpoints(self) -> list[Path]:
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _CKPT.match(p.name))]
        return [p for _, p in sorted(found)]
