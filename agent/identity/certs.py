"""Certificate shapes and facts of the mesh PKI (pure): lifetimes, builders, `describe`.

    trust anchor  root CA, ECDSA P-256, 10 years      ca.crt / ca.key
    issuer        intermediate CA, 1 year, pathlen 0  issuer.crt / issuer.key (+ ca.crt copy)
    leaf          24 h, P-256, serverAuth+clientAuth  DNS + URI SANs of one identity

No files, no clock, no logging: `ca.py` (the issuer) and `pki.py` (the
operator's files) build their certificates from these parts.

Rules:
1. The lifetimes are Linkerd's defaults; a certificate is renewed at 70% of
   its lifetime (`renew_at`).
2. Every certificate carries a SubjectKeyIdentifier; a CA's key usage is
   certSign + crlSign, a leaf's digitalSignature; an issued certificate's
   AuthorityKeyIdentifier is its issuer's SKI (or derived from its key).
3. `describe` and `key_type` only read a certificate; they never check it
   (chain checks are `agent.identity.chain`).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from agent.identity.chain import is_ca, iso, path_length

if TYPE_CHECKING:
    from datetime import datetime

# Linkerd's defaults (`issuanceLifetime`, `clockSkewAllowance`, and the
# lifetimes of `step certificate create` in Linkerd's docs).
ROOT_LIFETIME = timedelta(hours=87600)
ISSUER_LIFETIME = timedelta(hours=8760)
ISSUANCE_LIFETIME = timedelta(hours=24)
CLOCK_SKEW_ALLOWANCE = timedelta(seconds=20)
RENEW_FRACTION = 0.7

CA_CRT, CA_KEY = "ca.crt", "ca.key"
ISSUER_CRT, ISSUER_KEY = "issuer.crt", "issuer.key"


def renew_at(not_before: datetime, not_after: datetime) -> datetime:
    """When to renew a certificate: at 70% of its lifetime."""
    return not_before + (not_after - not_before) * RENEW_FRACTION


# --- builders ------------------------------------------------------------------


def cert_builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: datetime,
    not_after: datetime,
) -> x509.CertificateBuilder:
    """A builder with names, key, window, a random serial and the SKI (rule 2)."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def key_usage(*, signing: bool) -> x509.KeyUsage:
    """A CA's (`signing`) or a leaf's key usage (rule 2)."""
    return x509.KeyUsage(
        digital_signature=not signing,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signing,
        crl_sign=signing,
        encipher_only=False,
        decipher_only=False,
    )


def aki(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    """The AuthorityKeyIdentifier of a certificate `issuer` signs (rule 2)."""
    try:
        ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(
            issuer.public_key()  # type: ignore[arg-type]
        )
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def spki(key: ec.EllipticCurvePublicKey | Any) -> bytes:
    """The DER SubjectPublicKeyInfo of a public key, to compare keys."""
    return bytes(
        key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


# --- facts ---------------------------------------------------------------------


def describe(cert: x509.Certificate) -> dict[str, Any]:
    """The facts of one certificate an operator asks about."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, uris = (
            san.get_values_for_type(x509.DNSName),
            san.get_values_for_type(x509.UniformResourceIdentifier),
        )
    except x509.ExtensionNotFound:
        dns, uris = [], []
    der = cert.public_bytes(serialization.Encoding.DER)
    return {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": format(cert.serial_number, "x"),
        "dns_names": dns,
        "uris": uris,
        "key_type": key_type(cert.public_key()),
        "not_before": iso(cert.not_valid_before_utc),
        "not_after": iso(cert.not_valid_after_utc),
        "is_ca": is_ca(cert),
        "path_length": path_length(cert) if is_ca(cert) else None,
        "sha256": hashlib.sha256(der).hexdigest(),
    }


def key_type(key: object) -> str:
    """`ECDSA P-256`, `RSA 2048`, `Ed25519`, ... for a public key."""
    if isinstance(key, ec.EllipticCurvePublicKey):
        return {"secp256r1": "ECDSA P-256", "secp384r1": "ECDSA P-384"}.get(
            key.curve.name, f"ECDSA {key.curve.name}"
        )
    if isinstance(key, rsa.RSAPublicKey):
        return f"RSA {key.key_size}"
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "Ed25519"
    if isinstance(key, ed448.Ed448PublicKey):
        return "Ed448"
    return type(key).__name__
