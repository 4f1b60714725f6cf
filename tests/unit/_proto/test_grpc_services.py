"""The generated servicers and stubs talk over a real gRPC connection on 127.0.0.1.

Each service gets a small servicer registered with the generated
`add_*Servicer_to_server`; clients call it both through the generated stubs and
through raw method paths, which proves the paths are the upstream ones and that
server-streaming methods really stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest
from google.protobuf import timestamp_pb2

from agent._proto import (
    destination_pb2,
    destination_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    inbound_pb2,
    inbound_pb2_grpc,
    net_pb2,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

IP_10_0_0_7 = 0x0A000007


class Destination(destination_pb2_grpc.DestinationServicer):
    async def Get(self, request, _context):  # noqa: N802 - name fixed by the proto
        for port in (8080, 8081):
            yield destination_pb2.Update(
                add=destination_pb2.WeightedAddrSet(
                    addrs=[
                        destination_pb2.WeightedAddr(
                            addr=net_pb2.TcpAddress(
                                ip=net_pb2.IPAddress(ipv4=IP_10_0_0_7), port=port
                            ),
                            weight=10_000,
                        )
                    ],
                    metric_labels={"path": request.path},
                )
            )

    async def GetProfile(self, request, _context):  # noqa: N802
        yield destination_pb2.DestinationProfile(fully_qualified_name=request.path.split(":")[0])
        yield destination_pb2.DestinationProfile(opaque_protocol=True)


class Identity(identity_pb2_grpc.IdentityServicer):
    async def Certify(self, request, _context):  # noqa: N802
        return identity_pb2.CertifyResponse(
            leaf_certificate=b"LEAF for " + request.identity.encode(),
            intermediate_certificates=[b"CA"],
            valid_until=timestamp_pb2.Timestamp(seconds=1_700_000_000),
        )


class Inbound(inbound_pb2_grpc.InboundServerPoliciesServicer):
    def _server(self, request) -> inbound_pb2.Server:
        return inbound_pb2.Server(
            protocol=inbound_pb2.ProxyProtocol(opaque=inbound_pb2.ProxyProtocol.Opaque()),
            labels={"workload": request.workload, "port": str(request.port)},
        )

    async def GetPort(self, request, _context):  # noqa: N802
        return self._server(request)

    async def WatchPort(self, request, _context):  # noqa: N802
        yield self._server(request)
        yield self._server(request)


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    destination_pb2_grpc.add_DestinationServicer_to_server(Destination(), server)
    identity_pb2_grpc.add_IdentityServicer_to_server(Identity(), server)
    inbound_pb2_grpc.add_InboundServerPoliciesServicer_to_server(Inbound(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield chan
    finally:
        await server.stop(None)


GET = destination_pb2.GetDestination(scheme="k8s", path="web.shop.svc.cluster.local:8080")
PORT = inbound_pb2.PortSpec(workload="shop:web-0", port=8080)


async def test_destination_get_streams_updates_through_the_stub(channel):
    stub = destination_pb2_grpc.DestinationStub(channel)
    updates = [u async for u in stub.Get(GET)]
    assert [u.add.addrs[0].addr.port for u in updates] == [8080, 8081]
    assert updates[0].add.addrs[0].addr.ip.ipv4 == IP_10_0_0_7
    assert updates[0].add.metric_labels["path"] == GET.path


async def test_destination_get_profile_streams_on_the_upstream_path(channel):
    call = channel.unary_stream(
        "/io.linkerd.proxy.destination.Destination/GetProfile",
        request_serializer=destination_pb2.GetDestination.SerializeToString,
        response_deserializer=destination_pb2.DestinationProfile.FromString,
    )
    profiles = [p async for p in call(GET)]
    assert profiles[0].fully_qualified_name == "web.shop.svc.cluster.local"
    assert profiles[1].opaque_protocol is True


async def test_identity_certify_is_unary_on_the_upstream_path(channel):
    call = channel.unary_unary(
        "/io.linkerd.proxy.identity.Identity/Certify",
        request_serializer=identity_pb2.CertifyRequest.SerializeToString,
        response_deserializer=identity_pb2.CertifyResponse.FromString,
    )
    reply = await call(identity_pb2.CertifyRequest(identity="web.shop.serviceaccount.identity"))
    assert reply.leaf_certificate == b"LEAF for web.shop.serviceaccount.identity"
    assert list(reply.intermediate_certificates) == [b"CA"]
    assert reply.valid_until.seconds == 1_700_000_000


async def test_inbound_get_port_and_watch_port_through_the_stub(channel):
    stub = inbound_pb2_grpc.InboundServerPoliciesStub(channel)
    server = await stub.GetPort(PORT)
    assert server.protocol.WhichOneof("kind") == "opaque"
    assert dict(server.labels) == {"workload": "shop:web-0", "port": "8080"}
    watched = [s async for s in stub.WatchPort(PORT)]
    assert len(watched) == 2
    assert all(s == server for s in watched)


async def test_inbound_watch_port_streams_on_the_upstream_path(channel):
    call = channel.unary_stream(
        "/io.linkerd.proxy.inbound.InboundServerPolicies/WatchPort",
        request_serializer=inbound_pb2.PortSpec.SerializeToString,
        response_deserializer=inbound_pb2.Server.FromString,
    )
    assert len([s async for s in call(PORT)]) == 2


async def test_misspelled_method_path_is_unimplemented(channel):
    call = channel.unary_unary(
        "/io.linkerd.proxy.inbound.InboundServerPolicies/getPort",
        request_serializer=inbound_pb2.PortSpec.SerializeToString,
        response_deserializer=inbound_pb2.Server.FromString,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(PORT)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
