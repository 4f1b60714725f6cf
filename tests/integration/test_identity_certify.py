"""Identity.Certify over real gRPC on 127.0.0.1: a proxy's request, end to end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification

from agent._proto import identity_pb2, identity_pb2_grpc
from agent.controlplane import tokens
from agent.controlplane.identity_service import IdentityService, register
from agent.identity import ca
from agent.identity.csr import make_csr, new_key
from agent.identity.names import Identity

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.privileged

WEB = Identity(sa="web", ns="shop")


@pytest.fixture
def mesh(tmp_path):
    ca.create_root(tmp_path / "root")
    ca.create_issuer(tmp_path / "identity", tmp_path / "root")
    return tmp_path


@pytest.fixture
async def served(mesh) -> AsyncIterator[dict]:
    service = IdentityService(
        verifier=tokens.validator(tokens.signing_key(mesh / "identity")),
        issuer=ca.load_issuer(mesh / "identity"),
    )
    server = grpc.aio.server()
    register(server, service)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield {"stub": identity_pb2_grpc.IdentityStub(chan), "service": service, "dir": mesh}
    finally:
        await server.stop(None)


def _token(mesh, ns="shop", sa="web", **kwargs) -> bytes:
    kwargs.setdefault("now", datetime.now(UTC))
    return tokens.mint(mesh / "identity", ns, sa, **kwargs).encode()


def _request(mesh, **overrides) -> identity_pb2.CertifyRequest:
    fields = {
        "identity": WEB.dns_name,
        "token": _token(mesh),
        "certificate_signing_request": make_csr(new_key(), WEB),
    }
    fields.update(overrides)
    return identity_pb2.CertifyRequest(**fields)


async def _refused(served, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await served["stub"].Certify(request)
    return info.value


async def test_certify_signs_a_leaf_that_chains_to_ca_crt(served):
    mesh = served["dir"]
    key = new_key()
    request = _request(mesh, certificate_signing_request=make_csr(key, WEB))
    before = datetime.now(UTC)
    response = await served["stub"].Certify(request)

    leaf = x509.load_der_x509_certificate(response.leaf_certificate)
    inter = [x509.load_der_x509_certificate(c) for c in response.intermediate_certificates]
    assert leaf.public_key() == key.public_key()
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [WEB.dns_name]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [WEB.spiffe_uri]
    assert [c.subject.rfc4514_string() for c in inter] == ["CN=identity.linkerd.cluster.local"]

    valid_until = response.valid_until.ToDatetime(tzinfo=UTC)
    assert valid_until == leaf.not_valid_after_utc
    assert abs(valid_until - (before + timedelta(hours=24))) < timedelta(minutes=1)

    bundle = ca.load_trust_bundle(mesh / "root" / "ca.crt")
    ca.verify_chain(leaf, inter, bundle, now=datetime.now(UTC))
    # and independently, with cryptography's RFC 5280 verifier
    store = verification.Store(list(bundle.anchors))
    verified = verification.PolicyBuilder().store(store).build_client_verifier().verify(leaf, inter)
    assert verified.chain[-1] == bundle.anchors[0]


async def test_certify_accepts_a_pem_csr(served):
    csr = x509.load_der_x509_csr(make_csr(new_key(), WEB)).public_bytes(serialization.Encoding.PEM)
    response = await served["stub"].Certify(
        _request(served["dir"], certificate_signing_request=csr)
    )
    assert response.leaf_certificate


@pytest.mark.parametrize(
    ("case", "code", "needle"),
    [
        ("missing-identity", grpc.StatusCode.INVALID_ARGUMENT, "missing identity"),
        ("missing-token", grpc.StatusCode.INVALID_ARGUMENT, "missing token"),
        ("missing-csr", grpc.StatusCode.INVALID_ARGUMENT, "missing certificate"),
        ("garbage-csr", grpc.StatusCode.INVALID_ARGUMENT, "unparsable"),
        ("csr-other-identity", grpc.StatusCode.FAILED_PRECONDITION, "identity mismatch"),
        ("malformed-token", grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
        ("expired-token", grpc.StatusCode.FAILED_PRECONDITION, "expired"),
        ("foreign-token", grpc.StatusCode.FAILED_PRECONDITION, "bad signature"),
        ("wrong-audience", grpc.StatusCode.FAILED_PRECONDITION, "wrong audience"),
        ("token-other-sa", grpc.StatusCode.FAILED_PRECONDITION, "did not match provided token"),
    ],
)
async def test_each_refusal_returns_its_status(served, case, code, needle):
    mesh = served["dir"]
    now = datetime.now(UTC)
    api = Identity(sa="api", ns="shop")
    overrides = {
        "missing-identity": {"identity": ""},
        "missing-token": {"token": b""},
        "missing-csr": {"certificate_signing_request": b""},
        "garbage-csr": {"certificate_signing_request": b"\x30\x03\x02\x01\x00"},
        "csr-other-identity": {"certificate_signing_request": make_csr(new_key(), api)},
        "malformed-token": {"token": b"definitely.not-a.jwt!"},
        "expired-token": {"token": _token(mesh, now=now - timedelta(days=2))},
        "foreign-token": {
            "token": tokens.encode(new_key(), tokens.token_claims("shop", "web", now=now)).encode()
        },
        "wrong-audience": {"token": _token(mesh, audience=("kubernetes",))},
        "token-other-sa": {"token": _token(mesh, sa="api")},
    }[case]
    err = await _refused(served, _request(mesh, **overrides))
    assert err.code() == code
    assert needle in err.details()


async def test_without_an_issuer_certify_is_unavailable_until_one_is_set(served):
    served["service"].set_issuer(None)
    err = await _refused(served, _request(served["dir"]))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    served["service"].set_issuer(ca.load_issuer(served["dir"] / "identity"))
    assert (await served["stub"].Certify(_request(served["dir"]))).leaf_certificate
