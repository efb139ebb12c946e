"""The launcher's stop: the last started first, and the processes of one service (the cells)
together, so that a cluster's stop takes one cell's drain rather than the sum of all."""

from __future__ import annotations

import threading

from apps.launch import Cluster


class _Proc:
    def __init__(self, service: str, name: str, log: list[str], barrier: threading.Barrier | None) -> None:
        self.service, self.name = service, name
        self._log, self._barrier = log, barrier

    def stop(self, timeout_s: float = 15.0) -> int:
        if self._barrier is not None:
            # Every cell waits here until all of them stop: a stop one after the other would
            # break the barrier (BrokenBarrierError after its timeout).
            self._barrier.wait(timeout=5.0)
        self._log.append(self.name)
        return 0


class _Supervisor:
    def stop(self) -> None:
        pass

    def join_restarts(self, timeout_s: float) -> None:
        pass


def test_cells_stop_together_and_services_in_reverse_order() -> None:
    log: list[str] = []
    cells = threading.Barrier(3)
    procs = [
        _Proc("scheduler", "scheduler", log, None),
        _Proc("packer", "packer", log, None),
        *(_Proc("cell_agent", f"cell-{i}", log, cells) for i in range(3)),
        _Proc("dashboard", "dashboard", log, None),
    ]
    cluster = object.__new__(Cluster)
    cluster.supervisor = _Supervisor()  # type: ignore[assignment]
    cluster.procs = {p.name: p for p in procs}  # type: ignore[misc]
    cluster.etcd = None
    cluster.etcd_upkeep = None
    cluster.stop()
    first_pass = log[: len(procs)]
    assert first_pass[0] == "dashboard"
    assert sorted(first_pass[1:4]) == ["cell-0", "cell-1", "cell-2"]
    assert first_pass[4:] == ["packer", "scheduler"]
