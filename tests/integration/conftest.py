"""Fixtures of the integration tier (real processes, real etcd, loopback gRPC)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.procs import ServiceProcess
from gyre.etcd.server import EtcdServer
from testkit import packer_kit as tk


@pytest.fixture
def packer_proc(
    tmp_path: Path, etcd_server: EtcdServer, cluster_name: str
) -> Iterator[Callable[..., ServiceProcess]]:
    """Starts a packer process on the module's etcd (``start(**packer_settings)``); every one
    started is killed at the end."""
    procs: list[ServiceProcess] = []

    def start(**packer: Any) -> ServiceProcess:
        path = tk.write_config(tmp_path, etcd_server, cluster_name, **packer)
        proc = ServiceProcess("packer", path, log_path=tmp_path / "packer.log").start()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
