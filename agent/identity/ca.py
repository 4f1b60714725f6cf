"""The identity issuer of the mesh PKI, as Linkerd lays it out: load it, sign leaves.

    trust anchor  root CA, ECDSA P-256, 10 years      ca.crt / ca.key
    issuer        intermediate CA, 1 year, pathlen 0  issuer.crt / issuer.key (+ ca.crt copy)
    leaf          24 h, P-256, serverAuth+clientAuth  DNS + URI SANs of one identity

The PKI is three modules: `certs` (pure: lifetimes, builders, `describe`),
`pki` (the operator's files: `create_root`, `create_issuer`, `inspect`) and
this one, which re-exports the public names of both (and of `chain`) so
`agent.identity.ca` stays the one import of the PKI.

Rules:
1. Certificates are built with `agent.identity.certs` and checked with
   `agent.identity.chain` (re-exported: `TrustBundle`, `load_trust_bundle`,
   `verify_chain`); files go through `agent.identity.files` (keys 0600, no
   overwrite without `force`).
2. An issuer is usable only if it is a CA, its key matches, it is in its
   validity window, and it chains to an anchor of its trust bundle
   (`load_issuer` refuses with `PKIError` saying which).
3. A leaf never outlives its issuer path: its notAfter is clamped to the
   earliest notAfter of the issuer, intermediates and anchor (as Linkerd's CA
   clamps), and its notBefore is backdated by the clock-skew allowance.
4. Time is a parameter (`now`, timezone-aware UTC); only the file-level entry
   points (`create_*`, `load_issuer`, `inspect`) read the clock by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.errors import PKIError
from agent.identity import files
from agent.identity.certs import (
    CA_CRT,
    CLOCK_SKEW_ALLOWANCE,
    ISSUANCE_LIFETIME,
    ISSUER_CRT,
    ISSUER_KEY,
    ISSUER_LIFETIME,
    ROOT_LIFETIME,
    aki,
    cert_builder,
    describe,
    key_type,
    key_usage,
    renew_at,
    spki,
)
from agent.identity.chain import (
    TrustBundle,
    build_path,
    cn,
    is_ca,
    iso,
    load_trust_bundle,
    path_length,
    verify_chain,
)
from agent.identity.csr import check_csr, make_csr, new_key
from agent.identity.pki import Created, create_issuer, create_root, inspect
from agent.identity.tls import chain_pem

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

    from agent.identity.csr import CSRInfo
    from agent.identity.names import Identity


__all__ = [
    "CLOCK_SKEW_ALLOWANCE",
    "ISSUANCE_LIFETIME",
    "ISSUER_LIFETIME",
    "ROOT_LIFETIME",
    "Created",
    "Issuer",
    "TrustBundle",
    "create_issuer",
    "create_mesh",
    "create_root",
    "describe",
    "inspect",
    "is_ca",
    "issuer_from_pem",
    "key_type",
    "load_issuer",
    "load_trust_bundle",
    "path_length",
    "renew_at",
    "verify_chain",
]


# --- issuer ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Issuer:
    """A loaded identity issuer that chains to its trust bundle. Holds a key: never log it."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey = field(repr=False)
    intermediates: tuple[x509.Certificate, ...]
    bundle: TrustBundle
    expires: datetime
    """The earliest notAfter on the path issuer -> anchor; leaves never outlive it."""

    @property
    def chain_der(self) -> list[bytes]:
        """The issuer and any intermediates above it, DER, to send with each leaf."""
        return [
            c.public_bytes(serialization.Encoding.DER) for c in (self.cert, *self.intermediates)
        ]

    def check(self, now: datetime) -> None:
        """Raise `PKIError` if the issuer path is not valid at `now`."""
        build_path(self.cert, self.intermediates, self.bundle, now=now)

    def sign_leaf(
        self,
        csr_info: CSRInfo,
        identity: Identity,
        *,
        now: datetime,
        lifetime: timedelta = ISSUANCE_LIFETIME,
        skew: timedelta = CLOCK_SKEW_ALLOWANCE,
    ) -> tuple[bytes, list[bytes], datetime]:
        """Sign a workload certificate for `identity` over the CSR's key.

        Returns `(leaf_der, chain_der, valid_until)`. Raises `PKIError` if the
        CSR asked for another identity or the issuer is past its validity.
        """
        if csr_info.dns_name != identity.dns_name:
            raise PKIError(identity.dns_name, f"CSR is for {csr_info.dns_name!r}")
        not_after = min(now + lifetime, self.expires)
        if not_after <= now:
            raise PKIError(cn(self.cert), f"issuer path expired at {iso(self.expires)}")
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.dns_name)])
        san = [x509.DNSName(identity.dns_name), x509.UniformResourceIdentifier(identity.spiffe_uri)]
        builder = (
            cert_builder(name, self.cert.subject, csr_info.public_key, now - skew, not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(key_usage(signing=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(aki(self.cert), critical=False)
        )
        leaf = builder.sign(self.key, hashes.SHA256())
        der = leaf.public_bytes(serialization.Encoding.DER)
        return der, self.chain_der, leaf.not_valid_after_utc

    def workload(
        self, identity: Identity, *, now: datetime, lifetime: timedelta = ISSUANCE_LIFETIME
    ) -> tuple[bytes, ec.EllipticCurvePrivateKey, datetime]:
        """A fresh key for `identity` and its certificate chain (PEM), as a proxy obtains
        them from the identity service (key, CSR, checked, signed), and its notAfter."""
        key = new_key()
        info = check_csr(make_csr(key, identity), identity.dns_name)
        leaf, chain, valid_until = self.sign_leaf(info, identity, now=now, lifetime=lifetime)
        return chain_pem(leaf, chain), key, valid_until


def issuer_from_pem(
    cert_pem: bytes,
    key_pem: bytes,
    bundle: TrustBundle,
    *,
    now: datetime,
    where: str = "<memory>",
) -> Issuer:
    """Build and check an `Issuer` (see rule 2); raises `PKIError` saying why not."""
    certs = files.parse_certs(cert_pem, f"{where}/{ISSUER_CRT}")
    key = files.parse_key(key_pem, f"{where}/{ISSUER_KEY}")
    cert, crt_where = certs[0], f"{where}/{ISSUER_CRT}"
    if not is_ca(cert):
        raise PKIError(crt_where, f"{cn(cert)} is not a CA certificate; it cannot issue")
    if spki(key.public_key()) != spki(cert.public_key()):
        raise PKIError(f"{where}/{ISSUER_KEY}", f"does not match the public key of {crt_where}")
    if now > cert.not_valid_after_utc:
        raise PKIError(crt_where, f"issuer expired at {iso(cert.not_valid_after_utc)}")
    if now < cert.not_valid_before_utc:
        raise PKIError(crt_where, f"issuer not valid before {iso(cert.not_valid_before_utc)}")
    try:
        path = build_path(cert, certs[1:], bundle, now=now)
    except PKIError as exc:
        raise PKIError(crt_where, f"does not chain to the trust bundle: {exc}") from exc
    expires = min(c.not_valid_after_utc for c in path)
    return Issuer(
        cert=cert, key=key, intermediates=tuple(path[1:-1]), bundle=bundle, expires=expires
    )


def load_issuer(directory: str | Path, *, now: datetime | None = None) -> Issuer:
    """Load `issuer.crt`, `issuer.key` and `ca.crt` from `directory` and check them."""
    d = Path(directory)
    bundle = load_trust_bundle(d / CA_CRT)
    cert_pem = files.read_bytes(d / ISSUER_CRT)
    key_pem = files.read_bytes(d / ISSUER_KEY)
    return issuer_from_pem(cert_pem, key_pem, bundle, now=now or datetime.now(UTC), where=str(d))


def create_mesh(
    directory: str | Path, *, created: datetime | None = None, now: datetime | None = None
) -> Issuer:
    """A new trust anchor (`root/`) and issuer (`issuer/`) under `directory`, both made
    at `created` (default `now`), and the issuer loaded at `now` (default: the clock).
    A throwaway mesh CA, for tests and benchmarks."""
    d = Path(directory)
    now = now or datetime.now(UTC)
    made = created or now
    create_root(d / "root", now=made)
    create_issuer(d / "issuer", d / "root", now=made)
    return load_issuer(d / "issuer", now=now)
