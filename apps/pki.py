"""The launcher's certificates and etcd users: mTLS on by default for a local cluster.

A launch config runs with TLS unless ``cluster.tls.insecure`` is true. Without a ``tls``
section the launcher gives every process the identity directory ``<certs_dir>/{identity}``;
on first start it creates a CA there and issues a certificate for every identity the
config's processes present, plus etcd, its root user, an operator, a dashboard and a
harness (``python -m gyre.certs`` does the same by hand). Later starts reuse them. The
private etcd then serves mutual TLS only, and the launcher creates a user per identity,
limited to its keys (:mod:`gyre.etcd.access`), before it enables auth.

A ``tls.dir`` of the form ``ROOT/{identity}`` whose ROOT holds a CA certificate but not
its key is an external CA: the launcher issues nothing and expects the identity directories
(and ``ROOT/etcd``, ``ROOT/root``) to be there already.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
from pathlib import Path
from typing import Any

from gyre import certs
from gyre.etcd import Etcd
from gyre.etcd.access import provision
from gyre.grpcx.tls import INSECURE_WARNING, TlsFiles
from gyre.identity import Identity, Role

log = logging.getLogger(__name__)
_TLS_ENV = re.compile(r"^GYRE_[A-Z_]+__TLS__")


class LaunchPki:
    """TLS of one launched cluster (``insecure`` when the config opts out)."""

    def __init__(self, config: dict[str, Any], certs_dir: str | os.PathLike[str]) -> None:
        cluster = config.setdefault("cluster", {})
        tls = dict(cluster.get("tls") or {})
        self.insecure = bool(tls.get("insecure"))
        self.changed = False
        if not self.insecure and not tls:
            tls = {"dir": f"{Path(certs_dir).resolve()}/{{identity}}"}
            cluster["tls"] = tls
            self.changed = True
        self.cluster_name = str(cluster.get("name", "gyre"))
        root = certs.identity_root(str(tls.get("dir", "")))
        self.root = root.resolve() if root is not None else None
        self.identities = certs.identities_of_launch(config)
        if self.insecure:
            log.warning(INSECURE_WARNING)

    @property
    def managed(self) -> bool:
        """TLS with identity directories under one root (this launcher's or an external CA's)."""
        return not self.insecure and self.root is not None

    def prepare(self) -> list[certs.IssuedCert]:
        """Creates the CA and the missing certificates (a local CA only)."""
        if not self.managed:
            return []
        assert self.root is not None
        ca = certs.CertificateAuthority(self.root)
        external = ca.cert_path.exists() and not ca.key_path.exists()
        return [] if external else certs.ensure(self.root, self.identities)

    def identity_dir(self, name: str) -> Path:
        if self.root is None:
            raise ValueError("this cluster has no identity directories (tls.insecure, or explicit files)")
        return self.root / name

    def tls(self, name: str) -> TlsFiles:
        """The TLS files of identity ``name`` (insecure when the cluster is)."""
        return TlsFiles(insecure=True) if self.insecure else TlsFiles.from_dir(self.identity_dir(name))

    @property
    def etcd_tls_dir(self) -> Path | None:
        return self.identity_dir("etcd") if self.managed else None

    def provision_etcd(self, endpoint: str) -> None:
        """Users and roles for every identity, then auth on (idempotent across restarts)."""
        if not self.managed:
            return
        users = [i for i in self.identities if i.role not in (Role.ETCD, Role.HARNESS, Role.DASHBOARD)]
        users = [i for i in users if i != Identity(Role.OPERATOR, "root")]

        async def run() -> None:
            async with Etcd([endpoint], timeout_s=10.0, tls=self.tls("root")) as etcd:
                await provision(etcd, self.cluster_name, users)

        # A thread of its own: the launcher may be called from inside an event loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, run()).result()

    def child_env(self) -> dict[str, str | None]:
        """Environment for the cluster's processes: inherited TLS overrides removed (the
        rendered config decides TLS for every process of this cluster)."""
        return {k: None for k in os.environ if _TLS_ENV.match(k)} if self.managed or self.insecure else {}
