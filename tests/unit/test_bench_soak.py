"""The soak benchmark's pieces: which process is which service, the slope per hour after the
warm-up, and the summary it writes (bench/soak.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.soak import (
    bursts_for,
    etcd_defrags,
    floor_points,
    parse_etcd_metrics,
    pooled_slope_per_hour,
    processes,
    rss_slopes,
    service_name,
    slope_per_hour,
    summarize,
)


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
            "rss_anon_mb": {"router": 60.0, "cell-0": 300.0 + 2 * k},
            "fds": {"router": 40},
            "disk_mb": {"packer-wal": 1.0 + k, "logs": 2.0},
            "etcd_db_mb": 0.5,
            "etcd": {
                "revision": 1000.0 + 50 * k,
                "db_in_use_bytes": 2e6,
                "keys": 40.0,
                "go_heap_inuse_bytes": (20.0 + 0.5 * k) * 2**20,
            },
        }
        for k in range(10)
    ]
    samples[3]["etcd"] = {}  # etcd paused by the chaos: that sample has none
    demo = {
        "executions": {"finished": 1200, "lost": 0},
        "policy_versions_published": 71,
        "checker": {"ok": True},
        "outcome": "completed",
        "chaos": {"injected": 14, "survived": 14, "scheduled": 14},
    }
    s = summarize(samples, demo, warmup=0.0)
    assert s["hours"] == pytest.approx(0.15)
    assert s["rss_mb_per_hour"] == {"cell-0": 60.0, "router": 0.0}
    assert s["rss_anon_mb_per_hour"] == {"cell-0": 120.0, "router": 0.0}
    assert s["etcd_go_heap_mb_per_hour"] == pytest.approx(30.0)
    assert s["disk_mb_per_hour"] == pytest.approx(60.0) and s["etcd_db_mb_per_hour"] == 0.0
    assert (s["executions"], s["lost"], s["checker_ok"], s["versions"]) == (1200, 0, True, 71)
    assert s["etcd_revision_per_hour"] == pytest.approx(3000.0)  # 50 a minute
    assert s["etcd_db_in_use_mb_per_hour"] == pytest.approx(0.0)
    assert s["etcd_last"]["revision"] == 1450.0
    assert (s["faults_injected"], s["faults_survived"]) == (14, 14)


def test_etcd_metrics_are_read_from_its_prometheus_text():
    text = """# HELP etcd_debugging_mvcc_current_revision The current revision of store.
# TYPE etcd_debugging_mvcc_current_revision gauge
etcd_debugging_mvcc_current_revision 48213
etcd_debugging_mvcc_compact_revision 41002
etcd_debugging_mvcc_keys_total 57
etcd_mvcc_db_total_size_in_bytes 2.4576e+06
etcd_mvcc_db_total_size_in_use_in_bytes 1.2e+06
etcd_server_quota_backend_bytes 2.147483648e+09
go_memstats_heap_inuse_bytes 1.7694720e+07
go_goroutines 77
etcd_debugging_mvcc_watcher_total 10
"""
    assert parse_etcd_metrics(text) == {
        "revision": 48213.0,
        "compact_revision": 41002.0,
        "keys": 57.0,
        "db_bytes": 2457600.0,
        "db_in_use_bytes": 1200000.0,
        "go_heap_inuse_bytes": 17694720.0,
        "goroutines": 77.0,
        "watchers": 10.0,
    }


def test_minutes_ask_for_bursts_at_the_demos_pace():
    assert bursts_for(120, 15.0) == 1800
    assert bursts_for(1.5, 15.0) == 23
    assert bursts_for(0.01, 15.0) == 1


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


def test_a_restart_neither_hides_nor_fakes_growth():
    # Two lifetimes of one service, each growing 2 MB/hour from its own level: one slope.
    first = [(t * 60.0, 500.0 + 2.0 * t / 60) for t in range(60)]
    second = [(3600.0 + t * 60.0, 300.0 + 2.0 * t / 60) for t in range(60)]
    assert pooled_slope_per_hour([first, second]) == pytest.approx(2.0)
    # Fitted as one series, the restart's drop reads as a steep fall.
    assert slope_per_hour(first + second, 0.0) < -100


def test_rss_slopes_split_by_pid_and_fit_the_floor():
    samples = []
    for i in range(120):
        t = i * 60.0
        pid = 10 if i < 60 else 11  # restarted at one hour
        base = (400.0 if pid == 10 else 380.0) + 1.0 * t / 3600
        swing = 150.0 if i % 3 else 0.0  # a trainer's batch: up 150 MB, back to its floor
        samples.append({"t_s": t, "pids": {"cell-0": pid}, "rss_mb": {"cell-0": base + swing}})
    assert rss_slopes(samples, 0.0, window_s=600)["cell-0"] == pytest.approx(1.0, abs=0.05)
    assert floor_points([(0, 5.0), (10, 1.0), (700, 3.0)], 600) == [(10, 1.0), (700, 3.0)]


def test_defragmentations_are_counted_from_the_launchers_journal(tmp_path: Path):
    assert etcd_defrags(tmp_path) == 0
    (tmp_path / "supervisor.jsonl").write_text(
        '{"name": "etcd", "kind": "defragmented"}\n{"name": "etcd", "kind": "restarted"}\n'
        '{"name": "router", "kind": "defragmented"}\n'
    )
    assert etcd_defrags(tmp_path) == 1


def test_a_restarted_process_settles_before_its_slope_counts():
    # cell-0 runs flat at 400 MB; restarted at 30 min it climbs from 100 to 400 MB in its
    # first 5 minutes (loading its model), then runs flat again.
    samples = []
    for i in range(120):
        t = i * 30.0
        if t < 1800:
            pid, rss = 10, 400.0
        else:
            pid, rss = 11, min(400.0, 100.0 + (t - 1800) * 1.0)
        samples.append({"t_s": t, "pids": {"cell-0": pid}, "rss_mb": {"cell-0": rss}})
    assert rss_slopes(samples, 0.0)["cell-0"] == pytest.approx(0.0, abs=1e-6)
    assert rss_slopes(samples, 0.0, settle_s=0.0)["cell-0"] > 100  # the start read as growth


def test_a_process_first_seen_late_is_no_restart():
    # The cells come up after the other services: their first sample is not the run's.
    samples = [{"t_s": 0.0, "pids": {"router": 1}, "rss_mb": {"router": 100.0}}]
    for i in range(1, 4):
        samples.append(
            {
                "t_s": i * 20.0,
                "pids": {"router": 1, "cell-0": 2},
                "rss_mb": {"router": 100.0, "cell-0": 400.0 + i},
            }
        )
    assert rss_slopes(samples, 0.0)["cell-0"] == pytest.approx(180.0)
