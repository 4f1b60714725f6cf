"""The embedded control plane over real gRPC on 127.0.0.1, following a manifests folder.

Each test starts `ControlPlane` in-process on kernel-picked ports (or the
`meshagent controlplane` command as a subprocess), talks to it with grpc.aio
clients, edits the folder and watches the streams follow.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from agent._proto import (
    destination_pb2,
    destination_pb2_grpc,
    identity_pb2,
    identity_pb2_grpc,
    inbound_pb2,
    inbound_pb2_grpc,
)
from agent.config import ControlPlaneSettings
from agent.controlplane.app import ControlPlane
from agent.errors import PKIError
from agent.identity.csr import make_csr, new_key
from agent.identity.names import Identity

pytestmark = pytest.mark.privileged

MESHAGENT = Path(sys.executable).parent / "meshagent"
STEP = 5.0  # seconds a stream gets to show a change (the folder is polled every 0.05 s here)

NAMESPACE = """\
apiVersion: v1
kind: Namespace
metadata: {name: shop, annotations: {linkerd.io/inject: enabled}}
"""

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  clusterIP: 10.96.0.10
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
"""


def pod(name: str, ip: str, *, ready: bool = True) -> str:
    return f"""\
---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: shop, labels: {{app: web}}}}
spec:
  serviceAccountName: web
  containers: [{{name: c, ports: [{{name: http, containerPort: 8080}}]}}]
status:
  phase: Running
  podIP: {ip}
  conditions: [{{type: Ready, status: "{ready}"}}]
"""


PROFILE = """\
apiVersion: linkerd.io/v1alpha2
kind: ServiceProfile
metadata: {name: web.shop.svc.cluster.local, namespace: shop}
spec:
  routes:
  - name: books
    condition: {method: GET, pathRegex: /books}
"""

SERVER = """\
apiVersion: policy.linkerd.io/v1beta3
kind: Server
metadata: {name: web-http, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  port: http
  proxyProtocol: HTTP/1
---
apiVersion: policy.linkerd.io/v1alpha1
kind: AuthorizationPolicy
metadata: {name: web-authn, namespace: shop}
spec:
  targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
  requiredAuthenticationRefs: [{kind: ServiceAccount, name: load}]
"""


