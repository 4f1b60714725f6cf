"""ControlPlaneClient and IdentityManager vs the embedded control plane, gRPC on 127.0.0.1.

Streams receive updates and follow changes; a control plane that goes away
leaves the last state served and is reconnected to when it returns; the
identity manager certifies against the real Identity servicer and renews.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc
import pytest
from cryptography import x509

from agent import aio
from agent._proto import destination_pb2 as dpb
from agent._proto import (
    destination_pb2_grpc,
    inbound_pb2,
    inbound_pb2_grpc,
    net_pb2,
)
from agent.config import ControlPlaneSettings
from agent.control.cache import DestinationKey, StateCache
from agent.control.client import (
    Backoff,
    ContextToken,
    ControlPlaneClient,
    ControlPlaneError,
    StreamState,
)
from agent.control.tokens import minting_source
from agent.controlplane.app import ControlPlane
from agent.identity import ca, tls
from agent.identity.chain import load_trust_bundle
from agent.identity.csr import make_csr, new_key
from agent.identity.manager import IdentityManager
from agent.identity.names import Identity
from agent.policy.authorize import Facts, Reason, authorize
from agent.policy.model import Meta
from agent.proxy.model import ProtocolHint

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.privileged

WEB_ID = "web.shop.serviceaccount.identity.linkerd.cluster.local"
WEB_SVC = "web.shop.svc.cluster.local:8080"

NAMESPACE = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: web, namespace: shop}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports: [{name: http, port: 8080, targetPort: http}]
"""


def pod(name: str, ip: str) -> str:
    return f"""\
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, labels: {{app: web}}}}
spec:
  serviceAccountName: web
  nodeName: node-a
  containers: [{{name: c, ports: [{{name: http, containerPort: 8080}}]}}]
status:
  phase: Running
  podIP: "{ip}"
  conditions: [{{type: Ready, status: "True"}}]
"""


async def eventually(predicate, within: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    pytest.fail(f"{what} not reached within {within} s")


@pytest.fixture
def mesh(tmp_path) -> Path:
    ca.create_root(tmp_path / "root")
    ca.create_issuer(tmp_path / "identity", tmp_path / "root")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "shop.yaml").write_text(NAMESPACE)
    (manifests / "web-1.yaml").write_text(pod("web-1", "10.0.0.1"))
    return tmp_path


@pytest.fixture
async def plane(mesh) -> AsyncIterator[dict]:
    settings = ControlPlaneSettings(
        manifests=mesh / "manifests",
        identity_dir=mesh / "identity",
        bind="127.0.0.1",
        destination_port=0,
        identity_port=0,
        policy_port=0,
        issuance_lifetime=3.0,
        clock_skew=0.0,
        shutdown_grace=0.2,
        poll_interval=0.05,
    )
    state = {"cp": ControlPlane(settings), "settings": settings}
    await state["cp"].start()
    ports = state["cp"].ports
    state["settings"] = replace(
        settings,
        destination_port=ports["destination"],
        identity_port=ports["identity"],
        policy_port=ports["policy"],
    )
    state["addrs"] = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    try:
        yield state
    finally:
        if state["cp"] is not None:
            await state["cp"].stop(grace=0)


@pytest.fixture
async def client(plane) -> AsyncIterator[ControlPlaneClient]:
    c = ControlPlaneClient(
        **plane["addrs"],
        context=ContextToken(ns="shop", node_name="node-a", pod="web-1"),
        cache=StateCache(),
        backoff=Backoff(base_s=0.05, cap_s=0.4),
    )
    try:
        yield c
    finally:
        await c.close()


def endpoint_ips(client: ControlPlaneClient) -> list[str]:
    s = client.cache.endpoints(DestinationKey(WEB_SVC))
    return [] if s is None else [e.addr[0] for e in s.endpoints]


