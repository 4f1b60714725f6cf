"""`io.linkerd.proxy.identity.Identity/Certify` over `certify()` (grpc.aio shell).

Rules:
1. The decision is `agent.controlplane.certify.certify`; this shell reads the
   clock, converts protobuf <-> bytes, and turns a `Refusal` into a gRPC
   status (`context.abort`), one log line per request.
2. Wire encoding as Linkerd's identity service really uses it (its Go code
   parses the CSR with `x509.ParseCertificateRequest` and answers
   `Crt.ExtractRaw()`): the CSR is DER (PEM also accepted), the leaf and the
   intermediates are DER, issuer first. The proto comments saying "PEM" are
   upstream's and do not match the wire.
3. The issuer can be swapped at run time (`set_issuer`), e.g. after the
   issuer secret rotates; requests see either the old or the new one.
4. Never log tokens, CSRs or keys; the identity and the refusal are enough.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import grpc
from google.protobuf import timestamp_pb2

from agent._proto import identity_pb2, identity_pb2_grpc
from agent.controlplane.certify import Refusal, TokenValidator, certify
from agent.identity.ca import CLOCK_SKEW_ALLOWANCE, ISSUANCE_LIFETIME

if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.identity.ca import Issuer

logger = logging.getLogger(__name__)

SERVICE = "io.linkerd.proxy.identity.Identity"


def _utcnow() -> datetime:
    return datetime.now(UTC)


class IdentityService(identity_pb2_grpc.IdentityServicer):
    """The Identity gRPC service of the embedded control plane."""

    def __init__(
        self,
        *,
        verifier: TokenValidator,
        issuer: Issuer | None,
        lifetime: timedelta = ISSUANCE_LIFETIME,
        skew: timedelta = CLOCK_SKEW_ALLOWANCE,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self._verifier = verifier
        self._issuer = issuer
        self._lifetime = lifetime
        self._skew = skew
        self._clock = clock

    def set_issuer(self, issuer: Issuer | None) -> None:
        """Use `issuer` for the following requests."""
        self._issuer = issuer

    async def Certify(  # noqa: N802 - the gRPC method name
        self, request: identity_pb2.CertifyRequest, context: grpc.aio.ServicerContext
    ) -> identity_pb2.CertifyResponse:
        """Sign a leaf for the request, or abort with the refusal's status."""
        outcome = certify(
            identity=request.identity,
            token=request.token,
            csr=request.certificate_signing_request,
            verifier=self._verifier,
            issuer=self._issuer,
            now=self._clock(),
            lifetime=self._lifetime,
            skew=self._skew,
        )
        if isinstance(outcome, Refusal):
            logger.info(
                "certify refused",
                extra={"identity": request.identity, "code": outcome.code, "why": outcome.message},
            )
            await context.abort(grpc.StatusCode[outcome.code], outcome.message)
            return identity_pb2.CertifyResponse()  # pragma: no cover - abort raises
        valid_until = timestamp_pb2.Timestamp()
        valid_until.FromDatetime(outcome.valid_until)
        logger.info(
            "certified",
            extra={"identity": outcome.identity, "valid_until": outcome.valid_until.isoformat()},
        )
        return identity_pb2.CertifyResponse(
            leaf_certificate=outcome.leaf_der,
            intermediate_certificates=list(outcome.intermediates_der),
            valid_until=valid_until,
        )


def register(server: grpc.aio.Server, service: IdentityService) -> None:
    """Add `service` to `server` under `io.linkerd.proxy.identity.Identity`."""
    identity_pb2_grpc.add_IdentityServicer_to_server(service, server)
