"""Process-tree helpers for fault tests: what a process started, and whether it is gone."""

from __future__ import annotations

import time

import psutil


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every live descendant."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def survivors(procs: list[psutil.Process], within_s: float) -> list[str]:
    """Those of ``procs`` still running (zombies count as gone) after up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_leftovers(procs: list[psutil.Process]) -> None:
    """Test cleanup: SIGKILL whatever of ``procs`` is still running."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
