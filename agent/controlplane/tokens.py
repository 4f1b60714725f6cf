"""Service-account tokens of the embedded control plane (manifests mode).

With no Kubernetes API server to run a TokenReview, the embedded control
plane mints and checks its own tokens. They look like Kubernetes projected
service-account tokens (what a Linkerd proxy sends to Identity.Certify):
a compact JWS, here signed ES256, with

    iss  https://kubernetes.default.svc.cluster.local
    sub  system:serviceaccount:NS:SA
    aud  ["identity.l5d.io"]
    iat, nbf, exp, jti
    kubernetes.io: {namespace, serviceaccount: {name, uid}[, pod: {name, uid}]}

Rules:
1. Only the key in `<identity dir>/token-signing.key` (0600, created on first
   use) mints tokens that verify; `verify` accepts no other algorithm than
   ES256 (no `none`, no HMAC confusion).
2. `verify` checks, in order: shape, signature, time, audience, subject; a
   failure is a `TokenError` whose `TokenReason` says which.
3. Tokens are secrets: never log them.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
import re
import secrets
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from agent.errors import AgentError, PKIError
from agent.identity import files
from agent.identity.names import (
    DEFAULT_CONTROL_NS,
    DEFAULT_TRUST_DOMAIN,
    Identity,
    IdentityNameError,
    check_label,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

AUDIENCE = "identity.l5d.io"
ISSUER = "https://kubernetes.default.svc.cluster.local"
SIGNING_KEY = "token-signing.key"
TOKEN_LIFETIME = timedelta(hours=24)  # Linkerd's projected token: expirationSeconds 86400
_P256_BYTES = 32
_B64URL = re.compile(r"[A-Za-z0-9_-]*")

Key = ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey


class TokenReason(enum.Enum):
    """Why a token was refused."""

    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad signature"
    EXPIRED = "expired"
    NOT_YET_VALID = "not yet valid"
    WRONG_AUDIENCE = "wrong audience"


class TokenError(AgentError):
    """A service-account token was refused."""

    def __init__(self, reason: TokenReason, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"token refused ({reason.value}): {detail}")


# --- keys ----------------------------------------------------------------------------


def signing_key(identity_dir: str | Path) -> ec.EllipticCurvePrivateKey:
    """The token-signing key in `identity_dir`, created (0600) if missing.

    Raises `PKIError` if it exists but cannot be read or is not ECDSA P-256.
    """
    path = Path(identity_dir) / SIGNING_KEY
    if path.exists():
        key = files.read_key(path)
        if not isinstance(key.curve, ec.SECP256R1):
            raise PKIError(str(path), "token-signing key is not ECDSA P-256")
        return key
    key = ec.generate_private_key(ec.SECP256R1())
    files.write_key(path, key)
    return key


def key_id(key: Key) -> str:
    """The `kid` header: base64url SHA-256 of the public key (as Kubernetes does)."""
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    der = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return _b64(hashlib.sha256(der).digest())


# --- minting -------------------------------------------------------------------------


def mint(  # noqa: PLR0913 - keyword-only claim settings
    identity_dir: str | Path,
    ns: str,
    sa: str,
    *,
    now: datetime,
    lifetime: timedelta = TOKEN_LIFETIME,
    audience: tuple[str, ...] = (AUDIENCE,),
    pod: Mapping[str, str] | None = None,
) -> str:
    """A token for service account `ns/sa`, signed by the identity dir's key."""
    claims = token_claims(ns, sa, now=now, lifetime=lifetime, audience=audience, pod=pod)
    return encode(signing_key(identity_dir), claims)


