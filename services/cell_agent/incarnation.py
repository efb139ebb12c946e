"""One incarnation of a cell at a time: a cell agent ends what a previous incarnation of the
same cell left running before it starts its own engine, and records what it starts.

A cell agent that dies takes its engine with it (the engine core arms a parent-death signal,
:mod:`gyre.lifeline`), but a previous incarnation that is stuck (SIGSTOPped, hung) still
holds its engine, and on a GPU an orphaned engine keeps the whole GPU's memory. So each
cell agent keeps a record (``<pid_dir>/cell-<cell_id>.json``, and on a GPU machine also
``gpu-<CUDA_VISIBLE_DEVICES>.json``) of itself and every process it started, each with its
start time; the next agent for that cell (or that GPU) kills every recorded process that is
still the same process, and says so in its log.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from gyre.lifeline import PidFile, descendants, mark_parent

log = logging.getLogger(__name__)


def default_pid_dir(cluster_name: str) -> Path:
    """``$XDG_RUNTIME_DIR/gyre/<cluster>`` (or the temp dir's ``gyre-<uid>/<cluster>``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "gyre" if runtime else Path(tempfile.gettempdir()) / f"gyre-{os.getuid()}"
    return base / cluster_name


def record_files(pid_dir: str | Path, cell_id: str, gpu: bool) -> list[PidFile]:
    """The records of this cell: by cell id, and by GPU set where there is one."""
    root = Path(pid_dir)
    files = [PidFile(root / f"cell-{cell_id}.json")]
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpu and devices:
        files.append(PidFile(root / f"gpu-{devices.replace(',', '_')}.json"))
    return files


class Incarnation:
    """The cell agent's side: :meth:`begin` before the engine starts, :meth:`record` once
    it runs, :meth:`end` on a clean shutdown."""

    def __init__(self, pid_dir: str | Path, cell_id: str, gpu: bool) -> None:
        self.cell_id = cell_id
        self.files = record_files(pid_dir, cell_id, gpu)

    def begin(self) -> list[dict[str, object]]:
        """Ends every process a previous incarnation recorded and left alive (logged), and
        makes the engine processes this agent starts die with it."""
        ended: list[dict[str, object]] = []
        for f in self.files:
            for proc in f.end_stale():
                log.warning(
                    "ended %s (pid %s), left running by a previous incarnation of cell %s",
                    proc["name"],
                    proc["pid"],
                    self.cell_id,
                    extra={
                        "cell_id": self.cell_id,
                        "pid": proc["pid"],
                        "process_name": proc["name"],
                        "record": str(f.path),
                    },
                )
                ended.append(proc)
        mark_parent()
        return ended

    def record(self) -> None:
        """Records this agent and every process it has started so far."""
        children = descendants(os.getpid())
        for f in self.files:
            f.write(os.getpid(), children)

    def end(self) -> None:
        for f in self.files:
            f.remove()
