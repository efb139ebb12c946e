"""The chaos schedule repeats while a soak runs (apps/demo/chaos.py, ``--chaos-repeat``):
round after round until the demo's work is done, then it stops at the next fault boundary
(never mid-fault, and never before one whole round); a schedule run once is not cut short
by the end of the work. Faults are recorded, not sent: the processes are fakes here (the
real faults: tests/fault/test_chaos_demo.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from apps.demo.chaos import Chaos, Fault, FaultRecord

SCHEDULE = (Fault("kill", "router"), Fault("pause", "etcd", 0.01), Fault("kill", "packer"))


class Recorded(Chaos):
    """Injects nothing: each fault is recorded and survived after ``recover_s``."""

    recover_s: float = 0.02
    in_flight: int = 0

    async def inject(self, cluster: Any, fault: Fault) -> FaultRecord:
        self.in_flight += 1
        return FaultRecord(fault.kind, fault.target, 0.0, 1, fault.pause_s)

    async def await_recovery(self, cluster: Any, fault: Fault, rec: FaultRecord) -> None:
        await asyncio.sleep(self.recover_s)
        rec.survived = True
        self.in_flight -= 1


async def test_a_repeating_schedule_runs_rounds_until_finished_then_stops_at_a_fault_boundary():
    chaos = Recorded(schedule=SCHEDULE, first_s=0.0, gap_s=0.01, repeat=True)
    task = asyncio.create_task(chaos.run(cluster=None))  # type: ignore[arg-type]
    while chaos.rounds < 3:
        await asyncio.sleep(0.005)
    chaos.finish()
    await asyncio.wait_for(task, 1.0)
    assert chaos.rounds >= 3 and chaos.in_flight == 0  # no fault left mid-recovery
    s = chaos.summary()
    assert s["injected"] >= 9 and s["survived"] == s["scheduled"] == s["injected"]
    assert s["repeat"] is True and s["rounds"] == chaos.rounds
    targets = [f["target"] for f in s["faults"]]
    assert targets[:6] == ["router", "etcd", "packer"] * 2  # the schedule, in order, again


async def test_finished_before_a_whole_round_it_still_injects_every_fault_once():
    chaos = Recorded(schedule=SCHEDULE, first_s=0.0, gap_s=0.01, repeat=True)
    chaos.finish()  # the work was done at once
    await asyncio.wait_for(chaos.run(cluster=None), 1.0)  # type: ignore[arg-type]
    assert [r.target for r in chaos.records] == ["router", "etcd", "packer"] and chaos.rounds == 1


async def test_a_schedule_run_once_is_neither_repeated_nor_cut_short():
    chaos = Recorded(schedule=SCHEDULE, first_s=0.0, gap_s=0.01)
    task = asyncio.create_task(chaos.run(cluster=None))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    chaos.finish()
    await asyncio.wait_for(task, 1.0)
    s = chaos.summary()
    assert (s["injected"], s["survived"], s["scheduled"], s["rounds"]) == (3, 3, 3, 1)
    assert s["repeat"] is False


def test_the_demo_flags(monkeypatch, tmp_path):
    from apps.demo import __main__ as demo

    seen: list[Chaos | None] = []

    async def fake_run(opts):
        seen.append(opts.chaos)
        return {"outcome": "completed", "executions": {"lost": 0}, "checker": {"ok": True}}

    monkeypatch.setattr(demo, "run_demo", fake_run)
    for flags in ([], ["--chaos"], ["--chaos-repeat"]):
        assert demo.main(["--engine", "mock", "--run-dir", str(tmp_path), *flags]) == 0
    assert seen[0] is None
    assert isinstance(seen[1], Chaos) and not seen[1].repeat
    assert isinstance(seen[2], Chaos) and seen[2].repeat
