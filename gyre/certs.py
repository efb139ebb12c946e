"""A small certificate authority for one Gyre cluster: ``python -m gyre.certs``.

    python -m gyre.certs init DIR                     # the CA (DIR/ca/ca.crt, DIR/ca/ca.key)
    python -m gyre.certs issue DIR ROLE [NAME] [--san HOST ...] [--days N] [--force]
    python -m gyre.certs ensure DIR --config cluster.yaml   # every identity a launch needs
    python -m gyre.certs ensure DIR --identity scheduler --identity cell-agent/cell-0 ...
    python -m gyre.certs show DIR/NAME                # who a certificate names, until when

Each identity gets a directory in the layout cert-manager writes into a Kubernetes Secret
of type ``kubernetes.io/tls``, so a service reads the same three files whether they came
from this tool or from an external CA::

    DIR/<name>/tls.crt   the identity's certificate (PEM)
    DIR/<name>/tls.key   its private key (PEM, mode 0600)
    DIR/<name>/ca.crt    the CA that signed it, which is also the CA peers are checked against

A certificate names its holder as ``O=gyre, OU=<role>, CN=<name>`` (see
:mod:`gyre.identity`) and is valid for both ends of a connection (serverAuth and
clientAuth). Its DNS names are the identity's name and role (clients check a server by the
role they mean to reach, see :func:`gyre.grpcx.tls.channel_credentials`), ``localhost``,
127.0.0.1 and ::1, plus any ``--san``. Keys are ECDSA P-256: small and fast to handshake.

The ``cryptography`` package does the work; this module only fixes the profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gyre.identity import Identity, Role, check_name

CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
CA_FILE = "ca.crt"
CA_DIR = "ca"
CA_KEY = "ca.key"
RENEW_BEFORE = dt.timedelta(days=30)
"""``ensure`` reissues a certificate that expires sooner than this."""


@dataclasses.dataclass(frozen=True)
class IssuedCert:
    """Where one identity's files are."""

    identity: Identity
    dir: Path

    @property
    def cert_file(self) -> Path:
        return self.dir / CERT_FILE

    @property
    def key_file(self) -> Path:
        return self.dir / KEY_FILE

    @property
    def ca_file(self) -> Path:
        return self.dir / CA_FILE


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Writes atomically (a reader never sees half a key), 0600 for private keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CertificateAuthority:
    """The cluster's CA: a self-signed certificate and its key under ``root/ca/``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.cert_path = self.root / CA_DIR / CA_FILE
        self.key_path = self.root / CA_DIR / CA_KEY

    def exists(self) -> bool:
        return self.cert_path.exists() and self.key_path.exists()

    def create(self, name: str = "gyre", days: int = 3650) -> None:
        """A new CA (refuses to overwrite one: every issued certificate would be orphaned)."""
        if self.exists():
            raise FileExistsError(f"a CA already exists at {self.cert_path}")
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gyre"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA"),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write(self.key_path, _key_pem(key), private=True)
        _write(self.cert_path, cert.public_bytes(serialization.Encoding.PEM))

    def ensure(self) -> None:
        if not self.exists():
            self.create()

    def _load(self) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"{self.key_path}: not an EC key")
        return cert, key

    def issue(self, identity: Identity, sans: Iterable[str] = (), days: int = 365) -> IssuedCert:
        """Issues (or replaces) the certificate of ``identity`` under ``root/<name>/``."""
        ca_cert, ca_key = self._load()
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "gyre"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, identity.role.value),
                x509.NameAttribute(NameOID.COMMON_NAME, identity.name),
            ]
        )
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(_san_entries(identity, sans)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        out = IssuedCert(identity, self.root / identity.name)
        _write(out.key_file, _key_pem(key), private=True)
        _write(out.cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write(out.ca_file, self.cert_path.read_bytes())
        return out

    def needs_issue(self, identity: Identity, sans: Iterable[str] = ()) -> bool:
        """True when ``identity`` has no valid certificate from this CA, covering ``sans``,
        good for at least :data:`RENEW_BEFORE`."""
        out = IssuedCert(identity, self.root / identity.name)
        if not (out.cert_file.exists() and out.key_file.exists() and out.ca_file.exists()):
            return True
        try:
            cert = x509.load_pem_x509_certificate(out.cert_file.read_bytes())
        except ValueError:
            return True
        if out.ca_file.read_bytes() != self.cert_path.read_bytes():
            return True
        if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
            return True
        try:
            held = identity_of(cert)
        except ValueError:
            return True
        if held != identity:
            return True
        present = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
        return not set(_san_entries(identity, sans)) <= present


def _san_entries(identity: Identity, sans: Iterable[str]) -> list[x509.GeneralName]:
    names = [identity.name, identity.role.value, "localhost", "127.0.0.1", "::1", *sans]
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # unique, in order
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def identity_of(cert: x509.Certificate) -> Identity:
    """The identity a certificate names (``OU`` = role, ``CN`` = name)."""
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(ous) != 1 or len(cns) != 1:
        raise ValueError("a Gyre certificate names exactly one OU (the role) and one CN (the name)")
    return Identity(Role.parse(str(ous[0].value)), str(cns[0].value))


def identity_of_pem(pem: bytes) -> Identity:
    return identity_of(x509.load_pem_x509_certificate(pem))


def ensure(
    root: str | os.PathLike[str], identities: Iterable[Identity], sans: Sequence[str] = ()
) -> list[IssuedCert]:
    """Creates the CA if there is none and issues every identity that lacks a valid
    certificate (first start of a local cluster); returns what it issued."""
    ca = CertificateAuthority(root)
    ca.ensure()
    issued = []
    for identity in dict.fromkeys(identities):
        if ca.needs_issue(identity, sans):
            issued.append(ca.issue(identity, sans))
    return issued


# What a cluster needs besides its services: the etcd server, etcd's root user (it sets up
# etcd's users and roles), an operator for tools, a dashboard and a harness.
BASE_IDENTITIES = (
    Identity(Role.ETCD, "etcd"),
    Identity(Role.OPERATOR, "root"),
    Identity(Role.OPERATOR, "operator"),
    Identity(Role.DASHBOARD, "dashboard"),
    Identity(Role.HARNESS, "harness"),
)


def identities_of_launch(config: dict[str, object]) -> list[Identity]:
    """Every identity a launcher config's processes present, plus :data:`BASE_IDENTITIES`."""
    from gyre.identity import service_identity

    launch = config.get("launch") or {}
    assert isinstance(launch, dict)
    out = list(BASE_IDENTITIES)
    for spec in launch.get("processes") or []:
        service = spec["service"]
        cell_id = str(
            (spec.get("set") or {}).get("cell_id") or _section(config, service).get("cell_id") or ""
        )
        out.append(service_identity(service, cell_id))
    return out


