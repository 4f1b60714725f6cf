"""The operator's PKI files: create the trust anchor and the issuer, inspect a certificate.

These are what `meshagent certs create-root | create-issuer | inspect` run.

Rules:
1. Files go through `agent.identity.files`: keys 0600, certificates 0644, no
   overwrite without `force` (`PKIError` naming the file).
2. A trust anchor is a self-signed CA, pathlen 1, CN `root.<control-ns>.<trust-domain>`.
3. An issuer is a CA, pathlen 0, CN `identity.<control-ns>.<trust-domain>`
   (names taken from the anchor's CN unless given), signed by the anchor
   whose certificate matches `ca.key`; it never outlives that anchor, and
   `ca.crt` is copied next to it.
4. `inspect` describes the first certificate of a file and says whether it
   chains, to `ca` or a sibling `ca.crt`; with neither it does not guess.
5. Time is a parameter (`now`, timezone-aware UTC); it defaults to the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.errors import PKIError
from agent.identity import files
from agent.identity.certs import (
    CA_CRT,
    CA_KEY,
    CLOCK_SKEW_ALLOWANCE,
    ISSUER_CRT,
    ISSUER_KEY,
    ISSUER_LIFETIME,
    ROOT_LIFETIME,
    aki,
    cert_builder,
    describe,
    key_usage,
    spki,
)
from agent.identity.chain import TrustBundle, check_window, cn, load_trust_bundle, verify_chain
from agent.identity.names import (
    DEFAULT_CONTROL_NS,
    DEFAULT_TRUST_DOMAIN,
    check_label,
    check_subdomain,
)

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
    start = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"root.{control_ns}.{trust_domain}")])
    cert = (
        cert_builder(name, name, key.public_key(), start - CLOCK_SKEW_ALLOWANCE, start + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(key_usage(signing=True), critical=True)
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
    start = now or datetime.now(UTC)
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
        cert_builder(
            name, anchor.subject, key.public_key(), start - CLOCK_SKEW_ALLOWANCE, not_after
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(signing=True), critical=True)
        .add_extension(aki(anchor), critical=False)
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
    want = spki(key.public_key())
    for cert in bundle.anchors:
        if spki(cert.public_key()) == want:
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
    cert, when = certs[0], now or datetime.now(UTC)
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
