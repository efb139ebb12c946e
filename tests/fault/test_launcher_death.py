"""The launcher takes everything it started with it (issue 17): SIGKILL ``python -m
apps.launch`` (etcd, the packer and a mock cell agent up) and nothing it started is alive
5 s later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.support.processes import kill_leftovers, survivors, tree

pytestmark = pytest.mark.timeout(180)

CONFIG = {
    "cluster": {"name": "death", "etcd_endpoints": ["127.0.0.1:23790"], "lease_ttl_s": 5,
                "tls": {"dir": "{certs_dir}/{identity}"}},
    "packer": {"port": 50053, "wal_dir": "{run_dir}/packer-wal"},
    "cell_agent": {"engine": "mock"},
    "launch": {"etcd": {}, "processes": [
        {"service": "packer"},
        {"service": "cell_agent", "name": "cell-0",
         "set": {"cell_id": "cell-0", "kind": "standalone", "index": -1, "port": 50060}},
    ]},
}


def test_sigkilled_launcher_leaves_nothing_running(tmp_path, repo_root):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    out = tmp_path / "launch.out"
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    for key in [k for k in env if k.endswith("__TLS__DIR")]:  # the launcher makes its own identities
        env.pop(key)
    with open(out, "w") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "apps.launch", "--config", str(path), "--free-ports", "--run-dir", str(tmp_path / "run")],
            cwd=repo_root, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )
    started = []
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops everything" not in out.read_text():
            assert launcher.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
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