def identity_root(tls_dir: str) -> Path | None:
    """The certificates folder of a ``tls.dir`` template ``ROOT/{identity}`` (None when the
    template names no ``{identity}``)."""
    if not tls_dir.endswith("{identity}"):
        return None
    return Path(tls_dir[: -len("{identity}")] or ".")


_MODULE_SECTIONS = {"cell_agent.training.worker": "trainer_cell"}
"""Service modules whose config section is not their name."""


def ensure_process_identity(
    service: str, config: Mapping[str, Any], overrides: Mapping[str, Any], env: Mapping[str, str]
) -> IssuedCert | None:
    """Issues the certificate a service process is about to need, when its ``tls.dir`` is
    ``ROOT/{identity}`` and ROOT holds a local CA with its key (``make up``, the demo, the
    emulator, tests). A cluster whose CA key is elsewhere (an external CA, Kubernetes
    Secrets) is left alone. Reads the settings the way the service will: env over
    ``--set`` overrides over its section over ``cluster``."""
    from gyre.identity import SERVICE_ROLES, service_identity

    service = _MODULE_SECTIONS.get(service, service)
    if service not in SERVICE_ROLES:
        return None
    section = dict(config.get(service) or {})
    cluster = dict(config.get("cluster") or {})
    prefix = f"GYRE_{service.upper()}__"
    tls = {
        **dict(cluster.get("tls") or {}),
        **dict(section.get("tls") or {}),
        **dict(overrides.get("tls") or {}),
    }
    for key in ("dir", "insecure"):
        if prefix + "TLS__" + key.upper() in env:
            tls[key] = env[prefix + "TLS__" + key.upper()]
    if str(tls.get("insecure", "")).lower() in ("1", "true", "yes", "on"):
        return None
    root = identity_root(str(tls.get("dir") or ""))
    if root is None or not CertificateAuthority(root).exists():
        return None
    cell_id = str(
        env.get(prefix + "CELL_ID") or overrides.get("cell_id") or section.get("cell_id") or "cell-0"
    )
    identity = service_identity(service, cell_id)
    ca = CertificateAuthority(root)
    return ca.issue(identity) if ca.needs_issue(identity) else None


