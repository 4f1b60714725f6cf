"""The PKI through `agent.identity.ca`: trust bundles, issuers, leaves, chain checks."""

from __future__ import annotations

from datetime import timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509 import verification
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.errors import PKIError
from agent.identity import ca, files
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.names import Identity

WEB = Identity(sa="web", ns="shop")


def _leaf_request(identity: Identity = WEB):
    return check_csr(make_csr(new_key(), identity), identity.dns_name)


@pytest.fixture
def issuer(pki, now):
    return ca.load_issuer(pki / "issuer", now=now)


# --- trust bundles -----------------------------------------------------------------


def test_trust_bundle_holds_several_anchors(tmp_path):
    a = ca.create_root(tmp_path / "a").cert
    b = ca.create_root(tmp_path / "b").cert
    path = tmp_path / "bundle.crt"
    path.write_bytes(files.certs_pem([a, b]))
    bundle = ca.load_trust_bundle(path)
    assert bundle.anchors == (a, b)
    assert bundle.pem == path.read_bytes()


def test_trust_bundle_refuses_a_leaf(pki, issuer, now):
    leaf, _, _ = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    path = pki / "leaf.crt"
    path.write_bytes(files.certs_pem([x509.load_der_x509_certificate(leaf)]))
    with pytest.raises(PKIError, match="is not a CA"):
        ca.load_trust_bundle(path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"", "not a certificate|no certificate"), (b"garbage", "not a certificate")],
)
def test_trust_bundle_refuses_files_without_certificates(tmp_path, content, reason):
    path = tmp_path / "ca.crt"
    path.write_bytes(content)
    with pytest.raises(PKIError, match=reason):
        ca.load_trust_bundle(path)


def test_missing_trust_bundle_says_missing(tmp_path):
    with pytest.raises(PKIError, match="missing"):
        ca.load_trust_bundle(tmp_path / "nope.crt")


# --- load_issuer refusals ---------------------------------------------------------


def test_load_issuer_accepts_a_fresh_issuer(issuer, pki):
    assert issuer.cert == files.read_certs(pki / "issuer" / "issuer.crt")[0]
    assert issuer.expires == issuer.cert.not_valid_after_utc
    assert "key=" not in repr(issuer)  # the private key never shows in logs


def test_load_issuer_refuses_an_issuer_of_another_anchor(pki, tmp_path):
    ca.create_root(tmp_path / "other")
    (pki / "issuer" / "ca.crt").write_bytes((tmp_path / "other" / "ca.crt").read_bytes())
    with pytest.raises(PKIError, match="does not chain to the trust bundle"):
        ca.load_issuer(pki / "issuer")


def test_load_issuer_refuses_an_expired_issuer(pki, now):
    with pytest.raises(PKIError, match="issuer expired at"):
        ca.load_issuer(pki / "issuer", now=now + timedelta(days=366))


def test_load_issuer_refuses_a_key_that_does_not_match(pki, tmp_path):
    files.write_key(pki / "issuer" / "issuer.key", new_key())
    with pytest.raises(PKIError, match=r"issuer\.key: does not match the public key"):
        ca.load_issuer(pki / "issuer")


def test_load_issuer_refuses_a_leaf_as_issuer(pki, issuer, now):
    key = new_key()
    leaf, _, _ = issuer.sign_leaf(check_csr(make_csr(key, WEB), WEB.dns_name), WEB, now=now)
    d = pki / "issuer"
    (d / "issuer.crt").write_bytes(files.certs_pem([x509.load_der_x509_certificate(leaf)]))
    files.write_key(d / "issuer.key", key)
    with pytest.raises(PKIError, match="is not a CA certificate"):
        ca.load_issuer(d)


def test_load_issuer_says_which_file_is_missing(pki):
    (pki / "issuer" / "issuer.key").unlink()
    with pytest.raises(PKIError, match=r"issuer\.key: missing"):
        ca.load_issuer(pki / "issuer")


def test_load_issuer_accepts_an_issuer_of_a_second_anchor_during_rotation(pki, tmp_path):
    ca.create_root(tmp_path / "new")
    ca.create_issuer(tmp_path / "new-issuer", tmp_path / "new")
    bundle = (pki / "root" / "ca.crt").read_bytes() + (tmp_path / "new" / "ca.crt").read_bytes()
    (tmp_path / "new-issuer" / "ca.crt").write_bytes(bundle)
    loaded = ca.load_issuer(tmp_path / "new-issuer")
    assert len(loaded.bundle.anchors) == 2


# --- sign_leaf ---------------------------------------------------------------------


def test_leaf_is_a_24h_p256_workload_cert_with_dns_and_uri_sans(issuer, now):
    leaf_der, chain, valid_until = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    leaf = x509.load_der_x509_certificate(leaf_der)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [WEB.dns_name]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [WEB.spiffe_uri]
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == WEB.dns_name
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not ca.is_ca(leaf)
    assert leaf.extensions.get_extension_for_class(x509.KeyUsage).value.digital_signature
    assert ca.key_type(leaf.public_key()) == "ECDSA P-256"
    start = now.replace(microsecond=0)
    assert leaf.not_valid_before_utc == start - timedelta(seconds=20)
    assert leaf.not_valid_after_utc == start + timedelta(hours=24)
    assert valid_until == leaf.not_valid_after_utc
    assert chain == issuer.chain_der
    assert len(chain) == 1
    ca.verify_chain(leaf_der, chain, issuer.bundle, now=now)


