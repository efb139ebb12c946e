"""A restart by the supervisor (``start()`` with no argument) waits for the ready line as
long as the first start was told to (the launcher gives cells 120 s): it used to wait the
default 60 s, so a vLLM cell restarted on a loaded machine was killed and retried twice."""

from __future__ import annotations

import subprocess
import sys

import pytest

import apps.procs as procs
from apps.procs import ServiceProcess


def test_a_restart_waits_as_long_as_the_first_start(monkeypatch: pytest.MonkeyPatch):
    started: list[subprocess.Popen[str]] = []

    def never_ready(cmd, **kw):  # a process that prints no ready line
        kw.pop("start_new_session", None)
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], **kw)
        started.append(p)
        return p

    monkeypatch.setattr(procs, "spawn", never_ready)
    monkeypatch.setattr(procs, "ensure_process_identity", lambda *a: None)
    proc = ServiceProcess("packer", None, name="p")
    with pytest.raises(RuntimeError, match=r"not ready after 0.3s"):
        proc.start(timeout_s=0.3)
    with pytest.raises(RuntimeError, match=r"not ready after 0.3s"):
        proc.start()  # as the supervisor restarts it
    assert proc.ready_timeout_s == 0.3 and len(started) == 2
    assert all(p.poll() is not None for p in started)  # killed at the deadline


def test_a_process_that_dies_before_ready_reports_its_log_tail(monkeypatch: pytest.MonkeyPatch, tmp_path):
    def dies(cmd, **kw):  # writes a cause to its log (stderr) and exits 1
        kw.pop("start_new_session", None)
        code = "import sys; print('first line', file=sys.stderr); sys.exit('cannot bind 127.0.0.1:1')"
        return subprocess.Popen([sys.executable, "-c", code], **kw)

    monkeypatch.setattr(procs, "spawn", dies)
    monkeypatch.setattr(procs, "ensure_process_identity", lambda *a: None)
    proc = ServiceProcess("router", None, name="router", log_path=tmp_path / "router.log")
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1 before ready.*first line.*cannot bind"):
        proc.start(timeout_s=30)
