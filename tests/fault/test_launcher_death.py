"""The launcher takes everything it started with it (issue 17): SIGKILL ``python -m
apps.launch`` (etcd, the packer and a mock cell agent up) and nothing it started is alive
5 s later. Restarted on the same run folder (what deploy/systemd/gyre-launch.service does),
it brings the same cluster back: etcd's data survived, the cell registers again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gyre.etcd import Etcd, Keys
from gyre.grpcx.tls import TlsFiles
from gyre.ports import free_port
from testkit.processes import kill_leftovers, survivors, tree

pytestmark = pytest.mark.timeout(180)

CONFIG = {
    "cluster": {
        "name": "death",
        "etcd_endpoints": ["127.0.0.1:23790"],
        "lease_ttl_s": 5,
        "tls": {"dir": "{certs_dir}/{identity}"},
    },
    "packer": {"port": 50053, "wal_dir": "{run_dir}/packer-wal"},
    "cell_agent": {"engine": "mock"},
    "launch": {
        "etcd": {},
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


def launch(tmp_path, repo_root, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``python -m apps.launch`` on ``tmp_path/cluster.yaml`` and ``tmp_path/run``, up."""
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    for key in [k for k in env if k.endswith("__TLS__DIR")]:  # the launcher makes its own identities
        env.pop(key)
    with open(out, "w") as sink:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "apps.launch",
                "--config",
                str(tmp_path / "cluster.yaml"),
                *extra,
                "--run-dir",
                str(tmp_path / "run"),
                "--certs-dir",
                str(tmp_path / "certs"),
            ],
            cwd=repo_root,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while "Ctrl-C stops everything" not in out.read_text():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError(out.read_text()[-3000:])
        time.sleep(0.2)
    return launcher


def test_sigkilled_launcher_leaves_nothing_running(tmp_path, repo_root):
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(CONFIG))
    launcher = launch(tmp_path, repo_root, tmp_path / "launch.out", "--free-ports")
    started = []
    try:
        started = tree(launcher.pid)[1:]
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "etcd" in names and "services.packer" in names and "services.cell_agent" in names, names
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        left = survivors(started, within_s=5.0)
        assert not left, f"alive 5 s after the launcher was SIGKILLed: {left}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        kill_leftovers(started)


async def test_relaunched_on_the_same_run_folder_the_cluster_comes_back(tmp_path, repo_root):
    config = yaml.safe_load(yaml.safe_dump(CONFIG))
    port = free_port()
    config["cluster"]["etcd_endpoints"] = [f"127.0.0.1:{port}"]
    config["packer"]["port"] = free_port()
    config["launch"]["processes"][1]["set"]["port"] = free_port()
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    first = launch(tmp_path, repo_root, tmp_path / "first.out")
    started = tree(first.pid)[1:]
    tls = TlsFiles.from_dir(tmp_path / "certs" / "root")
    async with Etcd([f"https://127.0.0.1:{port}"], timeout_s=3.0, tls=tls) as etcd:
        await etcd.put(b"/gyre/death/marker", b"kept")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert not survivors(started, within_s=5.0)
    second = launch(tmp_path, repo_root, tmp_path / "second.out")
    try:
        async with Etcd([f"https://127.0.0.1:{port}"], timeout_s=3.0, tls=tls) as etcd:
            assert (await etcd.get(b"/gyre/death/marker")).value == b"kept"
            assert await etcd.get(Keys("death").cell("cell-0")) is not None
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(60)
        kill_leftovers(started)
