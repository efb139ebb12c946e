"""Shared fixtures: a real etcd process per test module, free ports, the repo root on
sys.path, and a helper to run service processes on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gyre.etcd.server import EtcdServer  # noqa: E402


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A private etcd (temp dir, loopback, free ports) shared by one test module."""
    server = EtcdServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    """A private etcd for one test (for tests that restart, pause or kill it)."""
    server = EtcdServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name unique to the test, so tests sharing an etcd do not collide."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**10)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


os.environ.setdefault("PYTHONPATH", str(ROOT))
