"""A scriptable supervised child for apps.supervise unit tests."""

from __future__ import annotations

import itertools

_pids = itertools.count(1000)


class FakeChild:
    """Alive until :meth:`crash`; :meth:`start` fails while ``fail_starts`` > 0."""

    def __init__(self, name: str, fail_starts: int = 0) -> None:
        self.name = name
        self.fail_starts = fail_starts
        self.pid = next(_pids)
        self.up = True
        self.starts = 0
        self.reaped = 0
        self.rc: int | None = None

    def alive(self) -> bool:
        return self.up

    def crash(self, rc: int = -9) -> None:
        self.up, self.rc = False, rc

    def start(self) -> None:
        self.starts += 1
        if self.fail_starts > 0:
            self.fail_starts -= 1
            self.rc = 1
            raise RuntimeError(f"{self.name} exited with 1 before ready")
        self.pid, self.up, self.rc = next(_pids), True, None

    def after_exit(self) -> None:
        self.reaped += 1

    def returncode(self) -> int | None:
        return self.rc
