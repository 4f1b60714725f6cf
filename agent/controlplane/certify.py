"""The decision of Identity.Certify (pure: no I/O, no logging, time is a parameter).

A proxy sends its identity, its service-account token and a CSR; we sign a
leaf for the CSR's key only if the token proves that identity. Steps and
status codes follow Linkerd's identity service (linkerd2
`pkg/identity/service.go`), so proxies see the errors they know:

    step                                          refusal code
    identity, token or CSR missing                INVALID_ARGUMENT
    no issuer loaded                              UNAVAILABLE
    issuer path not valid now                     UNAVAILABLE   (Linkerd: a bare error)
    CSR does not parse                            INVALID_ARGUMENT
    CSR key/signature/names wrong                 FAILED_PRECONDITION
    token malformed (Linkerd's InvalidToken)      INVALID_ARGUMENT
    token not authentic: signature, expiry,       FAILED_PRECONDITION
      audience (Linkerd's NotAuthenticated)
    token names another identity                  FAILED_PRECONDITION
    signing fails                                 INTERNAL

Linkerd answers UNAUTHENTICATED for none of these; we keep its codes.
Codes are gRPC status code names (`grpc.StatusCode[code]`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from agent.controlplane.tokens import TokenError, TokenReason
from agent.errors import PKIError
from agent.identity.ca import CLOCK_SKEW_ALLOWANCE, ISSUANCE_LIFETIME, Issuer
from agent.identity.csr import CSRError, CSRInfo, CSRReason, check_csr
from agent.identity.names import Identity, IdentityNameError

INVALID_ARGUMENT = "INVALID_ARGUMENT"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"

TokenValidator = Callable[[bytes, datetime], Identity]
"""Token bytes and now -> the identity the token proves; raises `TokenError`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Certified:
    """A signed leaf: DER leaf, DER intermediates (issuer first), expiry."""

    identity: str
    leaf_der: bytes
    intermediates_der: tuple[bytes, ...]
    valid_until: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A refused request: a gRPC status code name and why."""

    code: str
    message: str


class _Refused(Exception):  # noqa: N818 - internal control flow, never escapes
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.refusal = Refusal(code=code, message=message)


def certify(  # noqa: PLR0913 - the request fields and the service's state
    *,
    identity: str,
    token: bytes,
    csr: bytes,
    verifier: TokenValidator,
    issuer: Issuer | None,
    now: datetime,
    lifetime: timedelta = ISSUANCE_LIFETIME,
    skew: timedelta = CLOCK_SKEW_ALLOWANCE,
) -> Certified | Refusal:
    """Decide one Certify request (see the module table for refusals)."""
    try:
        _check_present(identity=identity, token=token, csr=csr)
        usable = _usable_issuer(issuer, now)
        info = _checked_csr(csr, identity)
        proven = _proven_identity(verifier, token, now, requested=identity)
        try:
            leaf, chain, valid_until = usable.sign_leaf(
                info, proven, now=now, lifetime=lifetime, skew=skew
            )
        except PKIError as exc:
            raise _Refused(INTERNAL, f"signing failed: {exc}") from exc
    except _Refused as refused:
        return refused.refusal
    return Certified(
        identity=identity, leaf_der=leaf, intermediates_der=tuple(chain), valid_until=valid_until
    )


def _check_present(*, identity: str, token: bytes, csr: bytes) -> None:
    if not identity:
        raise _Refused(INVALID_ARGUMENT, "missing identity")
    if not token:
        raise _Refused(INVALID_ARGUMENT, "missing token")
    if not csr:
        raise _Refused(INVALID_ARGUMENT, "missing certificate signing request")


def _usable_issuer(issuer: Issuer | None, now: datetime) -> Issuer:
    if issuer is None:
        raise _Refused(UNAVAILABLE, "cert issuer not ready yet")
    try:
        issuer.check(now)
    except PKIError as exc:
        raise _Refused(UNAVAILABLE, f"issuer not valid: {exc}") from exc
    return issuer


def _checked_csr(csr: bytes, identity: str) -> CSRInfo:
    try:
        return check_csr(csr, identity)
    except CSRError as exc:
        code = INVALID_ARGUMENT if exc.reason is CSRReason.UNPARSABLE else FAILED_PRECONDITION
        raise _Refused(code, str(exc)) from exc


def _proven_identity(
    verifier: TokenValidator, token: bytes, now: datetime, *, requested: str
) -> Identity:
    try:
        proven = verifier(token, now)
    except TokenError as exc:
        code = INVALID_ARGUMENT if exc.reason is TokenReason.MALFORMED else FAILED_PRECONDITION
        raise _Refused(code, str(exc)) from exc
    except IdentityNameError as exc:
        raise _Refused(INVALID_ARGUMENT, f"token names no valid identity: {exc}") from exc
    if proven.dns_name != requested:
        raise _Refused(
            FAILED_PRECONDITION,
            "requested identity did not match provided token: "
            f"requested={requested}; found={proven.dns_name}",
        )
    return proven