def write(path: Path, text: str) -> None:
    """Replace a manifest atomically (a new inode), as an editor or kubectl-like tool would."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


def meshagent(*args: str | Path) -> str:
    done = subprocess.run(
        [str(MESHAGENT), *map(str, args)], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("pki")
    meshagent("certs", "create-root", base / "root")
    meshagent("certs", "create-issuer", base / "identity", "--ca", base / "root")
    return base / "identity"


@pytest.fixture
def manifests(tmp_path: Path) -> Path:
    folder = tmp_path / "manifests"
    folder.mkdir()
    write(folder / "ns.yaml", NAMESPACE)
    write(folder / "web.yaml", SERVICE)
    write(folder / "pods.yaml", pod("web-1", "10.1.0.1"))
    return folder


def settings(manifests: Path, identity: Path, **extra: object) -> ControlPlaneSettings:
    return ControlPlaneSettings(
        manifests=manifests,
        identity_dir=identity,
        bind="127.0.0.1",
        destination_port=0,
        identity_port=0,
        policy_port=0,
        poll_interval=0.05,
        shutdown_grace=1.0,
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
async def cp(manifests: Path, pki: Path, tmp_path: Path):
    identity = tmp_path / "identity"
    shutil.copytree(pki, identity)
    plane = ControlPlane(settings(manifests, identity))
    await plane.start()
    try:
        yield plane
    finally:
        await plane.stop(grace=0)


@pytest.fixture
async def channels(cp: ControlPlane):
    opened = {
        name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, port in cp.ports.items()
    }
    try:
        yield opened
    finally:
        for ch in opened.values():
            await ch.close()


async def next_msg(call):
    msg = await asyncio.wait_for(call.read(), STEP)
    assert msg is not grpc.aio.EOF, "stream ended"
    return msg


def kind(update: destination_pb2.Update) -> str:
    which = update.WhichOneof("update")
    if which == "no_endpoints":
        return f"no_endpoints(exists={update.no_endpoints.exists})"
    return which


def ips(update: destination_pb2.Update) -> list[int]:
    if update.HasField("add"):
        return sorted(a.addr.ip.ipv4 for a in update.add.addrs)
    return sorted(a.ip.ipv4 for a in update.remove.addrs)


def get(channels, path: str, token: str = '{"ns":"shop","nodeName":"n1","pod":"client"}'):
    stub = destination_pb2_grpc.DestinationStub(channels["destination"])
    return stub.Get(destination_pb2.GetDestination(path=path, context_token=token))


# --- Destination.Get -----------------------------------------------------------------------


async def test_get_follows_scale_ready_flips_and_service_deletion(channels, manifests):
    call = get(channels, "web.shop.svc.cluster.local:80")
    first = await next_msg(call)
    assert kind(first) == "add"
    assert ips(first) == [0x0A010001]
    [addr] = first.add.addrs
    assert addr.tls_identity.dns_like_identity.name == (
        "web.shop.serviceaccount.identity.linkerd.cluster.local"
    )
    assert addr.metric_labels["pod"] == "web-1"

    write(manifests / "pods.yaml", pod("web-1", "10.1.0.1") + pod("web-2", "10.1.0.2"))
    scaled = await next_msg(call)
    assert (kind(scaled), ips(scaled)) == ("add", [0x0A010002])

    write(manifests / "pods.yaml", pod("web-1", "10.1.0.1", ready=False) + pod("web-2", "10.1.0.2"))
    unready = await next_msg(call)
    assert (kind(unready), ips(unready)) == ("remove", [0x0A010001])

    write(manifests / "pods.yaml", pod("web-2", "10.1.0.2", ready=False))
    assert kind(await next_msg(call)) == "no_endpoints(exists=True)"

    (manifests / "web.yaml").unlink()
    assert kind(await next_msg(call)) == "no_endpoints(exists=False)"
    call.cancel()


async def test_get_unknown_service_starts_with_no_endpoints_false_then_adds_when_created(
    channels, manifests
):
    call = get(channels, "api.shop.svc.cluster.local:80")
    assert kind(await next_msg(call)) == "no_endpoints(exists=False)"
    write(
        manifests / "api.yaml",
        SERVICE.replace("name: web,", "name: api,").replace("10.96.0.10", "10.96.0.11"),
    )
    created = await next_msg(call)
    assert (kind(created), ips(created)) == ("add", [0x0A010001])
    call.cancel()


async def test_get_bad_path_is_invalid_argument(channels):
    call = get(channels, "web.shop.svc.cluster.local:http")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "Invalid authority" in (err.value.details() or "")


# --- Destination.GetProfile -------------------------------------------------------------------


async def test_get_profile_follows_service_profile_changes(channels, manifests):
    stub = destination_pb2_grpc.DestinationStub(channels["destination"])
    call = stub.GetProfile(
        destination_pb2.GetDestination(
            path="web.shop.svc.cluster.local:80", context_token='{"ns":"shop"}'
        )
    )
    first = await next_msg(call)
    assert first.fully_qualified_name == "web.shop.svc.cluster.local"
    assert list(first.routes) == []

    write(manifests / "profile.yaml", PROFILE)
    with_route = await next_msg(call)
    assert [r.metrics_labels["route"] for r in with_route.routes] == ["books"]

    write(manifests / "profile.yaml", PROFILE.replace("name: books", "name: novels"))
    renamed = await next_msg(call)
    assert [r.metrics_labels["route"] for r in renamed.routes] == ["novels"]
    call.cancel()


async def test_get_profile_for_an_undeclared_port_is_empty(channels):
    stub = destination_pb2_grpc.DestinationStub(channels["destination"])
    call = stub.GetProfile(destination_pb2.GetDestination(path="web.shop.svc.cluster.local:81"))
    assert await next_msg(call) == destination_pb2.DestinationProfile()
    call.cancel()


async def test_get_profile_by_pod_ip_has_the_endpoint(channels):
    stub = destination_pb2_grpc.DestinationStub(channels["destination"])
    call = stub.GetProfile(destination_pb2.GetDestination(path="10.1.0.1:8080"))
    prof = await next_msg(call)
    assert prof.endpoint.addr.ip.ipv4 == 0x0A010001
    assert prof.endpoint.metric_labels["namespace"] == "shop"
    call.cancel()


# --- InboundServerPolicies ------------------------------------------------------------------------


def port_spec(pod_name: str = "web-1", port: int = 8080, workload: str | None = None):
    return inbound_pb2.PortSpec(
        workload=workload or f'{{"ns":"shop","pod":"{pod_name}"}}', port=port
    )


async def test_watch_port_moves_from_default_to_server_and_back(channels, manifests):
    stub = inbound_pb2_grpc.InboundServerPoliciesStub(channels["policy"])
    call = stub.WatchPort(port_spec())
    first = await next_msg(call)
    assert dict(first.labels) == {"group": "", "kind": "default", "name": "all-unauthenticated"}
    assert first.protocol.WhichOneof("kind") == "detect"

    write(manifests / "server.yaml", SERVER)
    with_server = await next_msg(call)
    assert dict(with_server.labels)["name"] == "web-http"
    assert with_server.protocol.WhichOneof("kind") == "http1"
    [authz] = with_server.authorizations
    assert authz.labels["name"] == "web-authn"
    assert [i.name for i in authz.authentication.meshTLS.identities.identities] == [
        "load.shop.serviceaccount.identity.linkerd.cluster.local"
    ]

    write(manifests / "server.yaml", SERVER.split("---", maxsplit=1)[0])
    no_ap = await next_msg(call)
    assert list(no_ap.authorizations) == []

    (manifests / "server.yaml").unlink()
    assert dict((await next_msg(call)).labels)["kind"] == "default"
    call.cancel()


async def test_get_port_answers_once(channels):
    stub = inbound_pb2_grpc.InboundServerPoliciesStub(channels["policy"])
    got = await stub.GetPort(port_spec(), timeout=STEP)
    assert got.labels["name"] == "all-unauthenticated"


@pytest.mark.parametrize(
    ("spec", "code", "words"),
    [
        (port_spec(workload="not json"), grpc.StatusCode.INVALID_ARGUMENT, "Invalid workload"),
        (port_spec(port=0), grpc.StatusCode.INVALID_ARGUMENT, "Invalid port"),
        (port_spec(pod_name="nope"), grpc.StatusCode.NOT_FOUND, "shop/nope"),
    ],
)
async def test_bad_port_specs_are_refused_saying_why(channels, spec, code, words):
    stub = inbound_pb2_grpc.InboundServerPoliciesStub(channels["policy"])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetPort(spec, timeout=STEP)
    assert err.value.code() is code
    assert words in (err.value.details() or "")
    call = stub.WatchPort(spec)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() is code


# --- Identity, health, reflection -----------------------------------------------------------------


async def test_certify_accepts_a_token_from_the_token_command(channels, cp):
    token = meshagent(
        "controlplane",
        "token",
        "--namespace",
        "shop",
        "--serviceaccount",
        "web",
        "--identity-dir",
        cp.settings.identity_dir,
    ).strip()
    identity = Identity(sa="web", ns="shop")
    stub = identity_pb2_grpc.IdentityStub(channels["identity"])
    rsp = await stub.Certify(
        identity_pb2.CertifyRequest(
            identity=identity.dns_name,
            token=token.encode(),
            certificate_signing_request=make_csr(new_key(), identity),
        ),
        timeout=STEP,
    )
    assert rsp.leaf_certificate
    assert rsp.valid_until.ToDatetime(tzinfo=UTC) > datetime.now(UTC)

    other = Identity(sa="load", ns="shop")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Certify(
            identity_pb2.CertifyRequest(
                identity=other.dns_name,
                token=token.encode(),
                certificate_signing_request=make_csr(new_key(), other),
            ),
            timeout=STEP,
        )
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


SERVICES = {
    "destination": "io.linkerd.proxy.destination.Destination",
    "identity": "io.linkerd.proxy.identity.Identity",
    "policy": "io.linkerd.proxy.inbound.InboundServerPolicies",
}


@pytest.mark.parametrize("name", sorted(SERVICES))
async def test_each_port_reports_serving_and_lists_its_service_by_reflection(channels, name):
    health = health_pb2_grpc.HealthStub(channels[name])
    for service in ("", SERVICES[name]):
        rsp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=STEP)
        assert rsp.status == health_pb2.HealthCheckResponse.SERVING

    refl = reflection_pb2_grpc.ServerReflectionStub(channels[name])
    call = refl.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    rsp = await asyncio.wait_for(call.read(), STEP)
    await call.done_writing()
    listed = {s.name for s in rsp.list_services_response.service}
    assert SERVICES[name] in listed
    assert "grpc.health.v1.Health" in listed


# --- bad input and lifecycle ----------------------------------------------------------------------


async def test_bad_manifests_leave_the_rest_serving(channels, manifests, cp):
    write(manifests / "broken.yaml", "kind: [unclosed\n")
    write(manifests / "unknown.yaml", "apiVersion: v9\nkind: Gizmo\nmetadata: {name: g}\n")
    write(
        manifests / "badserver.yaml",
        SERVER.split("---", maxsplit=1)[0]
        .replace("name: web-http", "name: bad")
        .replace("port: http", "port: nope"),
    )
    for _ in range(100):
        if len(cp.store.errors()) >= 3:
            break
        await asyncio.sleep(0.05)
    assert len(cp.store.errors()) >= 3, cp.store.errors()
    call = get(channels, "web.shop.svc.cluster.local:80")
    first = await next_msg(call)
    assert (kind(first), ips(first)) == ("add", [0x0A010001])
    call.cancel()
    stub = inbound_pb2_grpc.InboundServerPoliciesStub(channels["policy"])
    assert (await stub.GetPort(port_spec(), timeout=STEP)).labels["kind"] == "default"


async def test_start_refuses_an_issuer_that_does_not_chain(manifests, pki, tmp_path):
    other = tmp_path / "other-root"
    meshagent("certs", "create-root", other)
    identity = tmp_path / "identity"
    shutil.copytree(pki, identity)
    shutil.copy(other / "ca.crt", identity / "ca.crt")
    plane = ControlPlane(settings(manifests, identity))
    with pytest.raises(PKIError):
        await plane.start()
    assert plane.ports == {}


async def test_stop_ends_open_streams(cp, channels):
    call = get(channels, "web.shop.svc.cluster.local:80")
    await next_msg(call)
    await cp.stop(grace=2)
    assert await asyncio.wait_for(call.read(), STEP) is grpc.aio.EOF
    assert await asyncio.wait_for(call.code(), STEP) is grpc.StatusCode.OK


@pytest.fixture
def cli_process(manifests: Path, pki: Path, tmp_path: Path):
    identity = tmp_path / "identity"
    shutil.copytree(pki, identity)
    proc = subprocess.Popen(
        [
            str(MESHAGENT),
            "controlplane",
            "--manifests",
            str(manifests),
            "--identity-dir",
            str(identity),
            "--bind",
            "127.0.0.1",
            "--destination-port",
            "0",
            "--identity-port",
            "0",
            "--policy-port",
            "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MESHAGENT_SHUTDOWN_GRACE": "2s"},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()


async def test_controlplane_command_serves_and_exits_0_on_sigterm(cli_process):
    assert cli_process.stderr is not None
    line = ""
    while "control plane serving" not in line:
        line = await asyncio.wait_for(asyncio.to_thread(cli_process.stderr.readline), 30)
        assert line, "the command exited before serving"
    ports = dict(re.findall(r"(destination|identity|policy)=(\d+)", line))
    assert set(ports) == {"destination", "identity", "policy"}, line
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['destination']}") as ch:
        call = get({"destination": ch}, "web.shop.svc.cluster.local:80")
        assert kind(await next_msg(call)) == "add"
        cli_process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(call.read(), STEP) is grpc.aio.EOF
    rc = await asyncio.wait_for(asyncio.to_thread(cli_process.wait), 15)
    assert rc == 0
