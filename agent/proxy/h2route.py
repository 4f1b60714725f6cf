"""Per-stream routing of HTTP/2 for the outbound and inbound handlers (agent.proxy.http2).

Outbound (`serve_outbound`), per stream:
1. `l5d-dst-override` picks the destination (resolved through
   `("dst", authority)`), else the connection's original destination.
2. The profile route (`:method`, `:path`) gives the timeout and response
   classes; the destination's `Balancer` picks the endpoint. None: 503
   (gRPC: UNAVAILABLE).
3. The hop as for HTTP/1 (`outbound.hop_for`): same node: B's policy is
   applied here with A's identity and `l5d-client-id` is set; mTLS to a
   meshed endpoint, h2 prior knowledge inside the tunnel (the peer's inbound
   detects the preface after terminating TLS); else plain.
Inbound (`serve_inbound`), per stream: authorize with the pod's policy for
the port (method and path included); deny: 403 with `l5d-proxy-error`
(gRPC: HTTP 200 trailers-only grpc-status 7); allowed: `l5d-client-id` is
the verified identity (a client-sent copy removed) and the stream goes to
B's app over h2 from B's netns (`inbound.app_addr`).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING, Any

from agent.proxy import h2msg, http2, inbound, outbound
from agent.proxy.h2msg import Answer, H2Headers
from agent.proxy.plane import plane_of
from agent.proxy.profile import match_route
from agent.proxy.record import recorder
from agent.proxy.state import DST, POLICY, Destination, PodInfo
from agent.proxy.upstream import UpstreamError, transport_opener

if TYPE_CHECKING:
    from collections.abc import Hashable

    from agent.policy.authorize import Facts
    from agent.proxy.worker import Conn, Worker

DST_OVERRIDE = b"l5d-dst-override"


def authorize_stream(  # noqa: PLR0913 - the facts of one stream
    worker: Worker,
    policy_key: Hashable,
    headers: H2Headers,
    *,
    client_ip: inbound.IPAddress,
    identity: str | None,
    tls: bool,
    port: int,
    labels: dict[str, str],
) -> Answer | None:
    """Authorize one stream with the current policy: None if allowed, else the answer."""
    method, path = h2msg.method_path(headers)
    decision, merged = inbound.decide(
        inbound.policy_from(worker, worker.state.get(policy_key)),
        method=method,
        path=path,
        client_ip=client_ip,
        identity=identity,
        tls=tls,
        port=port,
        labels=labels,
    )
    recorder().authz(merged, allowed=decision.allowed, http=True)
    if decision.allowed:
        return None
    message = inbound.deny_message(decision)
    if h2msg.is_grpc(headers):
        return Answer(status=200, message=message, grpc=h2msg.GRPC_PERMISSION_DENIED)
    return Answer(status=decision.http_status, message=message)


class OutboundStreams:
    """Per-stream destination, route and endpoint for one app connection."""

    direction = "outbound"

    def __init__(
        self, conn: Conn, src: PodInfo | None, key: tuple[str, str], dst: Destination
    ) -> None:
        self.worker = conn.worker
        self.plane = plane_of(conn.worker)
        self.src = src
        self.netns = conn.listener.netns
        self.key = key
        self.dst = dst
        self.client_ip = ipaddress.ip_address(src.ip if src is not None else conn.peer[0])
        self.loop = asyncio.get_running_loop()

    async def _destination(
        self, headers: H2Headers
    ) -> tuple[tuple[str, str], Destination] | Answer:
        override = h2msg.header(headers, DST_OVERRIDE)
        grpc = h2msg.is_grpc(headers)
        if not override or not override.isascii():
            value = self.worker.state.get(self.key, self.dst)
            return self.key, value if isinstance(value, Destination) else self.dst
        key = (DST, override.decode("ascii").strip())
        try:
            dst = await self.worker.state.want(key, kind=DST, wait_s=outbound.DST_WAIT_S)
        except TimeoutError:
            return h2msg.answer_for(503, f"no destination for {key[1]}", grpc=grpc)
        if not isinstance(dst, Destination) or not dst.exists:
            return h2msg.answer_for(503, f"{key[1]} is not a mesh destination", grpc=grpc)
        return key, dst

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        found = await self._destination(headers)
        if isinstance(found, Answer):
            return found
        key, dst = found
        grpc = h2msg.is_grpc(headers)
        entry = self.plane.entry(key, dst)
        method, path = h2msg.method_path(headers)
        route = None
        if dst.profile is not None and dst.profile.routes:
            route = match_route(dst.profile, method, path)
        labels = {"direction": outbound.DIRECTION, "authority": dst.authority or key[1]}
        if route is not None:
            labels["rt_route"] = route.name
        handle = entry.balancer.pick(self.loop.time(), self.plane.rng)
        if handle is None:
            return h2msg.answer_for(503, f"no endpoints for {labels['authority']}", grpc=grpc)
        ep = handle.endpoint
        try:
            hop = outbound.hop_for(self.worker, self.src, self.netns, ep)
        except UpstreamError as exc:
            handle.done(self.loop.time(), ok=False)
            return h2msg.answer_for(exc.status, str(exc), grpc=grpc)
        send = headers
        if hop.kind == "local":
            denied = self._authorize_local(hop, headers)
            if denied is not None:
                handle.cancel()
                return denied
            send = h2msg.with_client_id(headers, self.src.identity if self.src else None)
        return http2.Routed(
            key=("h2", *hop.key),
            open=outbound.hop_opener(self.worker, hop),
            headers=send,
            handle=handle,
            route=route,
            timeout_s=route.timeout_s if route is not None else None,
            labels={**labels, "dst_addr": f"{ep.addr[0]}:{ep.addr[1]}", "hop": hop.kind},
        )

    def _authorize_local(self, hop: Any, headers: H2Headers) -> Answer | None:
        peer: PodInfo = hop.peer
        identity = self.src.identity if self.src is not None else None
        port = hop.addr[1]
        return authorize_stream(
            self.worker,
            (POLICY, peer.key, port),
            headers,
            client_ip=self.client_ip,
            identity=identity,
            tls=identity is not None,
            port=port,
            labels={"direction": "inbound", "namespace": peer.namespace, "pod": peer.name},
        )


class InboundStreams:
    """Per-stream authorization, then B's app over h2."""

    direction = "inbound"

    def __init__(self, worker: Worker, pod: PodInfo, port: int, facts: Facts) -> None:
        self.worker = worker
        self.pod = pod
        self.port = port
        self.facts = facts
        self.policy_key = (POLICY, pod.key, port)
        self.labels = inbound.labels_for(pod, port, facts.client_identity, tls=facts.tls)
        addr = inbound.app_addr(pod, port)
        self.key = ("h2app", pod.netns, addr)
        self.open = transport_opener(worker, netns=pod.netns, addr=addr)

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        facts = self.facts
        denied = authorize_stream(
            self.worker,
            self.policy_key,
            headers,
            client_ip=facts.client_ip,
            identity=facts.client_identity,
            tls=facts.tls,
            port=self.port,
            labels=self.labels,
        )
        if denied is not None:
            return denied
        return http2.Routed(
            key=self.key,
            open=self.open,
            headers=h2msg.with_client_id(headers, facts.client_identity),
            labels=self.labels,
        )


async def serve_outbound(  # noqa: PLR0913 - the facts of one connection
    conn: Conn,
    src: PodInfo | None,
    key: tuple[str, str],
    dst: Destination,
    prefix: bytes,
    *,
    eof: bool,
) -> int:
    """Serve an app's h2 connection per stream; the number of streams."""
    router = OutboundStreams(conn, src, key, dst)
    return await http2.serve(conn.transport, router, http2.pool_of(conn.worker), prefix, eof=eof)


async def serve_inbound(  # noqa: PLR0913, PLR0917 - the facts of one connection
    conn: Conn,
    transport: asyncio.Transport,
    pod: PodInfo,
    port: int,
    facts: Facts,
    prefix: bytes,
    *,
    eof: bool,
) -> int:
    """Serve an h2 connection to pod B per stream; the number of streams."""
    router = InboundStreams(conn.worker, pod, port, facts)
    return await http2.serve(transport, router, http2.pool_of(conn.worker), prefix, eof=eof)
