"""Per-stream routing of HTTP/2 for the outbound and inbound handlers (agent.proxy.http2).

Outbound (`serve_outbound`), per stream:
1. `l5d-dst-override` picks the destination (resolved through
   `("dst", authority)`), else the connection's original destination.
2. The profile route (`:method`, `:path`) gives the timeout and response
   classes; the destination's `Balancer` picks the endpoint. None: 503
   (gRPC: UNAVAILABLE). Steps 1-3 are `outbound.OutboundRouter`'s, the
   HTTP/1 router's, with its per-connection memos.
3. The hop as for HTTP/1 (`outbound.hop_for`): same node: B's policy is
   applied here with A's identity and `l5d-client-id` is set; mTLS to a
   meshed endpoint, h2 prior knowledge inside the tunnel (the peer's inbound
   detects the preface after terminating TLS); else plain. Over mTLS the
   streams of one client connection share one of the worker's lanes to the
   endpoint (agent.proxy.h2pool rule 2).
A stream whose header list is the last stream's (the decoder hands out one list per
repeated block, agent.proxy.h2hpack rule 6), in the same state generation, skips
steps 1 and 2's lookups and, when the balancer picks the same endpoint, step 3's
hop and authorization (counted again); see `_Repeat`.
Inbound (`serve_inbound`), per stream: authorize with the pod's policy for
the port (method and path included); deny: 403 with `l5d-proxy-error`
(gRPC: HTTP 200 trailers-only grpc-status 7); allowed: `l5d-client-id` is
the verified identity (a client-sent copy removed) and the stream goes to
B's app over h2 from B's netns (`inbound.app_addr`); a stream marked
`l5d-orig-proto` (HTTP/1 a peer proxy upgraded) goes to the app as HTTP/1
(agent.proxy.h2toh1). A repeat of the last plain stream's header list in the
same state generation reuses its decision (counted again) and what it sent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from agent.proxy import h1msg, h2msg, h2pool, http2, inbound, origproto, outbound
from agent.proxy.h2msg import Answer, H2Headers
from agent.proxy.h2toh1 import Downgrade
from agent.proxy.plane import plane_of
from agent.proxy.state import POLICY, Destination, PodInfo
from agent.proxy.upstream import transport_opener

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Hashable

    from agent.policy.authorize import Facts
    from agent.proxy.balance import EndpointStats
    from agent.proxy.model import Route
    from agent.proxy.plane import DstEntry
    from agent.proxy.record import BoundAuthz
    from agent.proxy.worker import Conn, Worker


def authorize_stream(
    worker: Worker,
    policy_key: Hashable,
    headers: H2Headers,
    cache: inbound.AuthzCache,
    facts: dict[str, Any],
) -> tuple[Answer | None, BoundAuthz]:
    """Authorize one stream (`inbound.authorize_http`): None if allowed, else the answer;
    and the handle it was counted with (`.count()` counts a repeat of it).

    `facts`: the client's, as `authorize_http` takes them (the same for every stream
    of a connection, as is `cache`).
    """
    decision, counted = inbound.authorize_http(
        worker,
        policy_key,
        h2msg.header(headers, b":method") or b"",
        h2msg.header(headers, b":path") or b"",
        cache=cache,
        **facts,
    )
    if decision.allowed:
        return None, counted
    message = inbound.deny_message(decision)
    if h2msg.is_grpc(headers):
        return Answer(status=200, message=message, grpc=h2msg.GRPC_PERMISSION_DENIED), counted
    return Answer(status=decision.http_status, message=message), counted


class _Repeat:
    """What the last stream's headers decided, for the next stream with the same list.

    The decoder hands out one list per repeated header block (agent.proxy.h2hpack
    rule 6), so a repeat is an identity check. Valid in the state generation it was
    made in. Outbound: the destination entry, route and labels; and the last endpoint's
    hop with its same-node authorization, reused when the balancer (which still picks
    every stream) picks that endpoint again and its certificate has not expired.
    """

    __slots__ = (
        "choice",
        "counted",
        "denied",
        "entry",
        "gen",
        "grpc",
        "headers",
        "labels",
        "route",
        "send",
        "stats",
    )

    def __init__(  # noqa: PLR0913 - plain record
        self,
        headers: H2Headers,
        gen: int,
        entry: DstEntry,
        route: Route | None,
        labels: dict[str, str],
        *,
        grpc: bool,
    ) -> None:
        self.headers = headers
        self.gen = gen
        self.entry = entry
        self.route = route
        self.labels = labels
        self.grpc = grpc
        # The last endpoint's decision: its stats, hop, what is sent, the authorization.
        self.stats: EndpointStats | None = None
        self.choice: Any = None
        self.send: H2Headers = headers
        self.denied: Answer | None = None
        self.counted: BoundAuthz | None = None


class OutboundStreams:
    """Per-stream destination, route and endpoint: the HTTP/1 router's steps and memos."""

    direction = "outbound"

    def __init__(self, router: outbound.OutboundRouter) -> None:
        self.router = router
        self.worker = router.worker
        self.lane = h2pool.next_lane()  # this connection's streams over mTLS (h2pool rule 2)
        self._repeat: _Repeat | None = None

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        router = self.router
        gen = self.worker.state.generation
        repeat = self._repeat
        if repeat is None or repeat.headers is not headers or repeat.gen != gen:
            grpc = h2msg.is_grpc(headers)
            found = await router.destination(h1msg.dst_override(headers))
            if isinstance(found, outbound.Refusal):
                return h2msg.answer_for(found.status, found.message, grpc=grpc)
            method, path = h2msg.method_path(headers)
            entry, route, labels = router.route_of(*found, method, path)
            repeat = self._repeat = _Repeat(headers, gen, entry, route, labels, grpc=grpc)
        handle = repeat.entry.balancer.pick(router.loop.time(), router.plane.rng, [])
        if handle is None:
            return h2msg.answer_for(503, outbound.no_endpoints(repeat.labels), grpc=repeat.grpc)
        choice = repeat.choice
        if (
            handle.stats is repeat.stats
            and choice is not None
            and (choice.expires is None or choice.expires > time.time())
        ):
            if repeat.counted is not None:
                repeat.counted.count()
        else:
            picked = router.hop(handle, repeat.labels, [])
            if isinstance(picked, outbound.Refusal):
                return h2msg.answer_for(picked.status, picked.message, grpc=repeat.grpc)
            choice = picked[1]
            repeat.stats = handle.stats
            repeat.choice = choice
            repeat.send = headers
            repeat.denied = repeat.counted = None
            if choice.hop.kind == "local":
                policy_key, facts = router.local_policy(choice)
                repeat.denied, repeat.counted = authorize_stream(
                    self.worker, policy_key, headers, router.authz_cache, facts
                )
                repeat.send = h2msg.with_client_id(headers, facts["identity"])
        if repeat.denied is not None:
            handle.cancel()
            return repeat.denied
        hop = choice.hop
        route = repeat.route
        return http2.Routed(
            key=("h2", *hop.key, self.lane) if hop.kind == "mtls" else ("h2", *hop.key),
            open=choice.open,
            headers=repeat.send,
            handle=handle,
            route=route,
            timeout_s=route.timeout_s if route is not None else None,
            labels=choice.labels,
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
        self.authz_cache = inbound.AuthzCache()
        self.authz_facts: dict[str, Any] = {
            "client_ip": facts.client_ip,
            "identity": facts.client_identity,
            "tls": facts.tls,
            "port": port,
            "labels": self.labels,
        }
        addr = inbound.app_addr(pod, port)
        self.key = ("h2app", pod.netns, addr)
        self.open = transport_opener(worker, netns=pod.netns, addr=addr)
        self.downgrade = Downgrade(plane_of(worker).pool, (pod.netns, addr), self.open, self.labels)
        # The last stream's headers, state generation, decision and what is sent (see
        # `_Repeat`): a plain (not upgraded) stream's routing, reused by an identical one.
        self._repeat: tuple[H2Headers, int, BoundAuthz, Answer | http2.Routed] | None = None

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        gen = self.worker.state.generation
        repeat = self._repeat
        if repeat is not None and repeat[0] is headers and repeat[1] == gen:
            repeat[2].count()
            return repeat[3]  # an Answer, or a Routed with nothing per stream in it
        denied, counted = authorize_stream(
            self.worker, self.policy_key, headers, self.authz_cache, self.authz_facts
        )
        if denied is not None:
            self._repeat = (headers, gen, counted, denied)
            return denied
        send = h2msg.with_client_id(headers, self.facts.client_identity)
        request = origproto.downgrade_request(send)
        routed = http2.Routed(
            key=self.key,
            open=self.open,
            headers=send,
            labels=self.labels,
            h1=(self.downgrade, request) if request is not None else None,
        )
        self._repeat = (headers, gen, counted, routed) if request is None else None
        return routed


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
    router = OutboundStreams(outbound.OutboundRouter(conn, src, key, dst))
    return await http2.serve(conn.transport, router, h2pool.pool_of(conn.worker), prefix, eof=eof)


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
    return await http2.serve(transport, router, h2pool.pool_of(conn.worker), prefix, eof=eof)