async def test_streams_deliver_endpoints_profile_and_policy_and_follow_changes(plane, client, mesh):
    changes: list = []
    client.cache.on_change = lambda key, _value: changes.append(key)
    dkey = client.watch_destination(WEB_SVC)
    assert client.watch_destination(WEB_SVC) == dkey  # one stream per key
    pkey = client.watch_profile(WEB_SVC)
    qkey = client.watch_policy("shop", "web-1", 8080)

    await eventually(lambda: endpoint_ips(client) == ["10.0.0.1"], what="first endpoint")
    (ep,) = client.cache.endpoints(dkey).endpoints
    assert ep.addr == ("10.0.0.1", 8080)
    assert ep.tls_identity == WEB_ID
    assert ep.protocol_hint is ProtocolHint.H2
    assert ep.labels["pod"] == "web-1"
    assert ep.labels["service"] == "web"

    profile = await eventually(lambda: client.cache.profile(pkey), what="profile")
    assert profile.fqn == "web.shop.svc.cluster.local"
    assert profile.retry_budget is not None

    policy = await eventually(lambda: client.cache.policy(qkey), what="policy")
    assert policy.valid
    assert policy.meta == Meta(name="all-unauthenticated")

    (mesh / "manifests" / "web-2.yaml").write_text(pod("web-2", "10.0.0.2"))
    await eventually(
        lambda: endpoint_ips(client) == ["10.0.0.1", "10.0.0.2"], what="second endpoint"
    )
    assert {s.key: s.state for s in client.streams()} == {
        dkey: StreamState.LIVE,
        pkey: StreamState.LIVE,
        qkey: StreamState.LIVE,
    }
    assert {dkey, pkey, qkey} <= set(changes)
    assert client.reconnects == 0

    client.unwatch(dkey)
    assert client.cache.endpoints(dkey) is None
    assert {s.key for s in client.streams()} == {pkey, qkey}


async def test_control_plane_going_away_keeps_last_state_and_reconnects(plane, client, mesh):
    dkey = client.watch_destination(WEB_SVC)
    qkey = client.watch_policy("shop", "web-1", 8080)
    await eventually(lambda: endpoint_ips(client) == ["10.0.0.1"], what="first endpoint")
    await eventually(lambda: client.cache.policy(qkey), what="policy")

    await plane["cp"].stop(grace=0)
    plane["cp"] = None
    await eventually(
        lambda: all(s.state is not StreamState.LIVE for s in client.streams()), what="streams down"
    )
    await asyncio.sleep(0.5)  # several failed reconnects while nobody listens
    assert endpoint_ips(client) == ["10.0.0.1"]  # last state still served
    assert client.cache.policy(qkey).valid
    assert client.reconnects >= 4
    assert all(s.last_error for s in client.streams())

    # While down, web-1 goes and web-2 comes: the new stream's first message replaces the stale set.
    (mesh / "manifests" / "web-1.yaml").unlink()
    (mesh / "manifests" / "web-2.yaml").write_text(pod("web-2", "10.0.0.2"))
    plane["cp"] = ControlPlane(plane["settings"])
    await plane["cp"].start()
    await eventually(lambda: endpoint_ips(client) == ["10.0.0.2"], what="state after reconnect")
    streams = {s.key: s for s in client.streams()}
    assert streams[dkey].state is StreamState.LIVE
    assert not client.cache.is_stale(dkey)
    # web-1's policy stream now gets NOT_FOUND: it keeps retrying and keeps the last policy.
    await eventually(
        lambda: "NOT_FOUND" in ({s.key: s for s in client.streams()}[qkey].last_error or ""),
        what="policy stream refused",
    )
    assert client.cache.policy(qkey).valid


async def test_certify_refusal_is_a_located_error(plane, client):
    ident = Identity(sa="web", ns="shop")
    with pytest.raises(ControlPlaneError) as info:
        await client.certify(ident.dns_name, b"not-a-token", make_csr(new_key(), ident))
    assert info.value.service == "identity"
    assert info.value.method == "Certify"
    assert info.value.code == "INVALID_ARGUMENT"


