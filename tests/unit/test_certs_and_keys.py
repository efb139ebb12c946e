"""The CA tool issues certificates that name their holder (OU role, CN name), carry the
names clients check (identity, role, loopback) and live in the cert-manager layout; keys
are private; ``ensure`` reissues only what is missing, foreign or expiring. TLS settings
resolve to those files, refuse to start without them unless ``insecure`` says so. Harness
API keys are stored hashed and verified in constant time."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from gyre import apikeys, certs
from gyre.config import TlsConfig
from gyre.grpcx.tls import TlsFiles, TlsNotConfigured
from gyre.identity import Identity, Role


def test_issue_names_the_holder_in_the_cert_manager_layout(tmp_path):
    ca = certs.CertificateAuthority(tmp_path)
    ca.create()
    out = ca.issue(Identity(Role.CELL_AGENT, "cell-3"), sans=["cell-3.cell.gyre.svc"])
    assert {p.name for p in out.dir.iterdir()} == {"tls.crt", "tls.key", "ca.crt"}
    assert stat.S_IMODE(out.key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(ca.key_path.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(out.cert_file.read_bytes())
    assert certs.identity_of(cert) == Identity(Role.CELL_AGENT, "cell-3")
    names = {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}
    assert {"cell-3", "cell-agent", "localhost", "127.0.0.1", "cell-3.cell.gyre.svc"} <= names
    assert out.ca_file.read_bytes() == ca.cert_path.read_bytes()
    with pytest.raises(FileExistsError):
        ca.create()


def test_ensure_issues_only_what_is_missing_or_foreign(tmp_path):
    who = [Identity(Role.SCHEDULER, "scheduler"), Identity(Role.HARNESS, "harness")]
    assert len(certs.ensure(tmp_path, who)) == 2
    assert certs.ensure(tmp_path, who) == []
    (tmp_path / "harness" / "ca.crt").write_text("not this CA")
    assert [c.identity for c in certs.ensure(tmp_path, who)] == [who[1]]


def test_a_role_name_is_reserved_for_its_role():
    with pytest.raises(ValueError):
        Identity(Role.CELL_AGENT, "scheduler")
    with pytest.raises(ValueError):
        Identity(Role.HARNESS, "bad name")


def test_tls_resolves_identity_dirs_and_refuses_to_start_without_a_certificate(tmp_path):
    certs.ensure(tmp_path, [Identity(Role.ROUTER, "router")])
    files = TlsFiles.resolve(TlsConfig(dir=f"{tmp_path}/{{identity}}"), "router")
    assert files.cert_file == f"{tmp_path}/router/tls.crt" and files.identity() == Identity(
        Role.ROUTER, "router"
    )
    with pytest.raises(TlsNotConfigured, match="insecure"):
        TlsFiles.resolve(TlsConfig(), "router")
    with pytest.raises(TlsNotConfigured, match="does not exist"):
        TlsFiles.resolve(TlsConfig(dir=f"{tmp_path}/{{identity}}"), "packer")
    assert TlsFiles.resolve(TlsConfig(insecure=True), "router").insecure


def test_process_identities_are_issued_only_from_a_local_ca(tmp_path):
    config = {"cluster": {"tls": {"dir": f"{tmp_path}/{{identity}}"}}, "cell_agent": {"cell_id": "c7"}}
    assert certs.ensure_process_identity("cell_agent", config, {}, {}) is None  # no CA here: leave it
    certs.CertificateAuthority(tmp_path).create()
    out = certs.ensure_process_identity("cell_agent", config, {"cell_id": "c9"}, {})
    assert out is not None and out.identity == Identity(Role.CELL_AGENT, "c9")
    insecure = {"GYRE_CELL_AGENT__TLS__INSECURE": "true"}
    assert certs.ensure_process_identity("cell_agent", config, {"cell_id": "c8"}, insecure) is None


def test_api_keys_are_stored_hashed(tmp_path):
    path = tmp_path / "keys"
    assert apikeys.main(["add", str(path), "alice", "--key-out", str(tmp_path / "alice.key")]) == 0
    key = (tmp_path / "alice.key").read_text().strip()
    assert key not in path.read_text()
    keys = apikeys.KeyFile.load(path)
    assert keys.verify(key) == "alice"
    assert keys.verify(key + "x") is None
    path.write_text("alice not-a-hash\n")
    with pytest.raises(ValueError):
        apikeys.KeyFile.load(path)
