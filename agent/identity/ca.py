"""The mesh PKI, as Linkerd lays it out: trust anchors, identity issuer, leaves.

    trust anchor  root CA, ECDSA P-256, 10 years      ca.crt / ca.key
    issuer        intermediate CA, 1 year, pathlen 0  issuer.crt / issuer.key (+ ca.crt copy)
    leaf          24 h, P-256, serverAuth+clientAuth  DNS + URI SANs of one identity

Rules:
1. Certificates are built here and checked with `agent.identity.chain`
   (re-exported: `TrustBundle`, `load_trust_bundle`, `verify_chain`); files go through
   `agent.identity.files` (keys 0600, no overwrite without `force`).
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

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.errors import PKIError
from agent.identity import files
from agent.identity.chain import (
    TrustBundle,
    build_path,
    check_window,
    cn,
    is_ca,
    iso,
    load_trust_bundle,
    path_length,
    verify_chain,
)
from agent.identity.names import (
    DEFAULT_CONTROL_NS,
    DEFAULT_TRUST_DOMAIN,
    Identity,
    check_label,
    check_subdomain,
)

if TYPE_CHECKING:
    from agent.identity.csr import CSRInfo

# Linkerd's defaults (`issuanceLifetime`, `clockSkewAllowance`, and the
# lifetimes of `step certificate create` in Linkerd's docs).
ROOT_LIFETIME = timedelta(hours=87600)
ISSUER_LIFETIME = timedelta(hours=8760)
ISSUANCE_LIFETIME = timedelta(hours=24)
CLOCK_SKEW_ALLOWANCE = timedelta(seconds=20)
RENEW_FRACTION = 0.7

__all__ = [
    "CLOCK_SKEW_ALLOWANCE",
    "ISSUANCE_LIFETIME",
    "ISSUER_LIFETIME",
    "ROOT_LIFETIME",
    "Created",
    "Issuer",
    "TrustBundle",
    "create_issuer",
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

CA_CRT, CA_KEY = "ca.crt", "ca.key"
ISSUER_CRT, ISSUER_KEY = "issuer.crt", "issuer.key"


def renew_at(not_before: datetime, not_after: datetime) -> datetime:
    """When to renew a certificate: at 70% of its lifetime."""
    return not_before + (not_after - not_before) * RENEW_FRACTION


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
            _base(name, self.cert.subject, csr_info.public_key, now - skew, not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(signing=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(_aki(self.cert), critical=False)
        )
        leaf = builder.sign(self.key, hashes.SHA256())
        der = leaf.public_bytes(serialization.Encoding.DER)
        return der, self.chain_der, leaf.not_valid_after_utc


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
    if _spki(key.public_key()) != _spki(cert.public_key()):
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
    return issuer_from_pem(cert_pem, key_pem, bundle, now=now or _now(), where=str(d))


# --- creating anchors and issuers -------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Created:
    """What `create_root` / `create_issuer` wrote."""

    cert: x509.Certificate
    files: tuple[Path, ...]

    def summary(self) -> dict[str, Any]:
        """`describe(cert)` plus `files`: one `{file, mode}` row per file written."""
        rows = [{"file": str(p), "mode": f"{p.stat().st_mode & 0o777:04o}"} for p in self.files]
        return {**describe(self.cert), "files": rows}


def create_root(  # noqa: PLR0913 - keyword-only settings
    directory: str | Path,
    *,
    lifetime: timedelta = ROOT_LIFETIME,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    control_ns: str = DEFAULT_CONTROL_NS,
    force: bool = False,
    now: datetime | None = None,
) -> Created:
    """Create a trust anchor `ca.crt` / `ca.key` (CN `root.linkerd.<trust-domain>`)."""
    check_subdomain("trust domain", trust_domain)
    check_label("control-plane namespace", control_ns)
    d = Path(directory)
    files.refuse_existing([d / CA_KEY, d / CA_CRT], force=force)
    start = now or _now()
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"root.{control_ns}.{trust_domain}")])
    cert = (
        _base(name, name, key.public_key(), start - CLOCK_SKEW_ALLOWANCE, start + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(_key_usage(signing=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    files.write_key(d / CA_KEY, key)
    files.write_file(d / CA_CRT, files.certs_pem([cert]), mode=files.CERT_MODE)
    return Created(cert=cert, files=(d / CA_CRT, d / CA_KEY))


def create_issuer(  # noqa: PLR0913 - keyword-only settings
    directory: str | Path,
    ca_dir: str | Path,
    *,
    lifetime: timedelta = ISSUER_LIFETIME,
    trust_domain: str | None = None,
    control_ns: str | None = None,
    force: bool = False,
    now: datetime | None = None,
) -> Created:
    """Create `issuer.crt` / `issuer.key` signed by the anchor in `ca_dir`, and copy `ca.crt`.

    The CN is `identity.<control-ns>.<trust-domain>`, both taken from the
    anchor's `root.<control-ns>.<trust-domain>` CN unless given. Raises
    `PKIError` if the anchor is unusable or files exist (without `force`).
    """
    d, ca = Path(directory), Path(ca_dir)
    bundle_pem = files.read_bytes(ca / CA_CRT)
    bundle = TrustBundle.from_pem(bundle_pem, source=str(ca / CA_CRT))
    ca_key = files.read_key(ca / CA_KEY)
    anchor = _anchor_for(ca_key, bundle, ca / CA_KEY)
    start = now or _now()
    check_window(anchor, start)
    ns, td = _names_from_root(anchor, control_ns, trust_domain)
    copy_ca = not _same_content(d / CA_CRT, bundle_pem)
    files.refuse_existing(
        [d / ISSUER_KEY, d / ISSUER_CRT, *([d / CA_CRT] if copy_ca else [])], force=force
    )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"identity.{ns}.{td}")])
    not_after = min(start + lifetime, anchor.not_valid_after_utc)
    cert = (
        _base(name, anchor.subject, key.public_key(), start - CLOCK_SKEW_ALLOWANCE, not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signing=True), critical=True)
        .add_extension(_aki(anchor), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files.write_key(d / ISSUER_KEY, key)
    files.write_file(d / ISSUER_CRT, files.certs_pem([cert]), mode=files.CERT_MODE)
    if copy_ca:
        files.write_file(d / CA_CRT, bundle_pem, mode=files.CERT_MODE)
    return Created(cert=cert, files=(d / ISSUER_CRT, d / ISSUER_KEY, d / CA_CRT))


def _anchor_for(
    key: ec.EllipticCurvePrivateKey, bundle: TrustBundle, key_path: Path
) -> x509.Certificate:
    want = _spki(key.public_key())
    for cert in bundle.anchors:
        if _spki(cert.public_key()) == want:
            return cert
    raise PKIError(str(key_path), f"matches no certificate in {bundle.source}")


def _names_from_root(
    anchor: x509.Certificate, control_ns: str | None, trust_domain: str | None
) -> tuple[str, str]:
    parts = cn(anchor).split(".", 2)
    from_cn = len(parts) == 3 and parts[0] == "root"
    ns = control_ns or (parts[1] if from_cn else DEFAULT_CONTROL_NS)
    td = trust_domain or (parts[2] if from_cn else DEFAULT_TRUST_DOMAIN)
    return check_label("control-plane namespace", ns), check_subdomain("trust domain", td)


def _same_content(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


# --- inspect -------------------------------------------------------------------


def inspect(
    path: str | Path, *, ca: str | Path | None = None, now: datetime | None = None
) -> dict[str, Any]:
    """Describe the first certificate in `path` (further ones are its intermediates).

    Says whether it chains when `ca` is given or a `ca.crt` sits next to it.
    Raises `PKIError` if the file cannot be read or parsed.
    """
    p = Path(path)
    certs = files.read_certs(p)
    cert, when = certs[0], now or _now()
    info = describe(cert)
    info["certificates_in_file"] = len(certs)
    info["valid_now"] = cert.not_valid_before_utc <= when <= cert.not_valid_after_utc
    bundle_path = Path(ca) if ca is not None else p.with_name(CA_CRT)
    if ca is None and not bundle_path.exists():
        info["chains_to"], info["chains"] = None, None
        return info
    info["chains_to"] = str(bundle_path)
    try:
        verify_chain(cert, certs[1:], load_trust_bundle(bundle_path), now=when)
    except PKIError as exc:
        info["chains"], info["chain_error"] = False, str(exc)
    else:
        info["chains"] = True
    return info


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


# --- builders and small helpers ---------------------------------------------------


def _base(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    not_before: datetime,
    not_after: datetime,
) -> x509.CertificateBuilder:
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


def _key_usage(*, signing: bool) -> x509.KeyUsage:
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


def _aki(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(
            issuer.public_key()  # type: ignore[arg-type]
        )
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _spki(key: ec.EllipticCurvePublicKey | Any) -> bytes:
    return bytes(
        key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _now() -> datetime:
    return datetime.now(UTC)
