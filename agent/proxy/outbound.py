"""The outbound handler: connections pod A's app made, redirected to A's :4140.

Flow per connection (DESIGN.md "Flows", outbound):
1. Original destination (`accept.resolve_target`) -> `("dst", "ip:port")`
   from the state, asking the supervisor once (`Need`) and waiting up to
   `DST_WAIT_S`. No answer, or `exists=False` (not a mesh service): a plain
   TCP forward to the original destination from A's netns.
2. Opaque when the destination, its profile or A's `opaque_ports` say so;
   else protocol detection on the first bytes (`DETECT_TIMEOUT_S`; no verdict
   by then: opaque).
3. HTTP/1 (agent.proxy.httpproxy): per request, `l5d-dst-override` picks the
   destination (resolved through `("dst", authority)`), the profile route
   gives timeout, retries and response classes, the destination's `Balancer`
   picks the endpoint. No endpoints: 503. HTTP/2 prior knowledge
   (agent.proxy.h2route): the same, per stream. Opaque traffic: one balanced
   endpoint per connection, relayed byte for byte.
4. The endpoint decides the hop:
   - on this node (`("pod-ip", ip)` names a pod here, port not skipped by it):
     no TLS and no network hop; B's inbound policy is applied here with A's
     identity as a verified client (tls=True), `l5d-client-id` set, and the
     connection made to B's app from B's netns; an opaque one may be paired
     (agent.proxy.pairing) for sk_msg to carry once the worker caught up;
   - meshed (`tls_identity`): TLS 1.3 with A's certificate (A = the pod
     whose listener accepted), SNI and exact peer identity = `tls_identity`;
     no usable certificate: 502 / close (fail closed);
   - otherwise plain TCP from A's netns.
   An HTTP/1 request to a meshed endpoint that Destination hints `h2` (its
   inbound is a Linkerd-compatible proxy) may go upgraded to an h2 stream
   marked `l5d-orig-proto` (agent.proxy.origproto, agent.proxy.h1toh2), on
   the worker's multiplexed h2 connection to that endpoint: `--h2-upgrade
   auto` (the default) when the endpoint's HTTP/1 connections are all busy
   (h1toh2 rule 7), `on` always, `off` never; what cannot be upgraded
   (origproto rule 1) goes as HTTP/1 inside mTLS.
   Upstream sockets are made in A's netns with the proxy mark; the peer
   node's capture sends them to the peer pod's inbound listener.
5. What routing makes of a request and depends on nothing but the client, the
   destination and the state (a route's label set; the hop to an endpoint with
   its opener, label set, same-node authorization facts and decisions) is made once per
   worker for every connection from the same client (A's pod record, netns and
   address) to the same destination (`Plane.routes`), not once per connection:
   under new connections it was a quarter of a connection's instructions
   (bench/RESULTS.md, fifty-seventh pass). A hop is checked against the state
   generation, the endpoint, A's certificate and B's pod record before reuse.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from agent.errors import AgentError
from agent.policy.authorize import Facts, parse_ip
from agent.proxy import accept, h1msg, h1plan, h1toh2, h2pool, h2route, http1, httpproxy, inbound
from agent.proxy import worker as worker_mod
from agent.proxy.detect import NeedMore, Protocol, detect
from agent.proxy.h2pool import H2Pool  # noqa: TC001 - an attribute type of a compiled class
from agent.proxy.model import ProtocolHint
from agent.proxy.plane import DstEntry, plane_of, read_prefix
from agent.proxy.profile import match_route
from agent.proxy.record import recorder
from agent.proxy.state import DST, POD, POD_IP, POLICY, TLS, Destination, PodInfo
from agent.proxy.upstream import TransportOpener, UpstreamError, start_relay, transport_opener
from agent.proxy.wstate import WorkerState  # noqa: TC001 - an attribute type of a compiled class

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable, Hashable

    from agent.proxy.accept import Conn
    from agent.proxy.balance import EndpointStats, Handle
    from agent.proxy.model import Endpoint, Route
    from agent.proxy.record import BoundAuthz
    from agent.proxy.worker import Worker

# the wall clock, bound once: `time.time` read per request was a lookup by name, and its
# result an object compared generically (agent.native rule 6)
wall: Final[Callable[[], float]] = time.time


def fresh(expires: float | None) -> bool:
    """Whether a certificate that expires at `expires` (None: no certificate) still holds.
    One read of the attribute, passed here: read twice, the second read was not narrowed
    to a float and compared generically."""
    return expires is None or expires > wall()


logger = logging.getLogger(__name__)

DIRECTION: Final = "outbound"
DST_WAIT_S: Final = 2.0
DETECT_TIMEOUT_S: Final = 10.0


def _detect(buf: bytes, eof: bool) -> Protocol | NeedMore:
    return detect(buf, eof=eof)


class _Hop:
    """How to reach one endpoint from the source pod: a resolved, reusable recipe."""

    __slots__ = ("addr", "identity", "key", "kind", "netns", "peer", "ssl_ctx")

    def __init__(  # noqa: PLR0913 - plain record
        self,
        *,
        kind: str,
        key: Hashable,  # the pool's key object (agent.proxy.upstream rule 6)
        netns: str,
        addr: tuple[str, int],
        ssl_ctx: ssl.SSLContext | None = None,
        identity: str | None = None,
        peer: PodInfo | None = None,
    ) -> None:
        self.kind = kind  # "local" (same node), "mtls", "plain"
        self.key = key
        self.netns = netns
        self.addr = addr
        self.ssl_ctx = ssl_ctx
        self.identity = identity
        self.peer = peer


def hop_for(worker: Worker, src: PodInfo | None, netns: str, ep: Endpoint) -> _Hop:
    """The hop to `ep` from the source pod.

    Raises:
        UpstreamError: the endpoint needs mTLS and the source has no usable certificate.
    """
    state = worker.state
    plane = plane_of(worker)
    pool = plane.pool  # one key object per upstream (agent.proxy.upstream rule 6)
    peer_key = state.get((POD_IP, ep.addr[0]))
    peer = state.get((POD, peer_key)) if peer_key is not None else None
    if isinstance(peer, PodInfo) and ep.addr[1] not in peer.skip_inbound_ports:
        addr = inbound.app_addr(peer, ep.addr[1])
        return _Hop(
            kind="local",
            key=pool.canonical(("app", peer.netns, addr)),
            netns=peer.netns,
            addr=addr,
            peer=peer,
        )
    if ep.tls_identity is None:
        key = pool.canonical(("tcp", netns, ep.addr))
        return _Hop(kind="plain", key=key, netns=netns, addr=ep.addr)
    if src is None:
        raise UpstreamError(f"{ep.addr[0]}:{ep.addr[1]}", "source pod has no identity")
    material = state.get((TLS, src.identity))
    ctx = plane.tls.client(material, src.identity, now=wall())
    return _Hop(
        kind="mtls",
        key=pool.canonical(("tls", src.key, netns, ep.addr, ep.tls_identity)),
        netns=netns,
        addr=ep.addr,
        ssl_ctx=ctx,
        identity=ep.tls_identity,
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """A proxy answer in protocol-neutral form (HTTP/1 and HTTP/2 each render it)."""

    status: int
    message: str


class OutboundRouter(h1plan.Router):
    """Per-request destination, route and endpoint choice for one client connection.

    HTTP/1 uses it as its `Router` (`plan_now`, `plan`); HTTP/2 (agent.proxy.h2route)
    calls the protocol-neutral steps per stream: `destination`, `route_of`, `hop`,
    `local_policy`. Both get the same memos of label sets and hops, shared with the
    worker's other connections from the same client to the same destination (rule 5).
    Each keeps one more of its own: the last request's hop and same-node authorization,
    reused by the next request with the same head when the balancer picks the same
    endpoint (HTTP/1 `_Lane`, HTTP/2 `h2route._Repeat`).
    """

    def __init__(
        self, conn: Conn, src: PodInfo | None, key: tuple[str, str], dst: Destination
    ) -> None:
        super().__init__(DIRECTION)
        self.worker = conn.worker
        # The worker's state, typed: read through the interpreted `Worker` it was two
        # lookups by name and a generic compare per request (agent.native rule 11).
        self.state: WorkerState = conn.worker.state
        self.plane = plane_of(conn.worker)
        self.src = src
        self.netns = conn.listener.netns
        self.key = key
        self.dst = dst
        # The client as B's policy sees it on a same-node hop: A's pod IP, else the peer.
        client: str = src.ip if src is not None else conn.peer[0]
        self.client = client
        self.client_ip = parse_ip(client)
        # the loop's clock, bound once (httpproxy's `now`); the connection's loop, not
        # asyncio.get_running_loop(): a getpid() in 3.11
        self.now: Callable[[], float] = conn.loop.time
        # The label sets and hops: shared by the worker's connections from this client to
        # this destination (rule 5), so a new connection's first request finds them made.
        shared = _shared(self.plane.routes, src, self.netns, client, key)
        self._labels: dict[tuple[str, str | None], dict[str, str]] = shared.labels
        self._choices: dict[tuple[tuple[str, int], int], _Choice] = shared.choices
        # shared by HTTP/1 requests and h2 streams, and by the client's connections (rule 5)
        self.authz_cache: inbound.AuthzCache = shared.authz
        self._memo: tuple[http1.RequestHead, int, httpproxy.Plan] | None = None
        self._lane: _Lane | None = None

    # --- HTTP/1: agent.proxy.httpproxy's Router ---

    def close(self) -> None:
        # The memo's plan calls back into this router: a cycle once the connection ends.
        self._memo = None
        self._lane = None

    def plan_now(self, head: http1.RequestHead) -> httpproxy.Plan | httpproxy.Reject | None:
        gen = self.state.generation
        memo = self._memo
        if memo is not None and memo[0] is head and memo[1] == gen:
            return memo[2]  # the same head (parser cache) and state as last time
        found = self.destination_now(h1msg.dst_override(head.headers))
        if found is None:
            return None  # not known yet: `plan` asks and waits
        if isinstance(found, Refusal):
            return httpproxy.reject(found.status, found.message)
        plan = self._plan(head, found[0], found[1])
        self._memo = (head, gen, plan)
        return plan

    async def plan(self, head: http1.RequestHead) -> httpproxy.Plan | httpproxy.Reject:
        got = self.plan_now(head)
        if got is not None:
            return got
        found = await self.destination(h1msg.dst_override(head.headers))
        if isinstance(found, Refusal):
            return httpproxy.reject(found.status, found.message)
        return self._plan(head, found[0], found[1])

    def _plan(
        self, head: http1.RequestHead, key: tuple[str, str], dst: Destination
    ) -> httpproxy.Plan:
        entry, route, labels = self.route_of(
            key, dst, head.method.decode("latin-1"), inbound.path_of(head.target)
        )
        # Endpoints the current request already tried. The plan is reused by later requests
        # with the same head (`plan_now`), one at a time: attempt 1 starts afresh.
        tried: list[tuple[str, int]] = []

        def choose(attempt: int) -> httpproxy.Target | httpproxy.Reject:
            if attempt == 1:
                tried.clear()
            return self._choose(entry, head, labels, tried)

        return httpproxy.Plan(
            choose=choose,
            route=route,
            budget=entry.budget if route is not None and route.is_retryable else None,
            timeout_s=route.timeout_s if route is not None else None,
            labels=labels,
        )

    def _choose(
        self,
        entry: DstEntry,
        head: http1.RequestHead,
        labels: dict[str, str],
        tried: list[tuple[str, int]],
    ) -> httpproxy.Target | httpproxy.Reject:
        handle = entry.balancer.pick(self.now(), self.plane.rng, tried)
        if handle is None:
            return httpproxy.reject(503, no_endpoints(labels))
        lane = self._lane
        if (
            lane is not None
            and lane.head is head
            and lane.stats is handle.stats
            and lane.gen == self.state.generation
            and fresh(lane.choice.expires)
        ):
            tried.append(lane.addr)
            if lane.counted is not None:
                lane.counted.count()
            return lane.target(handle)
        picked = self.hop(handle, labels, tried)
        if isinstance(picked, Refusal):
            return httpproxy.reject(picked.status, picked.message)
        choice = picked[1]
        counted = None
        if choice.hop.kind == "local":
            policy_key, facts = choice.authz or self.local_policy(choice)
            # each fact by name: `**facts` was a generic call whose keywords the callee
            # parsed at every new connection
            decision, counted = inbound.authorize_http(
                self.worker,
                policy_key,
                head.method,
                head.target,
                client_ip=facts["client_ip"],
                identity=facts["identity"],
                tls=facts["tls"],
                port=facts["port"],
                labels=facts["labels"],
                cache=self.authz_cache,
                token=head,
                shared_key=facts["shared_key"],
            )
            if not decision.allowed:
                handle.cancel()
                return inbound.deny_answer(decision, head.headers)
        lane = _Lane(head, self.state.generation, handle.stats, choice, counted)
        self._lane = lane
        return lane.target(handle)

    # --- protocol-neutral steps (HTTP/1 above, HTTP/2 in agent.proxy.h2route) ---

    def destination_now(
        self, override: str | None
    ) -> tuple[tuple[str, str], Destination] | Refusal | None:
        """(key, destination) of a request: the `l5d-dst-override` one, else the connection's.

        A refusal when the override names no mesh destination; None when it is not
        known yet (`destination` asks and waits).
        """
        if not override:
            value = self.state.get(self.key, self.dst)
            return self.key, value if isinstance(value, Destination) else self.dst
        key = (DST, override)
        dst = self.state.get(key)
        return None if dst is None else _mesh_destination(key, dst)

    async def destination(
        self, override: str | None
    ) -> tuple[tuple[str, str], Destination] | Refusal:
        """`destination_now`, asking the supervisor and waiting when it is not known yet."""
        found = self.destination_now(override)
        if found is not None:
            return found
        assert override  # noqa: S101 - only an unknown override waits
        key = (DST, override)
        try:
            dst = await self.state.want(key, kind=DST, wait_s=DST_WAIT_S)
        except TimeoutError:
            return Refusal(503, f"no destination for {override}")
        return _mesh_destination(key, dst)

    def route_of(
        self, key: tuple[str, str], dst: Destination, method: str, path: str
    ) -> tuple[DstEntry, Route | None, dict[str, str]]:
        """The destination's entry, the profile route matched, the request's labels."""
        entry = self.plane.entry(key, dst)
        route = None
        if dst.profile is not None and dst.profile.routes:
            route = match_route(dst.profile, method, path)
        authority = dst.authority or key[1]
        lkey = (authority, route.name if route is not None else None)
        labels = self._labels.get(lkey)
        if labels is None:  # the same dict each time: the recorder keys series by its items
            labels = {"direction": DIRECTION, "authority": authority}
            if route is not None:
                labels["rt_route"] = route.name
            if len(self._labels) >= _SHARED_MAX:
                self._labels.clear()
            self._labels[lkey] = labels
        return entry, route, labels

    def hop(
        self, handle: Handle, labels: dict[str, str], tried: list[tuple[str, int]]
    ) -> tuple[Handle, _Choice] | Refusal:
        """The hop to the endpoint the balancer picked (appended to `tried`); a refusal
        (the handle ended as failed) when there is none."""
        ep = handle.endpoint
        tried.append(ep.addr)
        choice = self._choice(ep, labels)
        if isinstance(choice, UpstreamError):
            handle.done(self.now(), ok=False)
            return Refusal(choice.status, str(choice))
        return handle, choice

    def local_policy(self, choice: _Choice) -> tuple[Hashable, dict[str, Any]]:
        """B's policy key and the facts a same-node request is authorized with (kept on `choice`).

        The facts are keyword arguments of `inbound.authorize_http`: A's identity as a
        verified client, A's address, the port, B's inbound labels, and all of these as one
        key for the worker's shared decisions.
        """
        if choice.authz is None:
            peer = choice.hop.peer
            assert peer is not None  # noqa: S101 - set for local hops
            port = choice.hop.addr[1]
            identity = self.src.identity if self.src is not None else None
            labels = {"direction": "inbound", "namespace": peer.namespace, "pod": peer.name}
            facts = {
                "client_ip": self.client_ip,
                "identity": identity,
                "tls": identity is not None,
                "port": port,
                "labels": labels,
                # the same facts, hashable without the address object (authorize_http)
                "shared_key": (self.client, identity, port, peer.namespace, peer.name),
            }
            choice.authz = ((POLICY, peer.key, port), facts)
        return choice.authz

    def _choice(self, ep: Endpoint, labels: dict[str, str]) -> _Choice | UpstreamError:
        """The hop to `ep` and what a Target needs, reused while the state it read is the same."""
        state = self.state
        gen = state.generation
        ckey = (ep.addr, id(labels))
        got = self._choices.get(ckey)
        if (  # nothing in the state changed since: only the certificate's clock can
            got is not None
            and got.gen == gen
            and got.ep is ep
            and got.base is labels
            and fresh(got.expires)
        ):
            return got
        peer_key = state.get((POD_IP, ep.addr[0]))
        peer = state.get((POD, peer_key)) if peer_key is not None else None
        src = self.src
        material = (
            state.get((TLS, src.identity))
            if src is not None and ep.tls_identity is not None
            else None
        )
        if (
            got is not None
            and got.ep is ep
            and got.base is labels
            and got.peer is peer
            and got.material is material
            and fresh(got.expires)
        ):
            got.gen = gen
            return got
        try:
            hop = hop_for(self.worker, src, self.netns, ep)
        except UpstreamError as exc:
            return exc
        rewrite = None
        if hop.kind == "local":
            rewrite = _client_id(src.identity if src is not None else None)
        got = _Choice(
            gen=gen,
            ep=ep,
            base=labels,
            peer=peer,
            material=material,
            hop=hop,
            open=hop_opener(self.worker, hop),
            rewrite=rewrite,
            labels={**labels, "dst_addr": f"{ep.addr[0]}:{ep.addr[1]}", "hop": hop.kind},
            worker=self.worker,
        )
        if len(self._choices) >= _SHARED_MAX:
            self._choices.clear()
        self._choices[ckey] = got
        return got


_SHARED_MAX: Final = 256  # entries per shared cache (and memos per worker); cleared whole when full


class _Shared:
    """Rule 5: an `OutboundRouter`'s label sets (by authority and route), hops (by
    endpoint and label set) and same-node authorizations (with their counters, bound for
    the client's pod: agent.proxy.record rule 5), for every connection from one client to
    one destination."""

    __slots__ = ("authz", "choices", "labels", "src")

    def __init__(self, src: PodInfo | None) -> None:
        self.src = src  # held, so that no other pod's record takes its id while kept
        self.labels: dict[tuple[str, str | None], dict[str, str]] = {}
        self.choices: dict[tuple[tuple[str, int], int], _Choice] = {}
        self.authz = inbound.AuthzCache()


def _shared(
    routes: dict[Hashable, Any], src: PodInfo | None, netns: str, client: str, key: Hashable
) -> _Shared:
    """The memo of connections from `src` (its record: a new record is a new memo) in
    `netns`, at address `client`, to destination `key`."""
    mkey = (id(src), netns, client, key)
    got: _Shared | None = routes.get(mkey)
    if got is None or got.src is not src:
        if len(routes) >= _SHARED_MAX:
            routes.clear()
        got = routes[mkey] = _Shared(src)
    return got


def _mesh_destination(
    key: tuple[str, str], dst: object
) -> tuple[tuple[str, str], Destination] | Refusal:
    """An override's state value as (key, destination), or the refusal when it is not one."""
    if not isinstance(dst, Destination) or not dst.exists:
        return Refusal(503, f"{key[1]} is not a mesh destination")
    return key, dst


class _Choice:
    """A resolved hop to one endpoint, valid while `ep`, `base`, `peer`, `material` are."""

    __slots__ = (
        "authz",
        "base",
        "ep",
        "expires",
        "gen",
        "h2",
        "h2_key",
        "h2_plain",
        "hop",
        "labels",
        "material",
        "open",
        "peer",
        "rewrite",
    )

    def __init__(  # noqa: PLR0913 - plain record
        self,
        *,
        gen: int,
        ep: Endpoint,
        base: dict[str, str],
        peer: Any,
        material: Any,
        hop: _Hop,
        open: httpproxy.Opener,  # noqa: A002 - the Target field's name
        rewrite: Any,
        labels: dict[str, str],
        worker: Worker,
    ) -> None:
        self.gen = gen  # the state generation it was checked against
        self.ep = ep
        self.base = base
        self.peer = peer
        self.material = material
        self.expires = material.not_after if material is not None else None  # of the source cert
        self.hop = hop
        self.open = open
        self.rewrite = rewrite
        self.labels = labels
        # (B's policy key, facts); the key an object, kept boxed (agent.native rule 7)
        self.authz: tuple[Hashable, dict[str, Any]] | None = None  # local hops
        # HTTP/1 goes upgraded to h2 (rule 4): an mTLS hop to an endpoint hinted `h2`.
        mode = worker.h2_upgrade
        upgrade = mode != "off" and hop.kind == "mtls" and ep.protocol_hint is ProtocolHint.H2
        self.h2: H2Pool | None = h2pool.pool_of(worker) if upgrade else None
        self.h2_key: Hashable = ("h2", hop.key) if upgrade else None
        self.h2_plain = h1toh2.AUTO_PLAIN if mode == "auto" else 0


class _Lane:
    """The last HTTP/1 request's decision, for the next identical head on the connection.

    A request with the same head object (the parser hands out one per distinct head),
    in the same state generation, for which the balancer picked the same endpoint,
    reuses the hop and the same-node authorization (`OutboundRouter._choose`); the
    balancer still picks every request, and the authorization is still counted (with
    the handle it was decided with). A certificate that expired since ends the lane as
    it ends `_Choice` reuse.
    """

    __slots__ = ("addr", "choice", "counted", "gen", "head", "stats")

    def __init__(
        self,
        head: http1.RequestHead,
        gen: int,
        stats: EndpointStats,
        choice: _Choice,
        counted: BoundAuthz | None,
    ) -> None:
        self.head = head
        self.gen = gen
        self.stats = stats
        # the endpoint's address, read once (`Endpoint` is interpreted: a lookup by name),
        # as an object: typed as its tuple it would be rebuilt at each read (native rule 7)
        self.addr: Any = stats.endpoint.addr
        self.choice = choice
        self.counted = counted  # a same-node hop's authorization: counted again per request

    def target(self, handle: Handle) -> httpproxy.Target:
        choice = self.choice
        return httpproxy.Target(
            key=choice.hop.key,
            open=choice.open,
            rewrite=choice.rewrite,
            handle=handle,
            labels=choice.labels,
            h2=choice.h2,
            h2_key=choice.h2_key,
            h2_plain=choice.h2_plain,
        )


def no_endpoints(labels: dict[str, str]) -> str:
    return f"no endpoints for {labels['authority']}"


def _client_id(identity: str | None) -> Any:
    def rewrite(headers: http1.Headers) -> http1.Headers:
        return h1msg.set_client_id(headers, identity)

    return rewrite


def hop_opener(worker: Worker, hop: _Hop) -> TransportOpener:
    """How to open a connection over `hop` (a pool calls it with its protocol factory)."""
    return transport_opener(
        worker, netns=hop.netns, addr=hop.addr, ssl_ctx=hop.ssl_ctx, identity=hop.identity
    )


# --- the handler -------------------------------------------------------------------------


async def handle(conn: Conn) -> None:
    """Serve one connection accepted on a pod's outbound listener (see the module rules)."""
    worker = conn.worker
    orig = accept.target_of(conn)
    # the listener itself? Its accepted sockets' local port is its own (REDIRECT and the
    # connect hook both send to it), so only a match asks for the address (accept rule 5)
    if orig[1] == conn.port and orig == conn.local:
        raise worker_mod.ProxyLoopError(conn.listener.listener_id, orig)
    src = worker.state.get((POD, conn.listener.pod))
    src = src if isinstance(src, PodInfo) else None
    key = (DST, f"{orig[0]}:{orig[1]}")
    dst = worker.state.get(key)
    if dst is None:
        try:
            dst = await worker.state.want(key, kind=DST, wait_s=DST_WAIT_S)
        except TimeoutError:
            logger.info(
                "no destination answer, forwarding", extra={**conn.log_extra(), "dst": key[1]}
            )
    if not isinstance(dst, Destination) or not dst.exists:
        await _forward(conn, orig, conn.held.prefix, eof=conn.held.eof)
        return
    prefix, eof = bytes(conn.held.prefix), conn.held.eof
    opaque = dst.opaque or (dst.profile is not None and dst.profile.opaque_protocol)
    opaque = opaque or (src is not None and orig[1] in src.opaque_ports)
    proto: Protocol | None = Protocol.OPAQUE
    if not opaque:
        proto, prefix, eof = await read_prefix(
            conn.transport,
            prefix,
            eof=eof,
            decide=_detect,
            timeout=DETECT_TIMEOUT_S,
            loop=conn.loop,
        )
    if proto is Protocol.HTTP1:
        router = OutboundRouter(conn, src, key, dst)
        await httpproxy.serve(
            conn.transport, router, plane_of(worker).pool, prefix, eof=eof, loop=conn.loop
        )
        return
    if proto is Protocol.HTTP2:  # per stream (agent.proxy.h2route)
        await h2route.serve_outbound(conn, src, key, dst, prefix, eof=eof)
        return
    await _relay_endpoint(conn, src, key, dst, prefix, eof=eof)


async def _forward(
    conn: Conn, target: tuple[str, int], prefix: bytes | bytearray, *, eof: bool
) -> None:
    """Not a mesh destination: relay to the original destination from A's netns."""
    relay = await start_relay(
        conn.worker,
        conn.transport,
        netns=conn.listener.netns,
        addr=target,
        prefix=bytes(prefix),
        eof=eof,
    )
    conn.relay = relay
    await relay.wait()


async def _relay_endpoint(  # noqa: PLR0913 - the facts of one connection
    conn: Conn,
    src: PodInfo | None,
    key: tuple[str, str],
    dst: Destination,
    prefix: bytes,
    *,
    eof: bool,
) -> None:
    """Opaque connection: one balanced endpoint for its lifetime."""
    worker = conn.worker
    plane = plane_of(worker)
    loop = asyncio.get_running_loop()
    entry = plane.entry(key, dst)
    handle = entry.balancer.pick(loop.time(), plane.rng)
    if handle is None:
        logger.info("no endpoints, closing", extra={**conn.log_extra(), "dst": key[1]})
        return
    labels = {"direction": DIRECTION, "authority": dst.authority or key[1]}
    try:
        hop = hop_for(worker, src, conn.listener.netns, handle.endpoint)
        if hop.kind == "local":
            assert hop.peer is not None  # noqa: S101 - set for local hops
            identity = src.identity if src is not None else None
            facts = Facts(
                client_ip=parse_ip(src.ip if src is not None else conn.peer[0]),
                client_identity=identity,
                tls=identity is not None,
                dst_port=hop.addr[1],
            )
            handle.cancel()
            await inbound.relay_to_app(
                conn,
                conn.transport,
                hop.peer,
                hop.addr[1],
                facts,
                prefix=prefix,
                eof=eof,
                pair=True,
            )
            return
        relay = await start_relay(
            worker,
            conn.transport,
            netns=hop.netns,
            addr=hop.addr,
            prefix=prefix,
            eof=eof,
            ssl_ctx=hop.ssl_ctx,
            expect_identity=hop.identity,
        )
    except (UpstreamError, OSError, AgentError):
        handle.done(loop.time(), ok=False)
        raise
    conn.relay = relay
    started = time.monotonic()
    recorder().tcp_open(DIRECTION, labels)
    try:
        await relay.wait()
    finally:
        handle.cancel()  # a connection's lifetime is no RTT sample
        recorder().tcp_close(
            DIRECTION,
            labels,
            bytes_in=relay.bytes_up,
            bytes_out=relay.bytes_down,
            duration_s=time.monotonic() - started,
        )
