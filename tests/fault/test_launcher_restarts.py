"""The launcher supervises what it started (issue 13, part 1): a SIGKILLed cell agent is
restarted with back-off and rejoins under its cell id (registered again, in ROLLOUT, at the
same target); SIGKILLed etcd is restarted on its data and the cell is still there; every
exit and restart is an event in ``supervisor.jsonl``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from apps.launch import Cluster
from gyre.etcd import Etcd, Keys
from gyre.ports import free_port

pytestmark = pytest.mark.timeout(240)

CONFIG = {
    "cluster": {
        "name": "sup",
        "etcd_endpoints": ["127.0.0.1:23790"],
        "lease_ttl_s": 3,
        "tls": {"dir": "{certs_dir}/{identity}"},
    },
    "packer": {"port": 50053, "wal_dir": "{run_dir}/packer-wal"},
    "cell_agent": {"engine": "mock", "mock": {"time_scale": 0.0}},
    "launch": {
        "etcd": {},
        "restart": {"backoff_initial_s": 0.2, "backoff_max_s": 1.0},
        "processes": [
            {"service": "packer"},
            {
                "service": "cell_agent",
                "name": "cell-0",
                "set": {"cell_id": "cell-0", "kind": "standalone", "index": -1, "port": 50060},
            },
        ],
    },
}


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


async def cell_record(cluster: Cluster) -> tuple[dict, str]:
    keys = Keys("sup")
    async with Etcd([cluster.etcd.endpoint], timeout_s=3.0, tls=cluster.pki.tls("root")) as etcd:
        reg = await etcd.get(keys.cell("cell-0"))
        state = await etcd.get(keys.cell_state("cell-0"))
    return (json.loads(reg.value) if reg else {}), (state.value.decode() if state else "")


async def test_killed_cell_agent_and_etcd_come_back(tmp_path, monkeypatch):
    for key in [k for k in os.environ if k.endswith("__TLS__DIR")]:  # the launcher makes its own identities
        monkeypatch.delenv(key)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    cluster = await asyncio.to_thread(Cluster(path, tmp_path / "run", free_ports=True).start)
    try:
        cell = cluster.procs["cell-0"]
        before, target = cell.pid, cell.target
        os.kill(before, signal.SIGKILL)
        await asyncio.to_thread(
            wait_for, lambda: cluster.restarts().get("cell-0") == 1, 60, "cell-0 not restarted"
        )
        assert cell.alive() and cell.pid != before and cell.target == target
        reg, state = await cell_record(cluster)
        assert reg["target"] == target and "ROLLOUT" in state, (reg, state)

        os.kill(cluster.etcd.pid, signal.SIGKILL)
        await asyncio.to_thread(
            wait_for, lambda: cluster.restarts().get("etcd") == 1, 60, "etcd not restarted"
        )
        reg, _ = await cell_record(cluster)
        assert reg["target"] == target  # the data survived the restart

        journal = [json.loads(x) for x in (tmp_path / "run" / "supervisor.jsonl").read_text().splitlines()]
        assert [(e["name"], e["kind"]) for e in journal][:3] == [
            ("cell-0", "exited"),
            ("cell-0", "restarting"),
            ("cell-0", "restarted"),
        ]
        assert journal[0]["rc"] == -signal.SIGKILL and cluster.dead() == []
    finally:
        await asyncio.to_thread(cluster.stop)


def test_a_first_start_that_fails_is_tried_again(tmp_path, monkeypatch):
    """The packer's port is taken when the launcher first starts it (what a port chosen
    free and then taken by another socket does): its start fails, is journaled as
    ``start_failed`` and tried again after the back-off; once the port is free the launch
    completes. Before, the first failure ended the launch."""
    for key in [k for k in os.environ if k.endswith("__TLS__DIR")]:
        monkeypatch.delenv(key)
    port = free_port()
    config = json.loads(json.dumps(CONFIG))
    config["cluster"]["etcd_endpoints"] = [f"127.0.0.1:{free_port()}"]
    config["packer"]["port"] = port
    config["launch"]["restart"] = {"backoff_initial_s": 2.0, "backoff_max_s": 2.0, "jitter": 0.0}
    config["launch"]["processes"] = config["launch"]["processes"][:1]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    journal = tmp_path / "run" / "supervisor.jsonl"
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()

    def start_failed() -> bool:
        return journal.exists() and '"start_failed"' in journal.read_text()

    cluster = Cluster(path, tmp_path / "run")
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(cluster.start)
            wait_for(start_failed, 120, "no start_failed event")
            holder.close()  # free before the retry (2 s back-off)
            started.result(timeout=120)
        assert cluster.procs["packer"].alive() and cluster.procs["packer"].target.endswith(f":{port}")
        (event,) = [json.loads(line) for line in journal.read_text().splitlines() if "start_failed" in line]
        assert event["name"] == "packer" and event["attempt"] == 1, event
        assert "exited with 1 before ready" in event["error"], event
    finally:
        holder.close()
        cluster.stop()
