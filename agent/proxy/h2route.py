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
A stream with the last stream's routing facts (method, query-less path, override,
content type) in the same state generation skips steps 1 and 2's lookups and, when
the balancer picks the same endpoint, step 3's hop and authorization (counted
again); see `_Repeat`.
Inbound (`serve_inbound`), per stream: authorize with the pod's policy for
the port (method and path included); deny: 403 with `l5d-proxy-error`
(gRPC: HTTP 200 trailers-only grpc-status 7); allowed: `l5d-client-id` is
the verified identity (a client-sent copy removed) and the stream goes to
B's app over h2 from B's netns (`inbound.app_addr`); a stream marked
`l5d-orig-proto` (HTTP/1 a peer proxy upgraded) goes to the app as HTTP/1
(agent.proxy.h2toh1). A stream with the last stream's routing facts in the same
state generation reuses its decision (counted again; see `_Repeat`), and one with the
last plain stream's very list what was routed for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.proxy import h1msg, h2msg, h2pool, h2serve, http2, inbound, origproto, outbound
from agent.proxy.h2msg import Answer, H2Headers
from agent.proxy.h2toh1 import Downgrade
from agent.proxy.plane import plane_of
from agent.proxy.state import POLICY, Destination, PodInfo
from agent.proxy.upstream import transport_opener
from agent.proxy.wstate import WorkerState  # noqa: TC001 - an attribute type of a compiled class

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Hashable

    from agent.policy.authorize import Facts
    from agent.proxy.accept import Conn
    from agent.proxy.balance import EndpointStats, Handle
    from agent.proxy.model import Route
    from agent.proxy.plane import DstEntry
    from agent.proxy.record import BoundAuthz
    from agent.proxy.worker import Worker


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
    """What the last stream decided, for the next stream with the same routing facts.

    Valid in the state generation it was made in, for streams whose `:method`,
    query-less `:path`, `l5d-dst-override` and `content-type` are the last stream's
    (`h2msg.routing_facts`): all that routing and same-node authorization read. The
    decoder hands out one list per repeated header block (agent.proxy.h2hpack rule 6),
    so an identical stream is found by an identity check, before the facts are read.
    Outbound: the destination entry, route and labels; and the last endpoint's hop with
    its same-node authorization, reused when the balancer (which still picks every
    stream) picks that endpoint again and its certificate has not expired.
    """

    __slots__ = (
        "choice",
        "counted",
        "denied",
        "entry",
        "facts",
        "gen",
        "grpc",
        "headers",
        "labels",
        "route",
        "send",
        "sent_for",
        "stats",
    )

    def __init__(  # noqa: PLR0913 - plain record
        self,
        headers: H2Headers,
        facts: h2msg.RoutingFacts,
        *,
        gen: int,
        entry: DstEntry,
        route: Route | None,
        labels: dict[str, str],
    ) -> None:
        self.headers = headers  # the last stream's list
        self.facts = facts
        self.gen = gen
        self.entry = entry
        self.route = route
        self.labels = labels
        self.grpc = h2msg.is_grpc_type(facts[3])
        # The last endpoint's decision: its stats, hop and authorization.
        self.stats: EndpointStats | None = None
        self.choice: Any = None
        self.denied: Answer | None = None
        self.counted: BoundAuthz | None = None
        # Same node: the list sent (`l5d-client-id` set) and the list it was made from.
        self.send: H2Headers = headers
        self.sent_for: H2Headers | None = None