def _describe(path: Path) -> str:
    cert = x509.load_pem_x509_certificate((path / CERT_FILE if path.is_dir() else path).read_bytes())
    who = identity_of(cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = ", ".join(str(getattr(n, "value", n)) for n in sans)
    return (
        f"{who.role.value} {who.name}: valid {cert.not_valid_before_utc:%Y-%m-%d} .. "
        f"{cert.not_valid_after_utc:%Y-%m-%d}; names {names}; issuer {cert.issuer.rfc4514_string()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre.certs", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_init = sub.add_parser("init", help="create the CA")
    p_init.add_argument("dir")
    p_init.add_argument("--days", type=int, default=3650)
    p_issue = sub.add_parser("issue", help="issue (or reissue) one identity's certificate")
    p_issue.add_argument("dir")
    p_issue.add_argument("role", choices=[r.value for r in Role])
    p_issue.add_argument("name", nargs="?", help="default: the role (cell agents: their cell id)")
    p_issue.add_argument("--san", action="append", default=[], help="extra DNS name or IP address")
    p_issue.add_argument("--days", type=int, default=365)
    p_issue.add_argument("--force", action="store_true", help="reissue even if a valid one exists")
    p_ensure = sub.add_parser("ensure", help="CA + every identity a launch config (or --identity) needs")
    p_ensure.add_argument("dir")
    p_ensure.add_argument("--config", help="a launch config: its processes' identities and the base ones")
    p_ensure.add_argument("--identity", action="append", default=[], help="ROLE or ROLE/NAME (repeatable)")
    p_ensure.add_argument("--san", action="append", default=[])
    p_show = sub.add_parser("show", help="describe a certificate (file or identity dir)")
    p_show.add_argument("path")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "init":
            CertificateAuthority(args.dir).create(days=args.days)
            print(f"CA created: {Path(args.dir) / CA_DIR / CA_FILE}")
        elif args.cmd == "issue":
            role = Role.parse(args.role)
            identity = Identity(role, check_name(args.name or role.value, role))
            ca = CertificateAuthority(args.dir)
            if not ca.exists():
                parser.error(f"no CA at {args.dir}: run `python -m gyre.certs init {args.dir}` first")
            if args.force or ca.needs_issue(identity, args.san):
                out = ca.issue(identity, args.san, args.days)
                print(f"issued {identity}: {out.dir}")
            else:
                print(
                    f"{identity}: a valid certificate exists in {Path(args.dir) / identity.name} (--force reissues)"
                )
        elif args.cmd == "ensure":
            from gyre.config import read_file

            wanted = identities_of_launch(read_file(args.config)) if args.config else list(BASE_IDENTITIES)
            for text in args.identity:
                role, _, name = text.partition("/")
                r = Role.parse(role)
                wanted.append(Identity(r, name or r.value))
            for out in ensure(args.dir, wanted, args.san):
                print(f"issued {out.identity}: {out.dir}")
        elif args.cmd == "show":
            print(_describe(Path(args.path)))
    except (ValueError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    """A section of a cluster config ({} when absent or not a mapping)."""
    section = config.get(name)
    return section if isinstance(section, dict) else {}
