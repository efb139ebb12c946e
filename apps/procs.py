"""Runs Gyre services as real processes (``python -m services.<name>``) and waits until
each prints its ready line (``{"ready": name, "target": "host:port"}`` on stdout).

Used by integration and fault tests (SIGKILL, SIGSTOP/SIGCONT) and by the local launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gyre.certs import ensure_process_identity
from gyre.config import read_file
from gyre.lifeline import kill_group, spawn
from gyre.telemetry import LOG_FILE_ENV

ROOT = Path(__file__).resolve().parents[1]
MALLOC_ARENA_MAX = "2"
"""glibc's malloc arenas per service process (its default: 8 per core), unless the
environment sets it: the Dockerfile sets the same for compose and Kubernetes."""


class ServiceProcess:
    """One service process. ``target`` is known once :meth:`start` returns."""

    def __init__(
        self,
        service: str,
        config_path: str | os.PathLike[str] | None,
        overrides: dict[str, Any] | None = None,
        env: dict[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str | None = None,
    ) -> None:
        self.service = service
        self.name = name or service
        self.config_path = str(config_path) if config_path else None
        self.overrides = dict(overrides or {})
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[str] | None = None
        self.target = ""
        self.ready_info: dict[str, Any] = {}
        self._ready = threading.Event()
        self._lines: list[str] = []
        self.ready_timeout_s = 60.0
        """How long a start waits for the ready line: the last one given to :meth:`start`,
        so a restart by the supervisor waits as long as the first start did."""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", f"services.{self.service}"]
        if self.config_path:
            cmd += ["--config", self.config_path]
        for key, value in self.overrides.items():
            cmd += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        return cmd

    def start(self, timeout_s: float | None = None) -> ServiceProcess:
        if timeout_s is not None:
            self.ready_timeout_s = timeout_s
        timeout_s = self.ready_timeout_s
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        # Two malloc arenas, not eight per core: a service's threads (gRPC's, asyncio's,
        # gloo's) each took one, and freed memory fragmented across them (docs/benchmarks/soak.md).
        env.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)
        if self.log_path:  # the service rotates the file its stderr goes to (gyre/telemetry.py)
            env[LOG_FILE_ENV] = str(self.log_path.resolve())
        for key, value in self.env.items():  # None: remove an inherited variable
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        # First start with a local CA (make up, the demo, tests): issue this identity's certificate.
        self._ready.clear()  # a restart (apps.supervise) starts the same object again
        self._lines = []
        self.ready_info = {}
        config = read_file(self.config_path) if self.config_path else {}
        ensure_process_identity(self.service, config, self.overrides, env)
        stderr = open(self.log_path, "a") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # Its own process group (a dead service's leftovers are ended with it, reap_group),
        # and it dies with this process however this one dies (lifeline.spawn).
        self.proc = spawn(
            self.command(),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read_stdout, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} before ready; log: {self.log_path}"
                    + self._log_tail()
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.name} not ready after {timeout_s}s; log: {self.log_path}" + self._log_tail()
                )
        return self

    def _log_tail(self, lines: int = 15) -> str:
        """The end of the log, for the error of a start that failed: the log itself is gone
        with the run folder when a test fails on CI."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "".join(f"\n  | {line}" for line in tail)

    def _read_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line)
            if not self._ready.is_set() and line.startswith("{"):
                try:
                    info = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "ready" in info:
                    self.ready_info = info
                    self.target = info.get("target", "")
                    self._ready.set()

    @property
    def stdout_lines(self) -> list[str]:
        return list(self._lines)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def after_exit(self) -> None:
        """What the supervisor does once the process has exited (apps.supervise.Child)."""
        self.reap_group()

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL: a crash, no clean shutdown (its lease lapses after the TTL). Only the
        service process: what it started must die with it on its own (gyre.lifeline)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def reap_group(self) -> None:
        """SIGKILL to what is left of the service's process group once it has exited (a
        process it started that outlived it)."""
        if self.proc is not None and self.proc.poll() is not None:
            kill_group(self.proc.pid)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM and wait (graceful shutdown); SIGKILL past the timeout."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reap_group()
        return self.proc.returncode

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)
