"""The Certify decision: who gets a certificate, and each refusal's status code."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from agent.controlplane import tokens
from agent.controlplane.certify import Certified, Refusal, certify
from agent.identity import ca
from agent.identity.csr import make_csr, new_key
from agent.identity.names import Identity

WEB = Identity(sa="web", ns="shop")


@pytest.fixture
def now():
    return datetime.now(UTC)


@pytest.fixture
def env(tmp_path, now):
    ca.create_root(tmp_path / "root", now=now)
    ca.create_issuer(tmp_path / "issuer", tmp_path / "root", now=now)
    issuer = ca.load_issuer(tmp_path / "issuer", now=now)
    verifier = tokens.validator(tokens.signing_key(tmp_path))
    token = tokens.mint(tmp_path, "shop", "web", now=now).encode()
    return {"dir": tmp_path, "issuer": issuer, "verifier": verifier, "token": token}


def _call(env, now, **overrides):
    args = {
        "identity": WEB.dns_name,
        "token": env["token"],
        "csr": make_csr(new_key(), WEB),
        "verifier": env["verifier"],
        "issuer": env["issuer"],
        "now": now,
    }
    args.update(overrides)
    return certify(**args)


def _refusal(outcome) -> Refusal:
    assert isinstance(outcome, Refusal), outcome
    assert outcome.code in grpc.StatusCode.__members__
    return outcome


def test_good_request_gets_a_24h_leaf_for_its_identity(env, now):
    out = _call(env, now)
    assert isinstance(out, Certified)
    leaf = x509.load_der_x509_certificate(out.leaf_der)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [WEB.dns_name]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [WEB.spiffe_uri]
    assert out.valid_until == now.replace(microsecond=0) + timedelta(hours=24)
    assert list(out.intermediates_der) == env["issuer"].chain_der
    ca.verify_chain(out.leaf_der, out.intermediates_der, env["issuer"].bundle, now=now)


def test_lifetime_and_skew_are_honoured(env, now):
    out = _call(env, now, lifetime=timedelta(hours=1), skew=timedelta(seconds=5))
    assert isinstance(out, Certified)
    leaf = x509.load_der_x509_certificate(out.leaf_der)
    start = now.replace(microsecond=0)
    assert leaf.not_valid_before_utc == start - timedelta(seconds=5)
    assert leaf.not_valid_after_utc == start + timedelta(hours=1)


@pytest.mark.parametrize(
    ("field", "message"),
    [("identity", "missing identity"), ("token", "missing token"), ("csr", "missing certificate")],
)
def test_missing_fields_are_invalid_argument(env, now, field, message):
    out = _refusal(_call(env, now, **{field: "" if field == "identity" else b""}))
    assert out.code == "INVALID_ARGUMENT"
    assert message in out.message


def test_no_issuer_is_unavailable(env, now):
    out = _refusal(_call(env, now, issuer=None))
    assert out.code == "UNAVAILABLE"


def test_expired_issuer_is_unavailable(env, now):
    later = now + timedelta(days=400)
    token = tokens.mint(env["dir"], "shop", "web", now=later).encode()
    out = _refusal(_call(env, later, token=token))
    assert out.code == "UNAVAILABLE"
    assert "expired" in out.message


def test_unparsable_csr_is_invalid_argument(env, now):
    out = _refusal(_call(env, now, csr=b"not a csr"))
    assert (out.code, "unparsable" in out.message) == ("INVALID_ARGUMENT", True)


def test_csr_for_another_identity_is_failed_precondition(env, now):
    out = _refusal(_call(env, now, csr=make_csr(new_key(), Identity(sa="api", ns="shop"))))
    assert out.code == "FAILED_PRECONDITION"
    assert "identity mismatch" in out.message


def test_csr_with_rsa_key_is_failed_precondition(env, now):
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WEB.dns_name)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(WEB.dns_name)]), critical=False)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.DER)
    )
    out = _refusal(_call(env, now, csr=csr))
    assert (out.code, "wrong key type" in out.message) == ("FAILED_PRECONDITION", True)


def test_malformed_token_is_invalid_argument(env, now):
    out = _refusal(_call(env, now, token=b"not-a-jwt"))
    assert (out.code, "malformed" in out.message) == ("INVALID_ARGUMENT", True)


def test_expired_token_is_failed_precondition(env, now):
    token = tokens.mint(env["dir"], "shop", "web", now=now - timedelta(days=2)).encode()
    out = _refusal(_call(env, now, token=token))
    assert (out.code, "expired" in out.message) == ("FAILED_PRECONDITION", True)


def test_token_signed_by_another_key_is_failed_precondition(env, now, tmp_path):
    foreign = tokens.encode(new_key(), tokens.token_claims("shop", "web", now=now)).encode()
    out = _refusal(_call(env, now, token=foreign))
    assert (out.code, "bad signature" in out.message) == ("FAILED_PRECONDITION", True)


def test_token_for_another_service_account_is_failed_precondition(env, now):
    token = tokens.mint(env["dir"], "shop", "api", now=now).encode()
    out = _refusal(_call(env, now, token=token))
    assert out.code == "FAILED_PRECONDITION"
    assert "requested identity did not match provided token" in out.message
    assert "found=api.shop.serviceaccount" in out.message


def test_request_and_csr_for_another_identity_with_a_valid_token_is_refused(env, now):
    api = Identity(sa="api", ns="shop")
    out = _refusal(_call(env, now, identity=api.dns_name, csr=make_csr(new_key(), api)))
    assert out.code == "FAILED_PRECONDITION"
    assert "did not match" in out.message
