"""A private etcd process: temp data dir, loopback, non-default ports.

Used by the local launcher and by integration tests (which restart and stop it to test
resync and lease expiry). Needs the ``etcd`` binary (Debian's etcd-server) on PATH.

With ``tls_dir`` (an identity directory of the ``etcd`` role: tls.crt, tls.key, ca.crt) it
serves clients over mutual TLS only and takes each client certificate's CN as the etcd user
(``--client-cert-auth``); :func:`gyre.etcd.access.provision` then creates the users and
roles and turns auth on. Without it, plaintext (tests that are not about security).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from gyre.lifeline import spawn
from gyre.ports import free_port

UPKEEP_FLAGS = (
    "--auto-compaction-mode=periodic",
    "--auto-compaction-retention=10m",
    "--snapshot-count=10000",
)
"""What keeps a long-running etcd bounded; docker-compose.yml and the Kubernetes manifest pass
the same (tests/unit/test_etcd_upkeep_flags.py).

- Revisions older than 10 minutes are dropped every 10 minutes (kube-apiserver compacts its
  etcd every 5), so the scheduler's archived bursts stop taking space. A watch that falls
  further behind relists (gyre.etcd.watch). With 1h, etcd's periodic compactor runs hourly
  and keeps 1-2 hours of revisions: the 2-hour soak's database grew 34 MB/h to the end.
- etcd holds every Raft entry applied since its last snapshot in memory, and snapshots every
  ``--snapshot-count`` entries: 100,000 by default in etcd 3.4, about 2.5 hours of Gyre's
  writes in the soak (~40,000 an hour), over which its RSS grew ~100 MB an hour. 10,000 (as
  kubeadm configures its etcd) snapshots every ~15 minutes and holds at most that many, plus
  the 5,000 etcd keeps for a slow follower to catch up.
"""


class EtcdServer:
    """Starts, restarts, pauses and stops one etcd member on loopback."""

    def __init__(
        self,
        data_dir: str | None = None,
        client_port: int = 0,
        peer_port: int = 0,
        log_path: str | None = None,
        tls_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.tls_dir = Path(tls_dir) if tls_dir else None
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="gyre-etcd-"))
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self._log_path = log_path or str(self.data_dir / "etcd.log")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client URL: ``https://`` with TLS, ``http://`` without."""
        return f"{'https' if self.tls_dir else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 15.0) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd not on PATH: run `make install` (apt-get install etcd-server)")
        client = self.endpoint
        peer = f"http://127.0.0.1:{self.peer_port}"  # one member on loopback: no peer traffic
        args = [
            binary,
            "--name",
            "gyre",
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"gyre={peer}",
            "--log-level",
            "error",
            "--logger",
            "zap",
            *UPKEEP_FLAGS,
        ]
        if self.tls_dir is not None:
            args += [
                "--cert-file",
                str(self.tls_dir / "tls.crt"),
                "--key-file",
                str(self.tls_dir / "tls.key"),
                "--trusted-ca-file",
                str(self.tls_dir / "ca.crt"),
                "--client-cert-auth",
            ]
        log = open(self._log_path, "ab")
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        self._proc = spawn(args, stdout=log, stderr=log, env=env, start_new_session=True)  # dies with us
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}; see {self._log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"etcd not ready after {timeout_s}s; see {self._log_path}")

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        """Stops and starts on the same ports and data (keys survive, watches break)."""
        self.stop()
        self.start()

    def pause(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
