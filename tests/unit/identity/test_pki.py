"""The operator's PKI files: create_root, create_issuer and inspect."""

from __future__ import annotations

import stat
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import PKIError
from agent.identity import ca, certs, files
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.names import Identity
from agent.identity.pki import create_issuer, create_root, inspect

WEB = Identity(sa="web", ns="shop")


def _mode(path) -> int:
    return stat.S_IMODE(Path(path).stat().st_mode)


@pytest.fixture
def issuer(pki, now):
    return ca.load_issuer(pki / "issuer", now=now)


# --- create_root / create_issuer ---------------------------------------------------


def test_create_root_writes_a_ten_year_p256_anchor_with_private_key(tmp_path, now):
    created = create_root(tmp_path, now=now)
    cert = files.read_certs(tmp_path / "ca.crt")[0]
    assert cert == created.cert
    assert _mode(tmp_path / "ca.key") == 0o600
    assert cert.subject.rfc4514_string() == "CN=root.linkerd.cluster.local"
    assert cert.issuer == cert.subject
    assert ca.is_ca(cert)
    assert ca.path_length(cert) == 1
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert certs.key_type(cert.public_key()) == "ECDSA P-256"
    assert cert.not_valid_after_utc - now == timedelta(hours=87600) - timedelta(
        microseconds=now.microsecond
    )
    cert.verify_directly_issued_by(cert)
    assert files.read_key(tmp_path / "ca.key").public_key() == cert.public_key()


def test_create_root_uses_the_trust_domain_in_its_name(tmp_path):
    cert = create_root(tmp_path, trust_domain="example.org").cert
    assert cert.subject.rfc4514_string() == "CN=root.linkerd.example.org"


def test_create_root_refuses_to_overwrite_unless_forced(tmp_path):
    first = create_root(tmp_path).cert
    with pytest.raises(PKIError, match=r"already exists.*--force"):
        create_root(tmp_path)
    assert files.read_certs(tmp_path / "ca.crt")[0] == first
    second = create_root(tmp_path, force=True).cert
    assert second != first
    assert _mode(tmp_path / "ca.key") == 0o600


def test_create_issuer_is_a_one_year_pathlen0_ca_under_the_root(pki, now):
    d = pki / "issuer"
    cert = files.read_certs(d / "issuer.crt")[0]
    root = files.read_certs(pki / "root" / "ca.crt")[0]
    assert cert.subject.rfc4514_string() == "CN=identity.linkerd.cluster.local"
    assert ca.is_ca(cert)
    assert ca.path_length(cert) == 0
    assert cert.not_valid_after_utc - now == timedelta(hours=8760) - timedelta(
        microseconds=now.microsecond
    )
    cert.verify_directly_issued_by(root)
    assert (d / "ca.crt").read_bytes() == (pki / "root" / "ca.crt").read_bytes()
    assert _mode(d / "issuer.key") == 0o600
    assert files.read_key(d / "issuer.key").public_key() == cert.public_key()


def test_create_issuer_takes_names_from_the_root(tmp_path):
    create_root(tmp_path / "r", trust_domain="example.org")
    cert = create_issuer(tmp_path / "i", tmp_path / "r").cert
    assert cert.subject.rfc4514_string() == "CN=identity.linkerd.example.org"


def test_create_issuer_never_outlives_its_root(tmp_path, now):
    root = create_root(tmp_path / "r", lifetime=timedelta(days=30), now=now).cert
    cert = create_issuer(tmp_path / "i", tmp_path / "r", now=now).cert
    assert cert.not_valid_after_utc == root.not_valid_after_utc


def test_create_issuer_in_the_root_dir_keeps_ca_crt(tmp_path):
    create_root(tmp_path)
    before = (tmp_path / "ca.crt").read_bytes()
    create_issuer(tmp_path, tmp_path)
    assert (tmp_path / "ca.crt").read_bytes() == before
    assert ca.load_issuer(tmp_path).cert.subject.rfc4514_string().startswith("CN=identity.")


def test_create_issuer_refuses_to_overwrite_unless_forced(pki):
    with pytest.raises(PKIError, match=r"issuer\.key: already exists"):
        create_issuer(pki / "issuer", pki / "root")
    create_issuer(pki / "issuer", pki / "root", force=True)


def test_create_issuer_refuses_a_key_that_matches_no_anchor(tmp_path):
    create_root(tmp_path / "a")
    create_root(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    with pytest.raises(PKIError, match="matches no certificate"):
        create_issuer(tmp_path / "i", tmp_path / "a")


# --- inspect ------------------------------------------------------------------------


def test_inspect_reports_the_facts_and_chains_with_a_sibling_ca_crt(pki):
    info = inspect(pki / "issuer" / "issuer.crt")
    assert info["subject"] == "CN=identity.linkerd.cluster.local"
    assert info["issuer"] == "CN=root.linkerd.cluster.local"
    assert info["is_ca"] is True
    assert info["path_length"] == 0
    assert info["key_type"] == "ECDSA P-256"
    assert info["chains"] is True
    assert info["chains_to"] == str(pki / "issuer" / "ca.crt")
    assert (
        int(info["serial"], 16) == files.read_certs(pki / "issuer" / "issuer.crt")[0].serial_number
    )


def test_inspect_of_a_leaf_with_its_chain_in_the_file(pki, issuer, now):
    leaf, chain, _ = issuer.sign_leaf(
        check_csr(make_csr(new_key(), WEB), WEB.dns_name), WEB, now=now
    )
    path = pki / "leaf.crt"
    path.write_bytes(files.certs_pem(x509.load_der_x509_certificate(c) for c in [leaf, *chain]))
    info = inspect(path, ca=pki / "root" / "ca.crt")
    assert info["dns_names"] == [WEB.dns_name]
    assert info["uris"] == [WEB.spiffe_uri]
    assert info["certificates_in_file"] == 2
    assert info["chains"] is True


def test_inspect_says_when_a_certificate_does_not_chain(pki, tmp_path):
    create_root(tmp_path / "f")
    info = inspect(pki / "issuer" / "issuer.crt", ca=tmp_path / "f" / "ca.crt")
    assert info["chains"] is False
    assert "does not chain" in info["chain_error"]


def test_inspect_without_a_bundle_does_not_guess(pki, tmp_path):
    lone = tmp_path / "lone" / "issuer.crt"
    lone.parent.mkdir()
    lone.write_bytes((pki / "issuer" / "issuer.crt").read_bytes())
    info = inspect(lone)
    assert info["chains"] is None
    assert info["chains_to"] is None