def token_claims(  # noqa: PLR0913 - keyword-only claim settings
    ns: str,
    sa: str,
    *,
    now: datetime,
    lifetime: timedelta = TOKEN_LIFETIME,
    audience: tuple[str, ...] = (AUDIENCE,),
    pod: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The claims of a projected service-account token for `ns/sa`."""
    check_label("namespace", ns)
    check_label("service account", sa)
    iat = int(now.timestamp())
    k8s: dict[str, Any] = {
        "namespace": ns,
        "serviceaccount": {"name": sa, "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"sa/{ns}/{sa}"))},
    }
    if pod is not None:
        k8s["pod"] = {"name": pod["name"], "uid": pod.get("uid", "")}
    return {
        "aud": list(audience),
        "exp": iat + int(lifetime.total_seconds()),
        "iat": iat,
        "iss": ISSUER,
        "jti": str(uuid.UUID(bytes=secrets.token_bytes(16), version=4)),
        "kubernetes.io": k8s,
        "nbf": iat,
        "sub": f"system:serviceaccount:{ns}:{sa}",
    }


def encode(key: ec.EllipticCurvePrivateKey, claims: Mapping[str, Any]) -> str:
    """A compact JWS (ES256) of `claims`."""
    header = {"alg": "ES256", "kid": key_id(key), "typ": "JWT"}
    signing_input = f"{_b64(_json(header))}.{_b64(_json(claims))}"
    der = key.sign(signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256()))
    r, s = decode_dss_signature(der)
    raw = r.to_bytes(_P256_BYTES, "big") + s.to_bytes(_P256_BYTES, "big")
    return f"{signing_input}.{_b64(raw)}"


# --- verifying -----------------------------------------------------------------------


def verify(
    token: str | bytes, key: Key, *, audience: str = AUDIENCE, now: datetime
) -> tuple[str, str]:
    """Check `token` against `key` and return its `(namespace, service account)`.

    Raises `TokenError` (MALFORMED, BAD_SIGNATURE, EXPIRED, NOT_YET_VALID,
    WRONG_AUDIENCE).
    """
    header, claims, signing_input, signature = _split(token)
    if header.get("alg") != "ES256":
        raise TokenError(TokenReason.BAD_SIGNATURE, f"alg {header.get('alg')!r} is not ES256")
    _check_signature(key, signing_input, signature)
    _check_times(claims, now)
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if audience not in auds:
        raise TokenError(TokenReason.WRONG_AUDIENCE, f"audience {aud!r} lacks {audience!r}")
    return _subject(claims)


def validator(
    key: Key,
    *,
    audience: str = AUDIENCE,
    control_ns: str = DEFAULT_CONTROL_NS,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
) -> Callable[[bytes, datetime], Identity]:
    """A token validator for `certify`: token bytes -> the mesh `Identity` it proves."""

    def validate(token: bytes, now: datetime) -> Identity:
        ns, sa = verify(token, key, audience=audience, now=now)
        return Identity(sa=sa, ns=ns, control_ns=control_ns, trust_domain=trust_domain)

    return validate


def _split(token: str | bytes) -> tuple[dict[str, Any], dict[str, Any], bytes, bytes]:
    try:
        text = token.decode("ascii") if isinstance(token, bytes) else token
    except UnicodeDecodeError:
        raise TokenError(TokenReason.MALFORMED, "not ASCII") from None
    parts = text.strip().split(".")
    if len(parts) != 3:
        raise TokenError(TokenReason.MALFORMED, f"{len(parts)} dot-separated parts, want 3")
    header = _json_part(parts[0], "header")
    claims = _json_part(parts[1], "claims")
    signature = _unb64(parts[2], "signature")
    return header, claims, f"{parts[0]}.{parts[1]}".encode("ascii"), signature


def _check_signature(key: Key, signing_input: bytes, signature: bytes) -> None:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    if len(signature) != 2 * _P256_BYTES:
        raise TokenError(TokenReason.BAD_SIGNATURE, f"{len(signature)}-byte signature, want 64")
    r = int.from_bytes(signature[:_P256_BYTES], "big")
    s = int.from_bytes(signature[_P256_BYTES:], "big")
    try:
        public.verify(encode_dss_signature(r, s), signing_input, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise TokenError(TokenReason.BAD_SIGNATURE, "not signed by the token-signing key") from None


def _check_times(claims: Mapping[str, Any], now: datetime) -> None:
    exp, nbf, at = claims.get("exp"), claims.get("nbf", claims.get("iat", 0)), now.timestamp()
    if not isinstance(exp, int | float) or not isinstance(nbf, int | float):
        raise TokenError(TokenReason.MALFORMED, "exp (required), nbf and iat must be numbers")
    if isinstance(exp, bool) or isinstance(nbf, bool):
        raise TokenError(TokenReason.MALFORMED, "exp, nbf and iat must be numbers, not booleans")
    if at >= exp:
        raise TokenError(TokenReason.EXPIRED, f"expired {int(at - exp)} s ago")
    if at < nbf:
        raise TokenError(TokenReason.NOT_YET_VALID, f"valid only in {int(nbf - at)} s")


def _subject(claims: Mapping[str, Any]) -> tuple[str, str]:
    sub = claims.get("sub")
    parts = sub.split(":") if isinstance(sub, str) else []
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
        raise TokenError(TokenReason.MALFORMED, f"sub {sub!r} is not system:serviceaccount:NS:SA")
    ns, sa = parts[2], parts[3]
    try:
        check_label("namespace", ns)
        check_label("service account", sa)
    except IdentityNameError as exc:
        raise TokenError(TokenReason.MALFORMED, str(exc)) from None
    k8s = claims.get("kubernetes.io")
    if isinstance(k8s, dict):
        sa_claim = k8s.get("serviceaccount")
        name = sa_claim.get("name") if isinstance(sa_claim, dict) else None
        if k8s.get("namespace") != ns or name != sa:
            raise TokenError(TokenReason.MALFORMED, "kubernetes.io claims disagree with sub")
    return ns, sa


def _json_part(part: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(_unb64(part, what))
    except (ValueError, RecursionError):
        raise TokenError(TokenReason.MALFORMED, f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise TokenError(TokenReason.MALFORMED, f"{what} is not a JSON object")
    return value


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(part: str, what: str) -> bytes:
    if not _B64URL.fullmatch(part):
        raise TokenError(TokenReason.MALFORMED, f"{what} is not unpadded base64url")
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError):
        raise TokenError(TokenReason.MALFORMED, f"{what} is not base64url") from None


def _json(value: Mapping[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
