"""Workload keys and certificate signing requests (pure crypto, no I/O).

Rules (as Linkerd's identity service checks a CSR, plus the signature check
Go's parser skips):
1. Keys are ECDSA P-256; a CSR with another key type is refused.
2. A CSR names exactly one identity: exactly one DNS SAN, equal to the
   expected identity; a Common Name, if any, equal to it too; no IP, e-mail
   or URI SANs (nobody can vouch for them).
3. A CSR is self-signed by its key; a bad signature is refused.
Every refusal is a `CSRError` with a `CSRReason`, so callers can map it to a
status without parsing messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.errors import AgentError

if TYPE_CHECKING:
    from agent.identity.names import Identity


class CSRReason(enum.Enum):
    """Why a CSR was refused."""

    UNPARSABLE = "unparsable"
    WRONG_KEY_TYPE = "wrong key type"
    BAD_SIGNATURE = "bad signature"
    IDENTITY_MISMATCH = "identity mismatch"


class CSRError(AgentError):
    """A certificate signing request was refused."""

    def __init__(self, reason: CSRReason, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"certificate signing request refused ({reason.value}): {detail}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CSRInfo:
    """A checked CSR: the key to certify and the identity it asks for."""

    public_key: ec.EllipticCurvePublicKey
    dns_name: str


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def make_csr(key: ec.EllipticCurvePrivateKey, identity: Identity) -> bytes:
    """A DER CSR for `identity`: CN and the single DNS SAN are its DNS name."""
    name = identity.dns_name
    builder = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
    )
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.DER)


def check_csr(data: bytes, expected_dns: str) -> CSRInfo:
    """Parse (PEM or DER) and check a CSR asking for `expected_dns`.

    Raises `CSRError` with reason UNPARSABLE, WRONG_KEY_TYPE, BAD_SIGNATURE or
    IDENTITY_MISMATCH.
    """
    csr = _parse(data)
    key = _p256_key(csr)
    try:
        valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm) as exc:  # unknown or malformed signature
        raise CSRError(CSRReason.BAD_SIGNATURE, f"unusable signature: {exc}") from exc
    if not valid:
        raise CSRError(CSRReason.BAD_SIGNATURE, "the CSR is not signed by its own key")
    _check_names(csr, expected_dns)
    return CSRInfo(public_key=key, dns_name=expected_dns)


def _parse(data: bytes) -> x509.CertificateSigningRequest:
    if not data:
        raise CSRError(CSRReason.UNPARSABLE, "empty")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_csr(data)
        return x509.load_der_x509_csr(data)
    except (ValueError, x509.InvalidVersion) as exc:
        raise CSRError(CSRReason.UNPARSABLE, str(exc) or "not a PKCS#10 request") from exc


def _p256_key(csr: x509.CertificateSigningRequest) -> ec.EllipticCurvePublicKey:
    try:
        key = csr.public_key()
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # unknown or malformed key
        raise CSRError(CSRReason.WRONG_KEY_TYPE, f"unusable public key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CSRError(CSRReason.WRONG_KEY_TYPE, f"{type(key).__name__}, want ECDSA P-256")
    if not isinstance(key.curve, ec.SECP256R1):
        raise CSRError(CSRReason.WRONG_KEY_TYPE, f"ECDSA {key.curve.name}, want P-256")
    return key


def _check_names(csr: x509.CertificateSigningRequest, expected: str) -> None:
    def refuse(detail: str) -> CSRError:
        return CSRError(CSRReason.IDENTITY_MISMATCH, detail)

    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise refuse("no subjectAltName extension; want one DNS name") from None
    except ValueError as exc:  # duplicate or malformed extensions
        raise CSRError(CSRReason.UNPARSABLE, f"extensions: {exc}") from exc
    dns = san.get_values_for_type(x509.DNSName)
    if len(dns) != 1:
        raise refuse(f"want exactly one DNS name, got {len(dns)}: {dns}")
    if dns[0] != expected:
        raise refuse(f"DNS name {dns[0]!r} is not the requested identity {expected!r}")
    others = [g for g in san if not isinstance(g, x509.DNSName)]
    if others:
        kinds = sorted({type(g).__name__ for g in others})
        raise refuse(f"only a DNS name can be vouched for, got also {', '.join(kinds)}")
    for cn in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME):
        if cn.value != expected:
            raise refuse(f"common name {cn.value!r} is not the requested identity")
