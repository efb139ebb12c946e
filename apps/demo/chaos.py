"""`make demo DEMO_ARGS=--chaos`: the demo while processes are killed and paused on a schedule.

:func:`injector` runs alongside the harness (``DemoOptions.during``). It works through a
schedule of faults: SIGKILL of a process (the launcher's supervisor restarts it; the fault
is survived when the process is running again), or SIGSTOP for ``pause_s`` then SIGCONT (a
stalled process; etcd paused is an outage of the control plane). Faults follow one another:
each starts ``gap_s`` after the previous one was survived, so every one meets a running
system. Each fault's record (what, when, how long until survived) goes to summary.json. A fault
not survived within ``recover_timeout_s`` does not hold up the schedule; its recovery is
still awaited before the run ends (the demo's own timeout bounds it).

``repeat`` (``--chaos-repeat``, the soak's chaos) runs the schedule round after round until
the demo's work is done: the demo then calls :meth:`Chaos.finish`, and the schedule stops at
the next fault boundary (once one whole round was injected), so the run never ends in the
middle of a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from apps.launch import Cluster


@dataclass(frozen=True)
class Fault:
    """One fault: ``kill`` (SIGKILL) or ``pause`` (SIGSTOP, then SIGCONT after ``pause_s``)."""

    kind: str
    target: str
    pause_s: float = 0.0


# Each service kind at least once, etcd paused once. A cell agent (a satellite: the core's
# death fails its attempt, which is redelivered, but is slower to recover), the router (live
# streams of the moment fail over to a retry), the packer (its WAL recovers), the scheduler
# (a new term takes over the ledger), a stalled cell agent, and etcd (~5 s).
DEFAULT_SCHEDULE: tuple[Fault, ...] = (
    Fault("kill", "cell-1"),
    Fault("kill", "router"),
    Fault("pause", "etcd", 5.0),
    Fault("kill", "packer"),
    Fault("kill", "scheduler"),
    Fault("pause", "cell-2", 3.0),
    Fault("kill", "cell-3"),
)


@dataclass
class FaultRecord:
    kind: str
    target: str
    at_s: float
    pid: int
    pause_s: float = 0.0
    survived: bool = False
    recovered_s: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Chaos:
    """A schedule and what happened to it."""

    schedule: tuple[Fault, ...] = DEFAULT_SCHEDULE
    first_s: float = 8.0
    gap_s: float = 6.0
    recover_timeout_s: float = 120.0
    repeat: bool = False
    """Run the schedule again and again until :meth:`finish` (at least once)."""
    records: list[FaultRecord] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    rounds: int = 0
    """Whole rounds of the schedule injected."""
    _finishing: bool = field(default=False, init=False, repr=False)
    _wake: asyncio.Event | None = field(default=None, init=False, repr=False)

    def finish(self) -> None:
        """The run's work is done: a repeating schedule injects no new fault once a whole
        round was injected (a schedule run once is not cut short)."""
        self._finishing = True
        if self._wake is not None:
            self._wake.set()

    def _stopping(self) -> bool:
        return self.repeat and self._finishing and self.rounds >= 1

    async def run(self, cluster: Cluster) -> None:
        """Injects every fault in turn, round after round with ``repeat`` (the demo cancels
        it when the run ends)."""
        self.started = time.monotonic()
        self._wake = asyncio.Event()
        await asyncio.sleep(self.first_s)
        slow: list[asyncio.Task[None]] = []
        while not self._stopping():
            for fault in self.schedule:
                if self._stopping():
                    break
                rec = await self.inject(cluster, fault)
                self.records.append(rec)
                watch = asyncio.create_task(self.await_recovery(cluster, fault, rec))
                # The schedule goes on after recover_timeout_s; a slow recovery is still watched
                # (and awaited below) so a process that comes back late counts as survived.
                done, _ = await asyncio.wait({watch}, timeout=self.recover_timeout_s)
                if not done:
                    rec.detail = (
                        f"not running again within {self.recover_timeout_s:.0f} s; the schedule went on"
                    )
                    slow.append(watch)
                await self._gap()
            else:
                self.rounds += 1
            if not self.repeat:
                break
        await asyncio.gather(*slow)

    async def _gap(self) -> None:
        """``gap_s``, cut short by :meth:`finish` once a repeating schedule may stop."""
        if not (self.repeat and self.rounds >= 1) or self._wake is None:
            await asyncio.sleep(self.gap_s)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.gap_s)

    async def inject(self, cluster: Cluster, fault: Fault) -> FaultRecord:
        pid = _pid(cluster, fault.target)
        at_s = round(time.monotonic() - self.started, 1)
        rec = FaultRecord(fault.kind, fault.target, at_s, pid, fault.pause_s)
        if fault.kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif fault.kind == "pause":
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(fault.pause_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        return rec

    async def await_recovery(self, cluster: Cluster, fault: Fault, rec: FaultRecord) -> None:
        """Waits until the fault is survived: a killed process is running again (restarted
        by the supervisor, a new pid), a paused one is running on."""
        t0 = time.monotonic()
        while not _back(cluster, fault, rec.pid):
            await asyncio.sleep(0.25)
        rec.survived = True
        rec.recovered_s = round(time.monotonic() - t0 + fault.pause_s, 1)

    def summary(self) -> dict[str, Any]:
        """What was injected and survived; ``scheduled``: the faults the run had to inject
        (the schedule, or with ``repeat`` every fault it started)."""
        return {
            "injected": len(self.records),
            "survived": sum(1 for r in self.records if r.survived),
            "scheduled": len(self.records) if self.repeat else len(self.schedule),
            "repeat": self.repeat,
            "rounds": self.rounds,
            "faults": [r.to_json() for r in self.records],
        }


def _pid(cluster: Cluster, target: str) -> int:
    if target == "etcd":
        assert cluster.etcd is not None, "the demo runs a private etcd"
        return cluster.etcd.pid
    return cluster.procs[target].pid


def _back(cluster: Cluster, fault: Fault, pid: int) -> bool:
    """The fault's process runs (a killed one as a new process)."""
    return _running(cluster, fault.target) and (fault.kind == "pause" or _pid(cluster, fault.target) != pid)


def _running(cluster: Cluster, target: str) -> bool:
    states = {s["name"]: s["state"] for s in cluster.supervisor.status()}
    if target == "etcd":
        up = cluster.etcd is not None and cluster.etcd.running()
        return up and states.get("etcd", "running") == "running"
    return cluster.procs[target].alive() and states.get(target, "running") == "running"
