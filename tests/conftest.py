"""Shared fixtures: a real etcd process per test module, free ports, the repo root on
sys.path, and a helper to run service processes on loopback.

Every service runs with mutual TLS, as it does by default: the session has its own CA
(``testkit/tls.py`` issues identities from it on demand) and every service section's
``tls.dir`` points at it through ``GYRE_<SECTION>__TLS__DIR``. The ``etcd_server`` and
``fresh_etcd`` fixtures stay plaintext for tests that are not about security;
``secure_etcd`` is etcd with TLS, client-certificate users and per-identity roles."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gyre import certs  # noqa: E402
from gyre.etcd.server import EtcdServer  # noqa: E402
from gyre.grpcx.tls import TlsFiles, set_process_tls  # noqa: E402
from gyre.identity import SERVICE_ROLES, service_identity  # noqa: E402

# Fixtures shared across tiers live in the test kit, one module per rig.
pytest_plugins = ["testkit.router_env", "testkit.scheduler_env"]

PKI = Path(tempfile.mkdtemp(prefix="gyre-test-pki-"))
atexit.register(shutil.rmtree, PKI, True)
certs.ensure(PKI, [*certs.BASE_IDENTITIES, *(service_identity(s, "cell-0") for s in SERVICE_ROLES)])
os.environ["GYRE_TEST_PKI"] = str(PKI)
for _section in SERVICE_ROLES:
    os.environ[f"GYRE_{_section.upper()}__TLS__DIR"] = f"{PKI}/{{identity}}"
# Library clients deep inside a service (weight pulls, the trainer's packer client) use the
# process's identity; in the test process that is cell-0.
set_process_tls(TlsFiles.from_dir(PKI / "cell-0"))


def _running(server: EtcdServer) -> Iterator[EtcdServer]:
    """``server`` started, and cleaned up (stopped, its data removed) once the fixture ends."""
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """A private etcd (temp dir, loopback, free ports) shared by one test module."""
    yield from _running(EtcdServer())


@pytest.fixture
def fresh_etcd() -> Iterator[EtcdServer]:
    """A private etcd for one test (for tests that restart, pause or kill it)."""
    yield from _running(EtcdServer())


@pytest.fixture
def secure_etcd() -> Iterator[EtcdServer]:
    """A private etcd with TLS and client-certificate auth (users and roles are provisioned
    per test with ``testkit.tls.provision_etcd``)."""
    yield from _running(EtcdServer(tls_dir=PKI / "etcd"))


@pytest.fixture
def cluster_name(request: pytest.FixtureRequest) -> str:
    """A cluster name unique to the test, so tests sharing an etcd do not collide."""
    return "t" + str(abs(hash(request.node.nodeid)) % 10**10)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


os.environ.setdefault("PYTHONPATH", str(ROOT))
