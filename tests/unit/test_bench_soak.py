"""The soak benchmark's pieces: which process is which service, the slope per hour after the
warm-up, and the summary it writes (bench/soak.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.soak import processes, service_name, slope_per_hour, summarize


def test_service_names_from_command_lines():
    py = "/x/.venv/bin/python"
    assert service_name([py, "-m", "services.router", "--config", "/r/cluster.yaml"]) == "router"
    assert (
        service_name([py, "-m", "services.cell_agent", "--config", "c", "--set", "cell_id=cell-2"])
        == "cell-2"
    )
    assert service_name(["/usr/bin/etcd", "--data-dir", "/r/etcd/data"]) == "etcd"
    assert service_name([py, "-m", "apps.demo", "--run-dir", "/r"]) is None
    assert service_name([py, "bench/soak.py"]) is None


def test_slope_is_per_hour_after_the_warmup():
    # 10 MB/min after a warm-up jump: 600 MB/hour, the jump dropped with the warm-up.
    pts = [(0.0, 100.0), (60.0, 500.0)] + [(60.0 * k, 500.0 + 10.0 * (k - 1)) for k in range(2, 10)]
    assert slope_per_hour(pts, warmup=0.2) == pytest.approx(600.0)
    assert slope_per_hour(pts[:2], warmup=0.0) is None  # too few points


def test_summary_holds_what_the_issue_asks_for():
    samples = [
        {
            "t_s": 60.0 * k,
            "rss_mb": {"router": 100.0, "cell-0": 500.0 + k},
            "fds": {"router": 40},
            "disk_mb": {"packer-wal": 1.0 + k, "logs": 2.0},
            "etcd_db_mb": 0.5,
        }
        for k in range(10)
    ]
    demo = {
        "executions": {"finished": 1200, "lost": 0},
        "policy_versions_published": 71,
        "checker": {"ok": True},
        "outcome": "completed",
    }
    s = summarize(samples, demo, warmup=0.0)
    assert s["hours"] == pytest.approx(0.15)
    assert s["rss_mb_per_hour"] == {"cell-0": 60.0, "router": 0.0}
    assert s["disk_mb_per_hour"] == pytest.approx(60.0) and s["etcd_db_mb_per_hour"] == 0.0
    assert (s["executions"], s["lost"], s["checker_ok"], s["versions"]) == (1200, 0, True, 71)


def test_processes_are_found_by_the_run_folder_in_their_command_line(tmp_path: Path):
    assert processes(tmp_path) == {}
    config = str(tmp_path / "cluster.yaml")
    child = subprocess.Popen(["sh", "-c", "sleep 30; true", "-m", "services.router", "--config", config])
    try:
        for _ in range(100):
            if processes(tmp_path):
                break
            time.sleep(0.02)
        assert processes(tmp_path) == {"router": child.pid}
    finally:
        child.kill()
        child.wait()