def test_leaf_is_accepted_by_cryptographys_own_client_and_server_verifiers(issuer, now):
    leaf_der, chain, _ = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    leaf = x509.load_der_x509_certificate(leaf_der)
    inter = [x509.load_der_x509_certificate(c) for c in chain]
    store = verification.Store(list(issuer.bundle.anchors))
    builder = verification.PolicyBuilder().store(store).time(now)
    client = builder.build_client_verifier().verify(leaf, inter)
    assert x509.DNSName(WEB.dns_name) in client.subjects
    server = builder.build_server_verifier(x509.DNSName(WEB.dns_name)).verify(leaf, inter)
    assert len(server) == 3


def test_leaf_never_outlives_its_issuer(tmp_path, now):
    ca.create_root(tmp_path / "r", now=now)
    ca.create_issuer(tmp_path / "i", tmp_path / "r", lifetime=timedelta(hours=2), now=now)
    issuer = ca.load_issuer(tmp_path / "i", now=now)
    _, _, valid_until = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    assert valid_until == issuer.cert.not_valid_after_utc
    assert valid_until < now + timedelta(hours=3)


def test_a_throwaway_mesh_issues_workload_chains_that_verify(tmp_path, now):
    mesh = ca.create_mesh(tmp_path / "mesh", created=now - timedelta(days=2), now=now)
    assert (tmp_path / "mesh" / "root").is_dir()
    assert (tmp_path / "mesh" / "issuer").is_dir()
    chain_pem, key, until = mesh.workload(WEB, now=now, lifetime=timedelta(hours=1))
    leaf, *rest = x509.load_pem_x509_certificates(chain_pem)
    assert leaf.public_key().public_numbers() == key.public_key().public_numbers()
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == WEB.dns_name
    assert until == leaf.not_valid_after_utc == now.replace(microsecond=0) + timedelta(hours=1)
    ca.verify_chain(leaf, rest, mesh.bundle, now=now)
    with pytest.raises(PKIError, match="does not chain"):
        ca.verify_chain(leaf, rest, ca.create_mesh(tmp_path / "other", now=now).bundle, now=now)


def test_sign_leaf_refuses_a_csr_for_another_identity(issuer, now):
    with pytest.raises(PKIError, match="CSR is for"):
        issuer.sign_leaf(_leaf_request(Identity(sa="api", ns="shop")), WEB, now=now)


# --- verify_chain failures ------------------------------------------------------------


def test_verify_chain_refuses_a_foreign_bundle(issuer, tmp_path, now):
    leaf, chain, _ = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    foreign = ca.TrustBundle(anchors=(ca.create_root(tmp_path / "f").cert,), source="foreign")
    with pytest.raises(PKIError, match="does not chain to any trust anchor in foreign"):
        ca.verify_chain(leaf, chain, foreign, now=now)


def test_verify_chain_refuses_a_missing_intermediate(issuer, now):
    leaf, _, _ = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    with pytest.raises(PKIError, match="does not chain"):
        ca.verify_chain(leaf, [], issuer.bundle, now=now)


@pytest.mark.parametrize(
    ("shift", "reason"),
    [(timedelta(hours=25), "expired at"), (timedelta(minutes=-1), "not valid before")],
)
def test_verify_chain_refuses_a_leaf_outside_its_window(issuer, now, shift, reason):
    leaf, chain, _ = issuer.sign_leaf(_leaf_request(), WEB, now=now)
    with pytest.raises(PKIError, match=reason):
        ca.verify_chain(leaf, chain, issuer.bundle, now=now + shift)


def test_verify_chain_refuses_a_leaf_signed_by_a_leaf(issuer, now):
    key = new_key()
    mid_der, chain, _ = issuer.sign_leaf(check_csr(make_csr(key, WEB), WEB.dns_name), WEB, now=now)
    mid = x509.load_der_x509_certificate(mid_der)
    fake = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake")]))
        .issuer_name(mid.subject)
        .public_key(new_key().public_key())
        .serial_number(1)
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(PKIError, match="is not a CA"):
        ca.verify_chain(fake, [mid, *chain], issuer.bundle, now=now)


def test_verify_chain_enforces_the_issuers_path_length(issuer, now):
    sub_key = new_key()
    sub = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sub-ca")]))
        .issuer_name(issuer.cert.subject)
        .public_key(sub_key.public_key())
        .serial_number(2)
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(issuer.key, hashes.SHA256())
    )
    sub_issuer = ca.Issuer(
        cert=sub,
        key=sub_key,
        intermediates=(issuer.cert,),
        bundle=issuer.bundle,
        expires=sub.not_valid_after_utc,
    )
    leaf, chain, _ = sub_issuer.sign_leaf(_leaf_request(), WEB, now=now)
    with pytest.raises(PKIError, match="path length 0"):
        ca.verify_chain(leaf, chain, issuer.bundle, now=now)


def test_an_anchor_chains_to_itself(issuer, now):
    ca.verify_chain(issuer.bundle.anchors[0], [], issuer.bundle, now=now)