class OutboundStreams:
    """Per-stream destination, route and endpoint: the HTTP/1 router's steps and memos."""

    direction = "outbound"

    def __init__(self, router: outbound.OutboundRouter) -> None:
        self.router = router
        self.worker = router.worker
        self.state = router.state  # typed: through the worker, a lookup by name (rule 11)
        self.lane = h2pool.pool_of(self.worker).next_lane()  # streams over mTLS (its rule 2)
        self._repeat: _Repeat | None = None

    def route_now(self, headers: H2Headers) -> http2.Routed | Answer | None:
        gen = self.state.generation
        repeat = self._repeat
        if repeat is None or repeat.headers is not headers or repeat.gen != gen:
            got = self._repeat_now(headers, gen)
            if got is None or isinstance(got, Answer):
                return got
            repeat = got
        return self._routed(repeat, headers)

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        got = self.route_now(headers)
        if got is not None:
            return got
        # Only an `l5d-dst-override` not known yet waits.
        found = await self.router.destination(h1msg.dst_override(headers))
        gen = self.state.generation
        repeat = self._new_repeat(headers, h2msg.routing_facts(headers), gen, found)
        return repeat if isinstance(repeat, Answer) else self._routed(repeat, headers)

    def _routed(self, repeat: _Repeat, headers: H2Headers) -> http2.Routed | Answer:
        """Step 2's endpoint and step 3's hop for a stream with `repeat`'s facts."""
        router = self.router
        handle = repeat.entry.balancer.pick(router.now(), router.plane.rng, [])
        if handle is None:
            return h2msg.answer_for(503, outbound.no_endpoints(repeat.labels), grpc=repeat.grpc)
        choice = self._choice(repeat, handle, headers)
        if isinstance(choice, Answer):
            return choice
        hop = choice.hop
        send = headers
        if hop.kind == "local":
            if repeat.sent_for is not headers:
                identity = router.local_policy(choice)[1]["identity"]
                repeat.send = h2msg.with_client_id(headers, identity)
                repeat.sent_for = headers
            send = repeat.send
        route = repeat.route
        return http2.Routed(
            key=("h2", hop.key, self.lane) if hop.kind == "mtls" else ("h2", hop.key),
            open=choice.open,
            headers=send,
            handle=handle,
            route=route,
            timeout_s=route.timeout_s if route is not None else None,
            labels=choice.labels,
        )

    def _repeat_now(self, headers: H2Headers, gen: int) -> _Repeat | Answer | None:
        """The last stream's `_Repeat` if this one has its routing facts, else a new one
        (steps 1 and 2: the destination entry, route and labels); None when the
        destination is not known yet."""
        facts = h2msg.routing_facts(headers)
        repeat = self._repeat
        if repeat is not None and repeat.gen == gen and repeat.facts == facts:
            repeat.headers = headers
            return repeat
        found = self.router.destination_now(h1msg.dst_override(headers))
        return None if found is None else self._new_repeat(headers, facts, gen, found)

    def _new_repeat(
        self,
        headers: H2Headers,
        facts: h2msg.RoutingFacts,
        gen: int,
        found: tuple[tuple[str, str], Destination] | outbound.Refusal,
    ) -> _Repeat | Answer:
        if isinstance(found, outbound.Refusal):
            return h2msg.answer_for(found.status, found.message, grpc=h2msg.is_grpc(headers))
        method, path = h2msg.method_path(headers)
        entry, route, labels = self.router.route_of(*found, method, path)
        repeat = self._repeat = _Repeat(
            headers, facts, gen=gen, entry=entry, route=route, labels=labels
        )
        return repeat

    def _choice(self, repeat: _Repeat, handle: Handle, headers: H2Headers) -> Any:
        """The hop to the picked endpoint (a `_Choice`), or the answer: the last one's when
        it is the same endpoint (its authorization counted again), else step 3."""
        choice = repeat.choice
        if handle.stats is repeat.stats and choice is not None and outbound.fresh(choice.expires):
            if repeat.counted is not None:
                repeat.counted.count()
        else:
            router = self.router
            picked = router.hop(handle, repeat.labels, [])
            if isinstance(picked, outbound.Refusal):
                return h2msg.answer_for(picked.status, picked.message, grpc=repeat.grpc)
            choice = picked[1]
            repeat.stats = handle.stats
            repeat.choice = choice
            repeat.denied = repeat.counted = None
            repeat.sent_for = None
            if choice.hop.kind == "local":
                policy_key, client = router.local_policy(choice)
                repeat.denied, repeat.counted = authorize_stream(
                    self.worker, policy_key, headers, router.authz_cache, client
                )
        if repeat.denied is not None:
            handle.cancel()
            return repeat.denied
        return choice


class InboundStreams:
    """Per-stream authorization, then B's app over h2."""

    direction = "inbound"

    def __init__(self, worker: Worker, pod: PodInfo, port: int, facts: Facts) -> None:
        self.worker = worker
        # typed: through the interpreted worker, a lookup by name (agent.native rule 11)
        self.state: WorkerState = worker.state
        self.pod = pod
        self.port = port
        self.facts = facts
        # Objects, not tuple-typed: mypyc would box a new tuple at each read; the
        # authorization memo compares the policy key by identity, and the pool key is
        # then not rebuilt (and its hash not recomputed) per stream (agent.native rule 7).
        self.policy_key: Hashable = (POLICY, pod.key, port)
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
        self.key: Hashable = ("h2app", pod.netns, addr)
        self.open = transport_opener(worker, netns=pod.netns, addr=addr)
        self.downgrade = Downgrade(plane_of(worker).pool, (pod.netns, addr), self.open, self.labels)
        # The last stream's routing facts, state generation and decision (see `_Repeat`),
        # with the list and what was routed for it (a plain, not upgraded, stream).
        self._repeat: tuple[h2msg.RoutingFacts, int, BoundAuthz, Answer | None] | None = None
        self._routed: tuple[H2Headers, http2.Routed] | None = None

    async def route(self, headers: H2Headers) -> http2.Routed | Answer:
        return self.route_now(headers)

    def route_now(self, headers: H2Headers) -> http2.Routed | Answer:
        """Never waits: the pod's policy is in the worker's state."""
        gen = self.state.generation
        repeat = self._repeat
        routed = self._routed
        if repeat is not None and repeat[1] == gen:
            if routed is not None and routed[0] is headers:
                repeat[2].count()
                return routed[1]  # nothing per stream in it
            facts = h2msg.routing_facts(headers)
            if repeat[0] == facts:
                repeat[2].count()
                return repeat[3] if repeat[3] is not None else self._allowed(headers)
        else:
            facts = h2msg.routing_facts(headers)
        denied, counted = authorize_stream(
            self.worker, self.policy_key, headers, self.authz_cache, self.authz_facts
        )
        self._repeat = (facts, gen, counted, denied)
        self._routed = None  # routed under the last decision only
        return denied if denied is not None else self._allowed(headers)

    def _allowed(self, headers: H2Headers) -> http2.Routed:
        send = h2msg.with_client_id(headers, self.facts.client_identity)
        request = origproto.downgrade_request(send)
        routed = http2.Routed(
            key=self.key,
            open=self.open,
            headers=send,
            labels=self.labels,
            h1=(self.downgrade, request) if request is not None else None,
        )
        self._routed = (headers, routed) if request is None else None
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
    return await h2serve.serve(conn.transport, router, h2pool.pool_of(conn.worker), prefix, eof=eof)


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
    return await h2serve.serve(transport, router, h2pool.pool_of(conn.worker), prefix, eof=eof)
