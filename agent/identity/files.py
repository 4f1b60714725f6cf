"""Reading and writing PEM files for the PKI tooling.

Rules:
1. Private keys are written with mode 0600, through a temporary file in the
   same directory that is created 0600 and renamed into place, so no reader
   ever sees a key with wider permissions or half written.
2. Nothing existing is overwritten unless `force` is given; the refusal names
   the file and the flag.
3. Every failure is a `PKIError(path, reason)`.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import PKIError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

KEY_MODE = 0o600
CERT_MODE = 0o644
DIR_MODE = 0o700


def refuse_existing(paths: Iterable[Path], *, force: bool) -> None:
    """Raise `PKIError` for the first of `paths` that exists, unless `force`."""
    if force:
        return
    for path in paths:
        if path.exists():
            raise PKIError(str(path), "already exists; refusing to overwrite (use --force)")


def write_file(path: Path, data: bytes, *, mode: int) -> None:
    """Write `data` to `path` atomically, the file never having a wider `mode`."""
    if path.parent.exists() and not path.parent.is_dir():
        raise PKIError(str(path.parent), "not a directory")
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise PKIError(
            str(path.parent), f"cannot make the directory: {exc.strerror or exc}"
        ) from exc
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)  # the umask may have narrowed it
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise PKIError(str(path), f"cannot write: {exc.strerror or exc}") from exc


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Unencrypted SEC 1 PEM (`EC PRIVATE KEY`), the form `step` and Linkerd use."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write `key` as PEM with mode 0600."""
    write_file(path, key_pem(key), mode=KEY_MODE)


def certs_pem(certs: Iterable[x509.Certificate]) -> bytes:
    """Concatenated PEM of `certs`."""
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def read_bytes(path: Path) -> bytes:
    """The file's bytes, or `PKIError` saying why not."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PKIError(str(path), "missing") from None
    except OSError as exc:
        raise PKIError(str(path), f"cannot read: {exc.strerror or exc}") from exc


def parse_certs(data: bytes, where: str) -> list[x509.Certificate]:
    """All certificates in PEM `data` (or one DER certificate); at least one."""
    try:
        if b"-----BEGIN" in data:
            certs = x509.load_pem_x509_certificates(data)
        else:
            certs = [x509.load_der_x509_certificate(data)]
    except ValueError as exc:
        raise PKIError(where, f"not a certificate: {exc}") from exc
    if not certs:
        raise PKIError(where, "holds no certificate")
    return certs


def read_certs(path: Path) -> list[x509.Certificate]:
    """All certificates in the PEM file at `path`."""
    return parse_certs(read_bytes(path), str(path))


def parse_key(data: bytes, where: str) -> ec.EllipticCurvePrivateKey:
    """An unencrypted ECDSA private key from PEM (SEC 1 or PKCS#8) or DER."""
    try:
        if b"-----BEGIN" in data:
            key = serialization.load_pem_private_key(data, password=None)
        else:
            key = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise PKIError(where, f"not an unencrypted private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(where, f"{type(key).__name__} is not an ECDSA key")
    return key


def read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """The ECDSA private key in the file at `path`."""
    return parse_key(read_bytes(path), str(path))
