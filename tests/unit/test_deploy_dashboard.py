"""The dashboard's timeline and poller (services/dashboard), without sockets.

Invariants: a status is validated before it changes anything (a malformed one is counted as
an error and leaves the timeline as it was); role bands merge equal consecutive states, mark
a vanished cell GONE and stay contiguous; the timeline stays within ``max_samples``; a status
from a lower fencing epoch (standby, deposed leader) is ignored; a failing or hanging source
is a recorded error, never an exception out of the poller, while cancellation propagates;
/api/timeline, /healthz and /metrics reflect the latest status; the page loads nothing from
outside (no CDN).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from services.dashboard import metrics
from services.dashboard.app import PAGE_PATH, DashboardApp
from services.dashboard.timeline import GONE, Timeline, normalize_status
from testkit.clock import ManualClock
from testkit.dashboard_status import status


def test_normalize_accepts_every_enum_spelling() -> None:
    raw = {
        "epoch": "5",
        "cells": [
            {"cell_id": "a", "kind": 2, "index": 0, "state": 4},
            {"cell_id": "b", "kind": "ELASTIC", "index": 1, "state": "draining"},
            {"cell_id": "c", "kind": "CELL_KIND_STANDALONE", "index": -1, "state": "CELL_STATE_UNSPECIFIED"},
        ],
    }
    out = normalize_status(raw)
    assert out["epoch"] == 5 and out["ledger"]["waterlevel"] == 0
    assert [(c["kind"], c["state"]) for c in out["cells"]] == [
        ("ELASTIC", "TRAINING"),
        ("ELASTIC", "DRAINING"),
        ("STANDALONE", "UNKNOWN"),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"cells": {"a": 1}},
        {"cells": [{"cell_id": ""}]},
        {"cells": [{"cell_id": "a"}, {"cell_id": "a"}]},
        {"cells": [{"cell_id": "a", "state": "SLEEPING"}]},
        {"cells": [{"cell_id": "a", "kind": True}]},
        {"leader": "yes"},
        {"total": 3},
        {"ledger": [1, 2]},
        {"capacity": "lots"},
        {"capacity": [1]},
        [],
    ],
)
def test_malformed_status_changes_nothing(bad: Any) -> None:
    tl = Timeline()
    assert tl.add(0.0, status({"c0": "ROLLOUT"}))
    before = tl.to_json(1.0)
    with pytest.raises(ValueError):
        tl.add(1.0, bad)
    after = tl.to_json(1.0)
    assert after["series"] == before["series"] and after["bands"] == before["bands"]
    assert tl.stats.errors == 1 and tl.stats.ok == 1 and tl.stats.last_error


def test_bands_merge_and_mark_gone() -> None:
    tl = Timeline()
    seq = ["ROLLOUT", "ROLLOUT", "DRAINING", "TRAINING", "TRAINING", "RETURNING", "ROLLOUT"]
    for t, state in enumerate(seq):
        tl.add(float(t), status({"c0": state, "c1": "ROLLOUT"} if t < 5 else {"c0": state}))
    bands = tl.to_json(7.0)["bands"]
    assert bands["c0"] == [
        [0.0, 2.0, "ROLLOUT"],
        [2.0, 3.0, "DRAINING"],
        [3.0, 5.0, "TRAINING"],
        [5.0, 6.0, "RETURNING"],
        [6.0, 6.0, "ROLLOUT"],
    ]
    assert bands["c1"] == [[0.0, 5.0, "ROLLOUT"], [5.0, 6.0, GONE]]
    cells = {c["cell_id"]: c for c in tl.to_json(7.0)["cells"]}
    assert cells["c1"]["state"] == GONE and cells["c0"]["role"] == "core"


def test_timeline_is_bounded_and_forgets_long_gone_cells() -> None:
    tl = Timeline(max_samples=10)
    for t in range(50):
        tl.add(
            float(t),
            status(
                {"c0": "ROLLOUT" if t % 7 else "TRAINING", "old": "ROLLOUT"} if t < 5 else {"c0": "ROLLOUT"}
            ),
        )
    out = tl.to_json(50.0)
    assert len(out["series"]["t"]) == 10 and out["series"]["t"][0] == 40.0
    assert "old" not in out["bands"] and [c["cell_id"] for c in out["cells"]] == ["c0"]
    assert all(b[0] >= 40.0 for b in out["bands"]["c0"])


def test_stale_epoch_is_ignored_and_policy_marks_recorded() -> None:
    tl = Timeline()
    assert tl.add(0.0, status({"c0": "ROLLOUT"}, epoch=7, version=1))
    assert not tl.add(1.0, status({"c0": "TRAINING"}, epoch=6, version=9))  # a standby's view
    assert tl.add(2.0, status({"c0": "ROLLOUT"}, epoch=7, version=2))
    out = tl.to_json(3.0)
    assert out["policy_marks"] == [[0.0, 1], [2.0, 2]]
    assert {b[2] for b in out["bands"]["c0"]} == {"ROLLOUT"}
    assert tl.stats.stale == 1 and out["counters"]["epoch"] == 7
    standby = dict(status({"c0": "TRAINING"}, epoch=9), leader=False)
    assert not tl.add(4.0, standby) and tl.stats.stale == 2
    leader = dict(
        status({"c0": "TRAINING"}, epoch=9),
        leader=True,
        policy="waterlevel",
        total={"dispatched": "40", "finished": 31},
    )
    assert tl.add(5.0, leader)
    counters = tl.to_json(6.0)["counters"]
    assert (counters["policy"], counters["total_dispatched"], counters["total_finished"]) == (
        "waterlevel",
        40,
        31,
    )


async def test_poller_records_errors_and_hangs() -> None:
    calls: list[str] = []
    script = ["ok", "boom", "hang", "ok"]

    async def source() -> dict[str, Any]:
        what = script[len(calls)]
        calls.append(what)
        if what == "boom":
            raise ConnectionError("scheduler down")
        if what == "hang":
            await asyncio.sleep(3600)
        return status({"c0": "ROLLOUT"})

    clock = ManualClock(100.0)
    dash = DashboardApp(source, poll_interval_s=0.01, poll_timeout_s=0.05, clock=clock)
    results = []
    for _ in script:
        clock.now += 0.5
        results.append(await dash.poll_once())
    assert results == [True, False, False, True]
    stats = dash.timeline.stats
    assert (stats.ok, stats.errors) == (2, 2)
    assert dash.timeline.to_json(0)["series"]["t"] == [0.5, 2.0]


async def test_poller_does_not_swallow_cancellation() -> None:
    async def source() -> dict[str, Any]:
        raise asyncio.CancelledError

    dash = DashboardApp(source)
    with pytest.raises(asyncio.CancelledError):
        await dash.poll_once()


async def test_handlers_reflect_latest_status() -> None:
    versions = iter(range(10))

    async def source() -> dict[str, Any]:
        v = next(versions)
        return status({"c0": "TRAINING" if v else "ROLLOUT", "s9": "ROLLOUT"}, version=v, w=12 - v)

    clock = ManualClock(100.0)
    dash = DashboardApp(source, clock=clock)
    for _ in range(3):
        clock.now += 0.5
        await dash.poll_once()
    body = json.loads((await dash._timeline(None)).body)  # type: ignore[arg-type]
    assert body["counters"]["policy_version"] == 2 and body["counters"]["waterlevel"] == 10
    assert [c["role"] for c in body["cells"]] == ["core", "standalone"]
    assert body["series"]["waterlevel"] == [12, 11, 10]
    health = json.loads((await dash._healthz(None)).body)  # type: ignore[arg-type]
    assert health["ok"] and health["polls_ok"] == 3 and health["last_ok_age_s"] == 0.0
    text = metrics.render(dash._registry).decode()
    assert "gyre_status_policy_version 2.0" in text
    assert 'gyre_status_cell_state{cell_id="c0",kind="elastic",state="training"} 1.0' in text
    assert 'gyre_status_cell_state{cell_id="c0",kind="elastic",state="rollout"} 0.0' in text


def test_page_is_self_contained() -> None:
    page = PAGE_PATH.read_text()
    assert not re.search(r"https?://", page), "the page must not load anything from outside"
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)
    assert "/api/timeline" in page and "<canvas" in page


async def test_timeline_window() -> None:
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    clock = ManualClock(100.0)
    states = iter(["ROLLOUT"] * 5 + ["TRAINING"] * 5)

    async def source() -> dict[str, Any]:
        return status({"c0": next(states)}, version=0)

    dash = DashboardApp(source, clock=clock)
    for _ in range(10):
        clock.now += 1.0
        await dash.poll_once()
    full = json.loads((await dash._timeline(make_mocked_request("GET", "/api/timeline"))).body)
    assert full["series"]["t"] == [float(t) for t in range(1, 11)]
    part = json.loads((await dash._timeline(make_mocked_request("GET", "/api/timeline?window_s=3"))).body)
    assert part["series"]["t"] == [7.0, 8.0, 9.0, 10.0] and len(part["series"]["waterlevel"]) == 4
    assert part["bands"]["c0"] == [[7.0, 10.0, "TRAINING"]]
    assert part["policy_marks"] == [] and part["counters"] == full["counters"]
    for bad in ("abc", "-1", "0"):
        with pytest.raises(web.HTTPBadRequest):
            await dash._timeline(make_mocked_request("GET", f"/api/timeline?window_s={bad}"))


def test_events_are_validated_and_deduplicated() -> None:
    tl = Timeline(max_events=3)
    assert tl.add_event({"seq": "1", "time_s": 10.0, "kind": "burst_started", "message": "burst 1"})
    assert not tl.add_event({"seq": 1, "time_s": 10.0, "kind": "burst_started", "message": "burst 1"})
    for bad in ({"seq": -1}, {"seq": 2, "time_s": "x"}, {"seq": 2, "kind": 5}, [1]):
        with pytest.raises(ValueError):
            tl.add_event(bad)  # type: ignore[arg-type]
    for seq in range(2, 6):
        tl.add_event({"seq": seq, "time_s": 10.0 + seq, "kind": "reroute"})
    events = tl.to_json(0.0)["events"]
    assert [e["seq"] for e in events] == [5, 4, 3]  # newest first, bounded
    assert tl.stats.events == 5


async def test_event_stream_resumes_and_survives_failures() -> None:
    calls: list[int] = []

    async def events(after_seq: int) -> Any:
        calls.append(after_seq)
        if len(calls) == 1:
            yield {"seq": 1, "time_s": 1.0, "kind": "burst_started"}
            yield {"seq": 2, "time_s": 2.0, "kind": "cell_to_training"}
            return  # a bounded stream ended: resume after 2
        if len(calls) == 2:
            yield {"seq": 3, "time_s": 3.0, "kind": "reroute"}
            raise ConnectionError("scheduler gone")  # resume from 0: duplicates dropped
        if len(calls) == 3:
            for seq in (1, 2, 3):
                yield {
                    "seq": seq,
                    "time_s": float(seq),
                    "kind": ["burst_started", "cell_to_training", "reroute"][seq - 1],
                }
            yield {"seq": 4, "time_s": 4.0, "kind": "cell_to_rollout"}
            yield {"seq": "bad"}
        await asyncio.sleep(3600)
        yield {}

    async def status_source() -> dict[str, Any]:
        return status({"c0": "ROLLOUT"})

    dash = DashboardApp(status_source, events_source=events, events_retry_s=0.01)
    task = asyncio.create_task(dash.run_events())
    for _ in range(200):
        if dash.timeline.stats.events >= 4 and dash.timeline.stats.event_errors >= 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == [0, 2, 0]  # resumed after 2, then from 0 after the failure; the last stays open
    kinds = [e["kind"] for e in dash.timeline.to_json(0.0)["events"]]
    assert kinds == ["cell_to_rollout", "reroute", "cell_to_training", "burst_started"]
    assert dash.timeline.stats.event_errors == 2  # the failure and the malformed event


def test_overlapping_bursts_show_as_open_work_per_version() -> None:
    """While bursts overlap, each version's open work (W) is its own series; a version whose
    work all closed before the window leaves it; a malformed per-version ledger is refused."""
    tl = Timeline(max_samples=3)

    def with_versions(*ws: tuple[int, int]) -> dict[str, Any]:
        st = status({"c0": "ROLLOUT"})
        st["versions"] = [
            {"policy_version": v, "dispatched": 8, "finished": 8 - w, "waterlevel": w} for v, w in ws
        ]
        st["open_bursts"] = sum(1 for _, w in ws if w)
        return st

    tl.add(1.0, with_versions((0, 6)))
    tl.add(2.0, with_versions((0, 2), (1, 8)))  # burst 2 (v1) dispatched before burst 1 closed
    out = tl.to_json(2.0)
    assert out["version_w"] == {"0": [6, 2], "1": [0, 8]} and out["counters"]["open_bursts"] == 2
    assert [v["policy_version"] for v in out["counters"]["versions"]] == [0, 1]
    for t in (3.0, 4.0, 5.0):
        tl.add(t, with_versions((0, 0), (1, 3)))
    assert tl.to_json(5.0)["version_w"] == {"1": [3, 3, 3]}
    with pytest.raises(ValueError, match="versions"):
        normalize_status({**status({"c0": "ROLLOUT"}), "versions": {"0": 1}})