async def test_identity_manager_certifies_against_the_real_servicer_and_renews(plane, client, mesh):
    identity_dir = mesh / "identity"
    bundle = load_trust_bundle(identity_dir / "ca.crt")
    seen: list = []
    mgr = IdentityManager(
        certifier=client.certify,
        token_source=minting_source(identity_dir),
        bundle=bundle,
        on_change=lambda _key, value: seen.append(value),
    )
    mgr.acquire("shop", "web")
    task = aio.spawn(mgr.run(), name="identity-manager")
    try:
        first = await eventually(lambda: mgr.tls_material("shop", "web"), what="certificate")
        leaf, *chain = x509.load_pem_x509_certificates(first.cert_chain_pem)
        assert leaf.public_key() == first.key.public_key()
        ca.verify_chain(leaf, chain, bundle, now=first.not_before)
        assert (first.expiry - first.not_before).total_seconds() == pytest.approx(3, abs=1)
        tls.client_context(first.cert_chain_pem, first.key, first.bundle_pem)  # loads
        # 3 s certificates renew at 2.1 s: within 5 s we see at least one renewal.
        await eventually(lambda: mgr.status()[0].renewals >= 2, within=5, what="renewal")
        second = mgr.tls_material("shop", "web")
        assert second is not None
        assert second.expiry > first.expiry
        assert second.key is first.key
        assert mgr.ready()
        assert seen[:2] == [first, second]
    finally:
        await aio.cancel_and_wait([task])


# --- a control plane that sends malformed messages (real gRPC peer over the real stubs) ---


class BadDestination(destination_pb2_grpc.DestinationServicer):
    async def Get(self, _request, _context):  # noqa: N802
        good = dpb.WeightedAddr(
            addr=net_pb2.TcpAddress(ip=net_pb2.IPAddress(ipv4=0x0A000001), port=80), weight=1
        )
        bad = dpb.WeightedAddr(weight=1)  # no address
        yield dpb.Update(add=dpb.WeightedAddrSet(addrs=[good, bad]))
        yield dpb.Update()  # nothing set: rejected, the set stays
        await asyncio.Event().wait()

    async def GetProfile(self, _request, _context):  # noqa: N802
        yield dpb.DestinationProfile(fully_qualified_name="good.ns.svc.cluster.local")
        yield dpb.DestinationProfile(routes=[dpb.Route()])  # route without condition
        await asyncio.Event().wait()


class BadPolicy(inbound_pb2_grpc.InboundServerPoliciesServicer):
    async def WatchPort(self, _request, _context):  # noqa: N802
        yield inbound_pb2.Server(labels={"name": "no-protocol"})
        await asyncio.Event().wait()


@pytest.fixture
async def bad_plane() -> AsyncIterator[str]:
    server = grpc.aio.server()
    destination_pb2_grpc.add_DestinationServicer_to_server(BadDestination(), server)
    inbound_pb2_grpc.add_InboundServerPoliciesServicer_to_server(BadPolicy(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_malformed_messages_reject_only_themselves_and_bad_policy_denies(bad_plane):
    client = ControlPlaneClient(
        destination=bad_plane, identity=bad_plane, policy=bad_plane, context=ContextToken()
    )
    try:
        dkey = client.watch_destination("x.ns.svc.cluster.local:80")
        pkey = client.watch_profile("good.ns.svc.cluster.local:80")
        qkey = client.watch_policy("ns", "pod", 80)
        status = {}

        def settled():
            status.update({s.key: s for s in client.streams()})
            return status[dkey].rejected == 2 and status[pkey].rejected == 1

        await eventually(settled, what="rejections counted")
        assert [e.addr for e in client.cache.endpoints(dkey).endpoints] == [("10.0.0.1", 80)]
        assert client.cache.profile(pkey).fqn == "good.ns.svc.cluster.local"  # previous kept
        policy = await eventually(lambda: client.cache.policy(qkey), what="policy")
        assert policy.valid is False
        facts = Facts.of("127.0.0.1", dst_port=80)
        assert authorize(policy, facts).reason is Reason.INVALID_POLICY
        assert {s.state for s in client.streams()} == {StreamState.LIVE}
    finally:
        await client.close()
