"""Trust bundles and certificate path verification (no clock; I/O only in `load_trust_bundle`).

Rules:
1. A trust bundle holds one or more anchors (several during a rotation); each
   must be a CA.
2. A path is `[leaf, intermediates..., anchor]`: every link is checked for
   issuer name and signature, every certificate for its validity window at
   `now`, every signer for the CA flag (and keyCertSign when keyUsage is
   present) and its basicConstraints path length.
3. Failures are `PKIError(what, reason)` naming the certificate by its CN.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from agent.errors import PKIError
from agent.identity import files

if TYPE_CHECKING:
    from collections.abc import Sequence


# --- trust bundles -----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TrustBundle:
    """One or more trust anchors (several during a rotation); each is a CA."""

    anchors: tuple[x509.Certificate, ...]
    source: str = "<memory>"

    @property
    def pem(self) -> bytes:
        """The anchors as concatenated PEM (what `ssl` and Linkerd read)."""
        return files.certs_pem(self.anchors)

    @classmethod
    def from_pem(cls, data: bytes, *, source: str = "<memory>") -> TrustBundle:
        """Parse PEM anchors; raises `PKIError` if none, or one is not a CA."""
        anchors = files.parse_certs(data, source)
        for i, cert in enumerate(anchors):
            if not is_ca(cert):
                raise PKIError(source, f"certificate {i} ({cn(cert)}) is not a CA")
        return cls(anchors=tuple(anchors), source=source)


def load_trust_bundle(path: str | Path) -> TrustBundle:
    """Read a PEM trust bundle; raises `PKIError` if missing, empty or not all CAs."""
    p = Path(path)
    return TrustBundle.from_pem(files.read_bytes(p), source=str(p))


# --- chain verification ------------------------------------------------------


def verify_chain(
    leaf: bytes | x509.Certificate,
    intermediates: Sequence[bytes | x509.Certificate],
    bundle: TrustBundle,
    *,
    now: datetime,
) -> None:
    """Check that `leaf` chains through `intermediates` to an anchor of `bundle`.

    Checks signatures, issuer names, validity at `now`, CA flags and path
    lengths. Raises `PKIError` naming the certificate and the reason.
    """
    build_path(as_cert(leaf), [as_cert(c) for c in intermediates], bundle, now=now)


def build_path(
    leaf: x509.Certificate,
    intermediates: Sequence[x509.Certificate],
    bundle: TrustBundle,
    *,
    now: datetime,
) -> list[x509.Certificate]:
    """The verified path `[leaf, intermediates..., anchor]`; see `verify_chain`."""
    check_window(leaf, now)
    if any(leaf == anchor for anchor in bundle.anchors):
        return [leaf]
    path, pool, below = [leaf], list(intermediates), 0
    while True:
        child = path[-1]
        anchor = _find_issuer(child, bundle.anchors)
        if anchor is not None:
            _check_ca(anchor, now, below)
            return [*path, anchor]
        parent = _find_issuer(child, pool)
        if parent is None:
            raise PKIError(
                cn(child),
                f"does not chain to any trust anchor in {bundle.source} "
                f"(no certificate found for its issuer {child.issuer.rfc4514_string()!r})",
            )
        _check_ca(parent, now, below)
        pool.remove(parent)
        path.append(parent)
        below += 1


def _find_issuer(
    child: x509.Certificate, candidates: Sequence[x509.Certificate]
) -> x509.Certificate | None:
    for cand in candidates:
        try:
            child.verify_directly_issued_by(cand)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return cand
    return None


def check_window(cert: x509.Certificate, now: datetime) -> None:
    """Raise `PKIError` unless `now` is within the certificate's validity."""
    if now < cert.not_valid_before_utc:
        raise PKIError(cn(cert), f"not valid before {iso(cert.not_valid_before_utc)}")
    if now > cert.not_valid_after_utc:
        raise PKIError(cn(cert), f"expired at {iso(cert.not_valid_after_utc)}")


def _check_ca(cert: x509.Certificate, now: datetime, below: int) -> None:
    check_window(cert, now)
    if not is_ca(cert):
        raise PKIError(cn(cert), "signs certificates but is not a CA")
    limit = path_length(cert)
    if limit is not None and below > limit:
        raise PKIError(cn(cert), f"path length {limit} allows fewer intermediates than {below}")


def is_ca(cert: x509.Certificate) -> bool:
    """True if basicConstraints says CA (and keyUsage, if present, allows signing)."""
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return False
    try:
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return bc.ca
    return bc.ca and ku.key_cert_sign


def path_length(cert: x509.Certificate) -> int | None:
    """The basicConstraints path length of a CA, or None when unlimited/absent."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.path_length
    except x509.ExtensionNotFound:
        return None


def as_cert(value: bytes | x509.Certificate) -> x509.Certificate:
    """A certificate from itself, DER or PEM (the first one)."""
    if isinstance(value, x509.Certificate):
        return value
    return files.parse_certs(value, "<certificate>")[0]


def cn(cert: x509.Certificate) -> str:
    """The certificate's CN (or whole subject) for messages."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else cert.subject.rfc4514_string() or "<no subject>"


def iso(when: datetime) -> str:
    """`2030-01-02T03:04:05Z`."""
    return when.astimezone(UTC).isoformat().replace("+00:00", "Z")
