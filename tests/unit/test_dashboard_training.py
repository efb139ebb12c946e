"""The dashboard's training diagnostics (SchedulerStatus.training): normalized, kept one
entry per policy version in the timeline, exported as ``gyre_training_*`` gauges.

Invariants: a status without diagnostics normalizes to ``training: None`` and adds nothing;
NaN / infinities (proto3 JSON strings) become null, never invalid JSON; a malformed value
rejects the status; each version is recorded once (first seen), the newest
``max_training`` kept, whatever the window asked for; a standby's status adds nothing;
/api/timeline carries ``training`` and ``training_latest``; /metrics has the gauges only
while the latest status carries diagnostics.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.dashboard import metrics
from services.dashboard.app import PAGE_PATH, DashboardApp
from services.dashboard.timeline import Timeline, normalize_status
from testkit.clock import ManualClock
from testkit.dashboard_status import DIAG, status

SERIES_KEYS = {"version", "t_s", *(k for k in DIAG if k != "lag_hist")}


def with_training(version: int, epoch: int = 1, **changes: Any) -> dict[str, Any]:
    raw = status({"c0": "ROLLOUT"}, epoch=epoch, version=version)
    raw["training"] = {"policy_version": str(version), **DIAG, **changes}  # int64 as JSON string
    return raw


def test_normalize_training() -> None:
    assert normalize_status(status({"c0": "ROLLOUT"}))["training"] is None
    assert normalize_status({**status({}), "training": {}})["training"] is None
    got = normalize_status(with_training(3, grad_norm="NaN", entropy="Infinity", lag_hist=[1, "-Infinity"]))
    t = got["training"]
    assert t["policy_version"] == 3 and t["clip_fraction"] == 0.125 and t["tokens"] == 1536.0
    assert t["grad_norm"] is None and t["entropy"] is None and t["lag_hist"] == [1.0, None]
    json.dumps(got, allow_nan=False)  # plain JSON
    partial = normalize_status({**status({}), "training": {"policy_version": 2, "clip_fraction": 0.5}})
    assert partial["training"]["entropy"] == 0.0 and partial["training"]["lag_hist"] == []


@pytest.mark.parametrize(
    "bad",
    [[1, 2], "x", {"clip_fraction": "abc"}, {"entropy": True}, {"lag_hist": {"0": 1}}, {"grad_norm": [1]}],
)
def test_malformed_training_rejects_the_status(bad: Any) -> None:
    tl = Timeline()
    with pytest.raises(ValueError):
        tl.add(1.0, {**status({"c0": "ROLLOUT"}), "training": bad})
    assert len(tl) == 0 and tl.to_json(1.0)["training"] == [] and tl.stats.errors == 1


def test_timeline_keeps_one_entry_per_version() -> None:
    tl = Timeline(max_training=3)
    tl.add(1.0, status({"c0": "ROLLOUT"}, version=0))  # mock trainer: no diagnostics
    assert tl.to_json(1.0)["training"] == [] and tl.to_json(1.0)["training_latest"] is None
    for t, v in ((2.0, 1), (3.0, 1), (4.0, 2), (5.0, 2)):  # every poll repeats the newest
        tl.add(t, with_training(v, clip_fraction=0.1 * v))
    body = tl.to_json(5.0)
    assert [(e["version"], e["t_s"]) for e in body["training"]] == [(1, 2.0), (2, 4.0)]
    assert set(body["training"][0]) == SERIES_KEYS
    assert body["training"][1]["clip_fraction"] == pytest.approx(0.2)
    assert body["training_latest"] == {"policy_version": 2, **DIAG, "clip_fraction": pytest.approx(0.2)}
    assert not tl.add(6.0, {**with_training(9), "leader": False})  # a standby's view: ignored
    for t, v in ((7.0, 3), (8.0, 4), (9.0, 5)):
        tl.add(t, with_training(v))
    body = tl.to_json(9.0, window_s=0.5)  # the per-version list is not cut by the window
    assert [e["version"] for e in body["training"]] == [3, 4, 5]
    tl.add(10.0, status({"c0": "ROLLOUT"}, version=6))  # the newest record has none
    body = tl.to_json(10.0)
    assert body["training_latest"] is None and [e["version"] for e in body["training"]] == [3, 4, 5]
    json.dumps(body, allow_nan=False)


async def test_api_and_metrics_carry_the_diagnostics() -> None:
    statuses = iter([status({"c0": "ROLLOUT"}), with_training(1), with_training(2, grad_norm="NaN")])

    async def source() -> dict[str, Any]:
        return next(statuses)

    clock = ManualClock(100.0)
    dash = DashboardApp(source, clock=clock)
    clock.now += 0.5
    await dash.poll_once()
    text = metrics.render(dash._registry).decode()
    assert "gyre_training_" not in text
    for _ in range(2):
        clock.now += 0.5
        await dash.poll_once()
    body = json.loads((await dash._timeline(None)).body)  # type: ignore[arg-type]
    assert [e["version"] for e in body["training"]] == [1, 2]
    assert body["training"][1]["grad_norm"] is None and body["training"][0]["grad_norm"] == 0.8
    assert body["training_latest"]["policy_version"] == 2 and body["training_latest"]["lag_hist"][1] == 400.0
    text = metrics.render(dash._registry).decode()
    assert "gyre_training_policy_version 2.0" in text
    assert "gyre_training_clip_fraction 0.125" in text
    assert "gyre_training_behaviour_weight_capped_share 0.01" in text
    assert "gyre_training_grad_norm" not in text  # NaN: left out
    assert 'gyre_training_lag_tokens{lag="0"} 1000.0' in text
    assert 'gyre_training_lag_tokens{lag="7+"} 0.0' in text


def test_page_draws_the_training_panel() -> None:
    page = PAGE_PATH.read_text()
    assert 'id="training-panel"' in page and "data.training" in page and "training_latest" in page
