"""apps.supervise: restart with back-off and jitter, give up after too many, events."""

from __future__ import annotations

import json
import random
import time

import pytest

from apps.supervise import RestartPolicy, Supervisor
from testkit.supervise_fakes import FakeChild

FAST = RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.05, jitter=0.5, max_restarts=3, window_s=60)


def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def restarted(sup: Supervisor) -> bool:
    return any(e.kind == "restarted" for e in sup.events())


def test_backoff_doubles_to_the_cap_with_jitter_below_each_step():
    p = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=8.0, multiplier=2.0, jitter=0.5)
    rng = random.Random(7)
    for failures, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        delays = [p.delay_s(failures, rng) for _ in range(200)]
        assert all(base * 0.5 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base * 0.3  # jittered, not constant


def test_policy_from_config_refuses_unknown_fields_and_bad_values():
    assert RestartPolicy.from_config({"max_restarts": 2}).max_restarts == 2
    with pytest.raises(ValueError, match="unknown"):
        RestartPolicy.from_config({"max_restart": 2})
    with pytest.raises(ValueError):
        RestartPolicy(jitter=1.5)


def test_crashed_child_is_restarted_and_events_are_journaled(tmp_path):
    child = FakeChild("cell-1")
    seen = []
    sup = Supervisor(FAST, on_event=seen.append, journal=tmp_path / "j.jsonl", poll_s=0.005)
    sup.add(child)
    sup.start()
    try:
        old = child.pid
        child.crash()
        # The callback runs last (after the event list and the journal): wait for it.
        wait_for(lambda: [e.kind for e in seen][-1:] == ["restarted"])
        assert child.alive() and child.pid != old and child.reaped == 1
        kinds = [e.kind for e in sup.events()]
        assert kinds == ["exited", "restarting", "restarted"]
        assert sup.events()[0].detail["rc"] == -9
        lines = [json.loads(x) for x in (tmp_path / "j.jsonl").read_text().splitlines()]
        assert [x["kind"] for x in lines] == kinds and lines[-1]["pid"] == child.pid
        assert [e.kind for e in seen] == kinds
        assert sup.status() == [
            {"name": "cell-1", "state": "running", "pid": child.pid, "restarts": 1, "last_exit": -9}
        ]
    finally:
        sup.stop()


def test_failed_starts_back_off_again_then_succeed():
    child = FakeChild("packer", fail_starts=2)
    sup = Supervisor(FAST, poll_s=0.005)
    sup.add(child)
    sup.start()
    try:
        child.crash()
        wait_for(lambda: restarted(sup))
        assert child.starts == 3
        kinds = [e.kind for e in sup.events()]
        assert kinds.count("restart_failed") == 2 and kinds[-1] == "restarted"
        attempts = [e.detail["attempt"] for e in sup.events() if e.kind == "restarting"]
        assert attempts == [1, 2, 3]  # consecutive failures grow the back-off
    finally:
        sup.stop()


def test_gives_up_after_too_many_exits_in_the_window():
    child = FakeChild("router", fail_starts=100)
    sup = Supervisor(FAST, poll_s=0.005)
    sup.add(child)
    sup.start()
    try:
        child.crash()
        wait_for(lambda: sup.failed() == ["router"])
        assert child.starts == FAST.max_restarts
        assert sup.events()[-1].kind == "gave_up"
    finally:
        sup.stop()


def test_stopped_supervisor_restarts_nothing():
    child = FakeChild("scheduler")
    sup = Supervisor(FAST, poll_s=0.005)
    sup.add(child)
    sup.start()
    sup.stop()
    child.crash()
    time.sleep(0.1)
    assert child.starts == 0 and sup.events() == []


def test_disabled_policy_starts_no_monitor():
    child = FakeChild("scheduler")
    sup = Supervisor(RestartPolicy(enabled=False), poll_s=0.005).start()
    sup.add(child)
    child.crash()
    time.sleep(0.05)
    assert child.starts == 0
