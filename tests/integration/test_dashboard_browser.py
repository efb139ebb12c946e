"""The live dashboard, end to end: a real ``python -m services.dashboard`` process polls a
scripted SchedulerControl gRPC server and headless Chromium renders its page.

Invariants: the page is self-contained and actually draws (a screenshot with many distinct
colours, not a blank page); the DOM names every cell of the scheduler's status and its
current policy version; ``/api/timeline`` records the role changes the scheduler went
through (bands per cell) and ``/healthz`` answers; a dashboard whose scheduler is down still
serves its page and reports the failure instead of hanging or crashing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from apps.procs import ServiceProcess
from gyre.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from testkit.browser import CHROMIUM, chromium_page
from testkit.tls import add_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 120  # three bursts of 40 scripted steps, then the last status is held

pytestmark = pytest.mark.timeout(180)

EVENTS = [
    ("burst_started", "burst 1: 32 executions at policy v0"),
    ("cell_to_training", "moved cell-0 to training: capacity 24 >= W 20, supply 0.5 >= 0.5 for 2.0 s"),
    ("reroute", "moved b1-t3-0 from cell-0 to cell-9 (route epoch 2)"),
]

CELLS = [  # (cell_id, kind, index, slots)
    ("cell-0", common_pb2.CELL_KIND_ELASTIC, 0, 8),
    ("cell-1", common_pb2.CELL_KIND_ELASTIC, 1, 8),
    ("cell-2", common_pb2.CELL_KIND_ELASTIC, 2, 8),
    ("cell-9", common_pb2.CELL_KIND_STANDALONE, -1, 8),
]


def _state(cell_index: int, k: int) -> int:
    """Role of elastic cell ``cell_index`` at step ``k`` of a 40-step burst."""
    s = common_pb2
    start = 10 + 4 * cell_index  # the core drains first, then satellites by index
    end = 28 if cell_index else 32  # satellites return at burst end; the core publishes first
    if k < start or k >= end + 2:
        return s.CELL_STATE_ROLLOUT
    if k < start + 2:
        return s.CELL_STATE_DRAINING
    if k < end:
        return s.CELL_STATE_TRAINING
    return s.CELL_STATE_RETURNING


def scripted_status(step: int) -> scheduler_pb2.SchedulerStatus:
    """The scheduler's status at ``step``: three bursts with cells moving to training and back."""
    step = min(step, STEPS - 1)
    burst, k = divmod(step, 40)
    status = scheduler_pb2.SchedulerStatus(epoch=7, batch_size=4)
    capacity = 0
    for cell_id, kind, index, slots in CELLS:
        state = common_pb2.CELL_STATE_ROLLOUT if index < 0 else _state(index, k)
        if state == common_pb2.CELL_STATE_ROLLOUT:
            capacity += slots
        status.cells.add(
            cell_id=cell_id,
            kind=kind,
            index=index,
            state=state,
            slots=slots,
            routed=min(slots, 4) if state == common_pb2.CELL_STATE_ROLLOUT else 0,
            target=f"127.0.0.1:{50060 + len(status.cells)}",
            policy_version=burst + (k >= 30),
        )
    dispatched = 32
    finished = min(dispatched, int(k * 0.9))
    status.ledger.CopyFrom(
        scheduler_pb2.Ledger(
            burst_id=burst + 1,
            dispatched=dispatched,
            launched=min(dispatched, finished + capacity),
            finished=finished,
            waterlevel=dispatched - finished,
            queued=max(0, dispatched - finished - capacity),
            running=min(capacity, dispatched - finished),
        )
    )
    status.capacity = capacity
    status.ready_groups = min(4, k // 6)
    status.policy_version = burst + (k >= 30)
    status.reroutes = burst * 12 + sum(2 for i in range(3) if k >= 10 + 4 * i)
    status.bursts_completed = burst
    status.transitions_to_training = burst * 3 + sum(1 for i in range(3) if k >= 12 + 4 * i)
    status.transitions_to_rollout = burst * 3 + (2 if k >= 30 else 0) + (1 if k >= 34 else 0)
    fields = scheduler_pb2.SchedulerStatus.DESCRIPTOR.fields_by_name
    if "leader" in fields:  # newer protos say whether the answering scheduler leads
        status.leader = True
    if "total" in fields:
        status.total.CopyFrom(
            scheduler_pb2.Ledger(dispatched=32 * (burst + 1), finished=32 * burst + finished)
        )
    if "policy" in fields:
        status.policy = "waterlevel"
    if "training" in fields and status.policy_version > 0:  # the newest version's loss diagnostics
        v = status.policy_version
        status.training.CopyFrom(
            scheduler_pb2.TrainingDiagnostics(
                policy_version=v,
                tokens=1024.0,
                clip_fraction=0.05 * v,
                behaviour_weight_mean=1.0 - 0.01 * v,
                behaviour_weight_max=2.0 + v,
                behaviour_weight_capped_share=0.002 * v,
                entropy=2.0 - 0.2 * v,
                logprob_gap_lag0=0.01,
                lag_hist=[800.0, 200.0, 24.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                lag_mean=0.24,
                grad_norm=0.5 + 0.1 * v,
            )
        )
    return status


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerControlServicer):
    """A fake SchedulerControl: each GetStatus call advances the script by one step."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetStatus(self, request: Any, context: Any) -> scheduler_pb2.SchedulerStatus:
        status = scripted_status(self.calls)
        self.calls += 1
        return status

    async def WatchEvents(self, request: Any, context: Any) -> Any:
        for seq, (kind, message) in enumerate(EVENTS, start=1):
            if seq > request.after_seq:
                yield scheduler_pb2.SchedulerEvent(
                    seq=seq, time_s=1_700_000_000.0 + seq, kind=kind, message=message
                )
        await asyncio.sleep(3600)  # the stream stays open, as the scheduler's does


async def _start_fake() -> tuple[grpc.aio.Server, ScriptedScheduler, int]:
    server = grpc.aio.server()
    fake = ScriptedScheduler()
    scheduler_pb2_grpc.add_SchedulerControlServicer_to_server(fake, server)
    port = add_port(server, "127.0.0.1:0", "scheduler")  # the dashboard checks it dials the scheduler
    await server.start()
    return server, fake, port


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _distinct_colours(png: Path) -> int:
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(str(png))
    assert img.ndim == 3 and img.shape[0] >= 700 and img.shape[1] >= 1200, img.shape
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    return len(np.unique(rgb, axis=0))


@pytest.fixture
def tmp_out() -> Any:
    d = Path(tempfile.mkdtemp(prefix="gyre-dash-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium missing: scripts/install_browser.sh")
async def test_dashboard_renders_scripted_scheduler_in_chromium(tmp_out: Path) -> None:
    server, fake, port = await _start_fake()
    dash = ServiceProcess(
        "dashboard",
        None,
        overrides={"poll_interval_s": 0.05, "log_json": False},
        log_path=tmp_out / "dashboard.log",
    )
    dash.command = lambda: [  # type: ignore[method-assign]  # exercise the documented CLI flags
        *ServiceProcess.command(dash),
        "--scheduler",
        f"127.0.0.1:{port}",
        "--port",
        "0",
    ]
    try:
        await asyncio.to_thread(dash.start, 60.0)
        url = f"http://{dash.target}/"
        deadline = time.monotonic() + 120  # generous: the machine may be busy
        while fake.calls <= STEPS and time.monotonic() < deadline:  # the whole script polled
            await asyncio.sleep(0.05)
        assert fake.calls > STEPS, f"dashboard polled only {fake.calls} times"

        timeline = await asyncio.to_thread(_get_json, url + "api/timeline")
        assert [c["cell_id"] for c in timeline["cells"]] == ["cell-0", "cell-1", "cell-2", "cell-9"]
        assert [c["role"] for c in timeline["cells"]] == ["core", "satellite 1", "satellite 2", "standalone"]
        core_states = [b[2] for b in timeline["bands"]["cell-0"]]
        assert core_states[:4] == ["ROLLOUT", "DRAINING", "TRAINING", "RETURNING"]
        assert core_states.count("TRAINING") == 3
        assert {b[2] for b in timeline["bands"]["cell-9"]} == {"ROLLOUT"}
        assert timeline["counters"]["policy_version"] == 3
        assert [e["version"] for e in timeline["training"]] == [1, 2, 3]
        assert timeline["training_latest"]["clip_fraction"] == pytest.approx(0.15)
        assert [m[1] for m in timeline["policy_marks"]] == [0, 1, 2, 3]
        assert max(timeline["series"]["waterlevel"]) == 32 and min(timeline["series"]["capacity"]) == 8
        health = await asyncio.to_thread(_get_json, url + "healthz")
        assert health["ok"] is True and health["polls_ok"] > STEPS

        png, dom = await chromium_page(url, tmp_out)
        assert png.exists() and png.stat().st_size > 10_000
        assert _distinct_colours(png) > 200, "screenshot looks blank"
        for cell_id in ("cell-0", "cell-1", "cell-2", "cell-9"):
            assert f'data-cell-id="{cell_id}"' in dom, f"{cell_id} missing from the DOM"
        assert "policy v3" in dom
        assert 'id="training-clip_fraction"' in dom and "newest v3" in dom
        assert 'data-kind="cell_to_training"' in dom and "capacity 24 &gt;= W 20" in dom
        assert timeline["source"]["events"] == 3 and timeline["events"][0]["kind"] == "reroute"
        conn = re.search(r'<span id="conn"[^>]*>([^<]*)</span>', dom)
        assert conn is not None and conn.group(1).startswith("live"), conn
        assert "<canvas" in dom
        assert "http://" not in dom.replace(url, "").split("<script>")[0], "page references an external URL"
        if os.environ.get("GYRE_DASHBOARD_SCREENSHOT"):
            shutil.copy(png, os.environ["GYRE_DASHBOARD_SCREENSHOT"])
    finally:
        await asyncio.to_thread(dash.stop)
        await server.stop(0)


async def test_dashboard_survives_unreachable_scheduler(tmp_out: Path) -> None:
    server, _fake, port = await _start_fake()
    await server.stop(0)  # nothing listens on `port` now
    dash = ServiceProcess(
        "dashboard",
        None,
        overrides={
            "scheduler_target": f"127.0.0.1:{port}",
            "http_port": 0,
            "poll_interval_s": 0.1,
            "poll_timeout_s": 0.5,
            "log_json": False,
        },
        log_path=tmp_out / "dashboard.log",
    )
    try:
        await asyncio.to_thread(dash.start, 60.0)
        url = f"http://{dash.target}/"
        health: dict[str, Any] = {}
        for _ in range(100):
            health = await asyncio.to_thread(_get_json, url + "healthz")
            if health["poll_errors"] >= 3:
                break
            await asyncio.sleep(0.1)
        assert health["poll_errors"] >= 3 and health["polls_ok"] == 0
        assert health["last_error"]
        timeline = await asyncio.to_thread(_get_json, url + "api/timeline")
        assert timeline["cells"] == [] and timeline["counters"] == {}
        with urllib.request.urlopen(url, timeout=5) as resp:
            page = resp.read().decode()
        assert resp.status == 200 and "<canvas" in page and "/api/timeline" in page
        assert dash.alive()
    finally:
        assert await asyncio.to_thread(dash.stop) == 0
