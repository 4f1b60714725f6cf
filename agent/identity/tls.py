"""TLS 1.3 contexts for the data path, built from in-memory credentials.

Rules:
1. TLS 1.3 only, both directions; both sides present a certificate and verify
   the peer's chain against the trust bundle (mutual TLS).
2. Hostname checking is off: a peer is named by its identity, the single DNS
   SAN of its verified certificate (`peer_identity`), which the caller
   compares with the identity it expects (DESIGN.md: endpoint `tls_identity`).
3. The private key never reaches a filesystem, and is never in the clear
   outside this process's memory. Python's `ssl` loads keys only from a path,
   so we write the certificate chain and the key, encrypted with a random
   one-time password (PEM, BestAvailableEncryption), into an anonymous memory
   file (`os.memfd_create`), hand OpenSSL `/proc/self/fd/N`, and close the
   descriptor right after loading. We chose the memfd over a private tmp dir
   because a memfd has no name in any filesystem, cannot outlive the process
   and needs no cleanup on crash; the encryption is a second wall against a
   same-user process reading our fds through /proc.
4. Workers get the key already sealed (`SealedKey`: encrypted PEM and its
   one-time password, made by the supervisor with `seal`), so a worker
   process never loads the cryptography package (about 8 MB of RSS each):
   cryptography is imported only where a key object is turned into PEM.
"""

from __future__ import annotations

import os
import secrets
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agent.errors import PKIError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cryptography.hazmat.primitives.asymmetric import ec


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedKey:
    """A private key as encrypted PKCS#8 PEM and the one-time password that opens it."""

    pem: bytes = field(repr=False)
    password: bytes = field(repr=False)


def seal(key: ec.EllipticCurvePrivateKey) -> SealedKey:
    """`key` as encrypted PKCS#8 PEM under a fresh random password (rule 3)."""
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - rule 4

    password = secrets.token_bytes(32)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password),
    )
    return SealedKey(pem=pem, password=password)


def chain_pem(leaf_der: bytes, intermediates_der: Sequence[bytes] = ()) -> bytes:
    """PEM of a leaf followed by its intermediates (what `load_cert_chain` wants)."""
    return "".join(ssl.DER_cert_to_PEM_cert(d) for d in (leaf_der, *intermediates_der)).encode()


def client_context(
    cert_chain_pem: bytes, key: ec.EllipticCurvePrivateKey | SealedKey, bundle_pem: bytes
) -> ssl.SSLContext:
    """A TLS 1.3 client context that presents our certificate and verifies the server's.

    The caller checks `peer_identity(ssl_object)` against the expected identity.
    Raises `PKIError` if the credentials cannot be loaded.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # identity is checked by DNS SAN, see `peer_identity`
    return _setup(ctx, cert_chain_pem, key, bundle_pem)


def server_context(
    cert_chain_pem: bytes, key: ec.EllipticCurvePrivateKey | SealedKey, bundle_pem: bytes
) -> ssl.SSLContext:
    """A TLS 1.3 server context that requires and verifies a client certificate.

    Raises `PKIError` if the credentials cannot be loaded.
    """
    return _setup(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert_chain_pem, key, bundle_pem)


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> str | None:
    """The DNS SAN of the peer's verified certificate, or None.

    None when there is no verified peer certificate or it does not name
    exactly one DNS identity (an ambiguous identity is no identity).
    """
    cert = ssl_object.getpeercert()
    if not cert:
        return None
    sans = cert.get("subjectAltName", ())
    dns = [str(entry[1]) for entry in sans if isinstance(entry, tuple) and entry[0] == "DNS"]
    return dns[0] if len(dns) == 1 else None


def _setup(
    ctx: ssl.SSLContext,
    cert_chain_pem: bytes,
    key: ec.EllipticCurvePrivateKey | SealedKey,
    bundle_pem: bytes,
) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cadata=bundle_pem.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise PKIError("<trust bundle>", f"cannot load: {exc}") from exc
    _load_cert_chain(ctx, cert_chain_pem, key)
    return ctx


def _load_cert_chain(
    ctx: ssl.SSLContext, cert_chain_pem: bytes, key: ec.EllipticCurvePrivateKey | SealedKey
) -> None:
    sealed = key if isinstance(key, SealedKey) else seal(key)
    encrypted, password = sealed.pem, sealed.password
    fd = os.memfd_create("meshagent-credentials", os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        data = memoryview(cert_chain_pem.rstrip(b"\n") + b"\n" + encrypted)
        while data:
            data = data[os.write(fd, data) :]
        ctx.load_cert_chain(f"/proc/self/fd/{fd}", password=password)
    except ssl.SSLError as exc:
        raise PKIError("<certificate chain>", f"cannot load with its key: {exc}") from exc
    finally:
        os.close(fd)
