"""Service logs rotate (gyre/telemetry.py): a service the launcher started with its stderr
in ``<run-dir>/logs/<name>.log`` ($GYRE_LOG_FILE) rotates that file with the stdlib's
RotatingFileHandler at ``log_max_bytes``, keeping ``log_keep`` rotated files, and its
stderr (fd 2: tracebacks, warnings) follows to the new file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from apps.procs import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import logging, os, sys
from gyre.telemetry import setup_logging
setup_logging("svc", "INFO", True, max_bytes=4000, keep=2)
log = logging.getLogger("svc")
for n in range(300):
    log.info("line %d %s", n, "x" * 20)
print("print to stderr", file=sys.stderr, flush=True)
os.write(2, b"raw fd 2\\n")
"""


def _run(log: Path, env_file: str | None) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GYRE_LOG_FILE", None)
    if env_file is not None:
        env["GYRE_LOG_FILE"] = env_file
    with log.open("a") as stderr:  # as the launcher does: the child's stderr is the file
        subprocess.run([sys.executable, "-c", CHILD], env=env, stderr=stderr, check=True, timeout=60)


def test_a_service_log_rotates_and_keeps_its_retention(tmp_path: Path):
    log = tmp_path / "router.log"
    _run(log, str(log))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["router.log", "router.log.1", "router.log.2"]  # log_keep = 2
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 4000
    current = log.read_text()
    assert '"line 299' in current  # the newest lines in the file itself
    assert current.endswith("print to stderr\nraw fd 2\n")  # stderr followed the rotation
    assert '"line 0 ' not in log.with_name("router.log.2").read_text()  # the oldest deleted


def test_without_the_launchers_file_it_logs_to_stderr_unrotated(tmp_path: Path):
    log = tmp_path / "router.log"
    _run(log, None)
    assert [p.name for p in tmp_path.iterdir()] == ["router.log"]
    assert log.read_text().count('"line ') == 300


def test_the_launcher_names_the_log_file_to_its_service(tmp_path: Path, monkeypatch):
    seen: dict[str, str] = {}

    def spawn(cmd, **kw):
        seen.update(kw["env"])
        raise RuntimeError("not started")

    monkeypatch.setattr("apps.procs.spawn", spawn)
    proc = ServiceProcess("packer", None, log_path=tmp_path / "packer.log")
    try:
        proc.start(timeout_s=1)
    except RuntimeError:
        pass
    assert seen["GYRE_LOG_FILE"] == str((tmp_path / "packer.log").resolve())


def test_log_retention_is_configured_like_any_setting(tmp_path: Path, monkeypatch):
    from gyre.config import load
    from services.router.config import RouterConfig

    config = tmp_path / "cluster.yaml"
    config.write_text("cluster: {log_max_bytes: 1048576}\nrouter: {log_keep: 5}\n")
    cfg = load(RouterConfig, config)
    assert (cfg.log_max_bytes, cfg.log_keep) == (1048576, 5)
    monkeypatch.setenv("GYRE_ROUTER__LOG_MAX_BYTES", "0")
    assert load(RouterConfig, config).log_max_bytes == 0
