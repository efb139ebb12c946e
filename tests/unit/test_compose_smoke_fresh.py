"""`make compose-smoke` on a fresh machine makes what is missing instead of failing: the
decisions of deploy/compose_smoke.py (which base image, when to download the wheelhouse,
when to install with apt), with the engine and the commands faked. The real run is `make
compose-smoke` itself (deploy/README.md records one from a machine without podman)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def cs(monkeypatch):
    spec = importlib.util.spec_from_file_location("compose_smoke", ROOT / "deploy" / "compose_smoke.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "compose_smoke", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    calls: list[list[str]] = []
    module.calls = calls
    monkeypatch.setattr(module, "log", lambda msg: calls.append(["log", msg]))
    return module


def _fake_run(
    cs: Any, monkeypatch: pytest.MonkeyPatch, images: set[str], pull_ok: bool, script_ok: bool = True
):
    def run(cmd, **kw):
        cs.calls.append(list(cmd))
        rc = 0
        if cmd[:3] == ["podman", "image", "exists"]:
            rc = 0 if cmd[3] in images else 1
        elif cmd[:2] == ["podman", "pull"]:
            rc = 0 if pull_ok else 125
        elif cmd[0].endswith("base_image.sh"):
            assert kw["env"]["ENGINE"] == "podman"
            rc = 0 if script_ok else 1
            images.add(cmd[1])
        return subprocess.CompletedProcess(cmd, rc, "", "")

    monkeypatch.setattr(cs.subprocess, "run", run)
    monkeypatch.setattr(cs.shutil, "which", lambda name: f"/usr/bin/{name}")


def _engine(cs: Any) -> Any:
    return cs.Engine("podman", {}, [])


def test_a_base_image_the_engine_has_is_used_as_it_is(cs, monkeypatch):
    _fake_run(cs, monkeypatch, {cs.DEFAULT_BASE}, pull_ok=False)
    assert cs.base_image(_engine(cs), cs.DEFAULT_BASE) == cs.DEFAULT_BASE
    assert not any(c[:2] == ["podman", "pull"] for c in cs.calls)


def test_a_base_image_that_pulls_is_used(cs, monkeypatch):
    _fake_run(cs, monkeypatch, set(), pull_ok=True)
    assert cs.base_image(_engine(cs), cs.DEFAULT_BASE) == cs.DEFAULT_BASE
    assert not any(c[0].endswith("base_image.sh") for c in cs.calls)


def test_no_registry_builds_the_debian_base_once_and_says_so(cs, monkeypatch):
    images: set[str] = set()
    _fake_run(cs, monkeypatch, images, pull_ok=False)
    engine = _engine(cs)
    assert cs.base_image(engine, cs.DEFAULT_BASE) == cs.LOCAL_BASE
    said = [c[1] for c in cs.calls if c[0] == "log"]
    assert any("cannot pull" in m and "from Debian's packages" in m for m in said)
    assert sum(c[0].endswith("base_image.sh") for c in cs.calls) == 1
    assert "base_image_s" in engine.timings
    cs.calls.clear()
    assert cs.base_image(engine, cs.DEFAULT_BASE) == cs.LOCAL_BASE  # found, not built again
    assert not any(c[0].endswith("base_image.sh") for c in cs.calls)


def test_a_failed_base_build_is_a_smoke_failure(cs, monkeypatch):
    _fake_run(cs, monkeypatch, set(), pull_ok=False, script_ok=False)
    with pytest.raises(cs.SmokeFailure, match="base_image.sh"):
        cs.base_image(_engine(cs), cs.DEFAULT_BASE)


def test_an_empty_wheelhouse_is_downloaded_with_this_machines_pip(cs, monkeypatch, tmp_path):
    _fake_run(cs, monkeypatch, set(), pull_ok=False)
    monkeypatch.setattr(cs, "ROOT", tmp_path)
    engine = _engine(cs)
    assert cs.wheelhouse(engine, "wh") == "wh"
    (pip,) = [c for c in cs.calls if "download" in c]
    assert pip[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in pip
    assert pip[-2:] == ["-r", "requirements.lock"]
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "x-1-py3-none-any.whl").write_bytes(b"")
    cs.calls.clear()
    assert cs.wheelhouse(engine, "wh") == "wh"
    assert not any("download" in c for c in cs.calls), "a wheelhouse with wheels is used as it is"


def test_apt_installs_as_root_and_names_the_command_otherwise(cs, monkeypatch):
    _fake_run(cs, monkeypatch, set(), pull_ok=False)
    monkeypatch.setattr(cs.os, "geteuid", lambda: 0)
    cs.apt_install("no engine", "podman", "runc")
    assert ["apt-get", "install", "-y", "-qq", "podman", "runc"] in cs.calls
    monkeypatch.setattr(cs.os, "geteuid", lambda: 1000)
    with pytest.raises(cs.SmokeFailure, match="apt-get install -y podman runc"):
        cs.apt_install("no engine", "podman", "runc")
