"""The dashboard against the real scheduler: ``python -m services.scheduler`` on a real etcd,
polled by ``python -m services.dashboard``.

Invariants: the scheduler's GetStatus, as the scheduler really answers it, is accepted by
the dashboard (the leader's status with its fencing epoch lands in /api/timeline and
/metrics); the training diagnostics of a policy record written to etcd reach /api/timeline
and /metrics through GetStatus; when the scheduler dies the dashboard keeps serving and
reports the failure, keeping the last good state.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from apps.procs import ServiceProcess
from gyre.etcd import Keys
from gyre.etcd.server import EtcdServer
from testkit.scheduler_peers import connect

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


async def _wait_for(url: str, pred: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        _, raw = await asyncio.to_thread(_get, url)
        body = json.loads(raw)
        if pred(body):
            return body
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not met in {timeout_s}s; last: {json.dumps(body)[:2000]}")


async def test_dashboard_follows_real_scheduler(
    etcd_server: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    sched = ServiceProcess(
        "scheduler",
        None,
        overrides={
            "cluster_name": cluster_name,
            "etcd_endpoints": [etcd_server.endpoint],
            "port": 0,
            "log_json": False,
            "grace_s": 0.5,
        },
        log_path=tmp_path / "scheduler.log",
    )
    dash = ServiceProcess(
        "dashboard",
        None,
        overrides={"http_port": 0, "poll_interval_s": 0.1, "poll_timeout_s": 1.0, "log_json": False},
        log_path=tmp_path / "dashboard.log",
    )
    try:
        await asyncio.to_thread(sched.start, 90.0)
        dash.overrides["scheduler_target"] = sched.target
        await asyncio.to_thread(dash.start, 60.0)
        base = f"http://{dash.target}"
        body = await _wait_for(base + "/api/timeline", lambda b: b["counters"].get("epoch", 0) > 0)
        epoch = body["counters"]["epoch"]
        assert body["source"]["ok"] >= 1 and body["cells"] == []  # no cell agent registered
        _, metrics = await asyncio.to_thread(_get, base + "/metrics")
        assert f"gyre_status_epoch {float(epoch)}" in metrics.decode()
        assert body["training"] == [] and body["training_latest"] is None

        # The core publishes v1 with its step's loss diagnostics (EtcdPolicyPublisher's record).
        training = {
            "tokens": 96.0,
            "clip_fraction": 0.25,
            "behaviour_weight_mean": 1.0,
            "behaviour_weight_max": 2.5,
            "behaviour_weight_capped_share": 0.0,
            "entropy": 1.5,
            "logprob_gap_lag0": 0.01,
            "lag_hist": [64.0, 32.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            "lag_mean": 0.333,
            "grad_norm": 0.75,
        }
        etcd = await connect(etcd_server.endpoint)
        try:
            record = {"version": 1, "source_target": "", "batch_id": 1, "training": training}
            await etcd.put(Keys(cluster_name).policy(), json.dumps(record).encode())
        finally:
            await etcd.close()
        body = await _wait_for(base + "/api/timeline", lambda b: b["training_latest"] is not None)
        assert body["training_latest"] == {"policy_version": 1, **training}
        assert [(e["version"], e["clip_fraction"]) for e in body["training"]] == [(1, 0.25)]
        _, metrics = await asyncio.to_thread(_get, base + "/metrics")
        assert "gyre_training_clip_fraction 0.25" in metrics.decode()

        sched.kill()  # SIGKILL: the dashboard must notice and keep its last good state
        body = await _wait_for(base + "/api/timeline", lambda b: b["source"]["errors"] >= 3)
        assert body["counters"]["epoch"] == epoch and body["source"]["last_error"]
        status, _ = await asyncio.to_thread(_get, base + "/healthz")
        assert status == 200 and dash.alive()
    finally:
        await asyncio.to_thread(dash.stop)
        await asyncio.to_thread(sched.stop)
