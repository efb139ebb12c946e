"""Mutual TLS for every gRPC server and client: credentials from one identity directory.

A process's TLS settings (:class:`gyre.config.TlsConfig`) resolve to three files, the
cert-manager layout that ``python -m gyre.certs`` also writes: ``tls.crt`` and ``tls.key``
(who this process is) and ``ca.crt`` (whom it trusts). Servers require a client certificate
signed by that CA; clients present theirs and check the server's. A client checks the
server by the name it means to reach (``expect``: a role such as ``scheduler`` or
``cell-agent``, or an identity name such as ``cell-0``), which every Gyre certificate
carries as a DNS name: that works for pods whose IP address no certificate can know.

Certificates can be rotated in place: a server rereads its files when they change (checked
at each new handshake), and every new client channel reads them afresh.

``insecure: true`` turns all of it off (plaintext, no identities, every RPC admitted): an
explicit opt-out for local debugging, logged as a warning by every process that uses it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path

import grpc

from gyre.certs import CA_FILE, CERT_FILE, KEY_FILE, identity_of_pem
from gyre.config import TlsConfig
from gyre.identity import Identity

log = logging.getLogger(__name__)

INSECURE_WARNING = (
    "tls.insecure is set: gRPC runs in plaintext and admits every caller without an identity "
    "(local debugging only; never on a shared network)"
)


class TlsNotConfigured(ValueError):
    """TLS is on (the default) but no certificate is configured."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """The resolved files of one identity (all three set), or ``insecure``."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    insecure: bool = False

    @classmethod
    def resolve(cls, tls: TlsConfig, identity: str = "") -> TlsFiles:
        """Applies the config: ``dir`` (``{identity}`` replaced by ``identity``) gives the
        default file names, explicit ``*_file`` settings win. Raises
        :class:`TlsNotConfigured` when TLS is on and a file is missing from the config."""
        if tls.insecure:
            return cls(insecure=True)
        base = tls.dir.replace("{identity}", identity) if tls.dir else ""
        if "{identity}" in tls.dir and not identity:
            raise TlsNotConfigured(f"tls.dir {tls.dir!r} names {{identity}} but this process has none")

        def pick(explicit: str, name: str) -> str:
            return explicit or (str(Path(base) / name) if base else "")

        files = cls(pick(tls.cert_file, CERT_FILE), pick(tls.key_file, KEY_FILE), pick(tls.ca_file, CA_FILE))
        if not (files.cert_file and files.key_file and files.ca_file):
            raise TlsNotConfigured(
                "mTLS is on by default and this process has no certificate: set tls.dir to an identity "
                "directory (tls.crt, tls.key, ca.crt; `python -m gyre.certs issue DIR ROLE [NAME]` makes one), "
                "or tls.insecure: true to run without TLS (local debugging only)"
            )
        for path in (files.cert_file, files.key_file, files.ca_file):
            if not os.path.exists(path):
                raise TlsNotConfigured(
                    f"TLS file {path} does not exist (issue it with `python -m gyre.certs`)"
                )
        return files

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> TlsFiles:
        """An identity directory as written by ``python -m gyre.certs`` or cert-manager."""
        return cls.resolve(TlsConfig(dir=str(directory)))

    def identity(self) -> Identity | None:
        """Who this process's certificate names (None when insecure)."""
        if self.insecure:
            return None
        return identity_of_pem(_read(self.cert_file))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: present our certificate, check the server against the CA."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate signed by the CA and reread
        the files when they change (rotation without a restart)."""
        reloader = _Reloader(self)
        return grpc.dynamic_ssl_server_credentials(
            reloader.initial, reloader.fetch, require_client_authentication=True
        )


_process_tls: TlsFiles | None = None


def set_process_tls(files: TlsFiles) -> None:
    """Records this process's own TLS files (the runtime does, at start-up) for clients deep
    inside a service that have no config at hand (weight pulls, the trainer's packer client)."""
    global _process_tls
    _process_tls = files
    if files.insecure:
        log.warning(INSECURE_WARNING)


def process_tls() -> TlsFiles:
    """This process's TLS files; raises :class:`TlsNotConfigured` before the runtime set them."""
    if _process_tls is None:
        raise TlsNotConfigured("this process has no TLS identity yet (gyre.runtime sets it at start-up)")
    return _process_tls


def name_override(expect: str | None) -> list[tuple[str, str]]:
    """Channel options that make the client check the server's certificate for ``expect``
    instead of the host it dials."""
    return [("grpc.ssl_target_name_override", expect)] if expect else []


class _Reloader:
    """Serves the current certificate configuration; notices changed files by mtime."""

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._stamp = self._mtimes()
        self.initial = self._config()

    def _mtimes(self) -> tuple[float, ...]:
        out = []
        for path in (self._files.cert_file, self._files.key_file, self._files.ca_file):
            try:
                out.append(os.stat(path).st_mtime)
            except OSError:
                out.append(0.0)
        return tuple(out)

    def _config(self) -> object:
        f = self._files
        return grpc.ssl_server_certificate_configuration(
            [(_read(f.key_file), _read(f.cert_file))], root_certificates=_read(f.ca_file)
        )

    def fetch(self) -> object | None:
        """Called by gRPC before each handshake: a new configuration, or None for "same"."""
        stamp = self._mtimes()
        with self._lock:
            if stamp == self._stamp:
                return None
            try:
                config = self._config()
            except (OSError, ValueError) as exc:  # half-written rotation: keep the old one
                log.warning("TLS files changed but cannot be read yet: %r", exc)
                return None
            self._stamp = stamp
        log.info("TLS certificate reloaded", extra={"cert_file": self._files.cert_file})
        return config


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
