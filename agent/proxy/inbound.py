"""The inbound handler: traffic that reached a pod's inbound listener (B's :4143).

Flow per connection (DESIGN.md "Flows", inbound):
1. Target port = the original destination port (`accept.resolve_target`:
   SO_ORIGINAL_DST in iptables mode; in eBPF sk_lookup mode the accepted
   socket's local address). A connection that was not redirected (straight
   to 4143) is refused.
2. The first bytes decide TLS: a ClientHello whose SNI is B's identity is
   terminated with B's certificate, a client certificate is required and
   verified, and the verified identity is the client's. Anything else is
   plaintext and the client unauthenticated; a ClientHello for another name
   is passed through, opaque, to the app.
3. B's policy for the port (`("policy", pod, port)`) authorizes: opaque TCP
   once per connection, a denied connection is closed; HTTP/1 per request and
   HTTP/2 per stream (agent.proxy.h2route), a denied request gets 403 (gRPC:
   status 7 with HTTP 200). `l5d-client-id` is set from the verified identity;
   a client-sent copy is always removed. HTTP/1 that a peer proxy sent
   upgraded (h2 streams marked `l5d-orig-proto`) is authorized per stream and
   reaches the app as HTTP/1 (agent.proxy.h2toh1), also on a port whose policy
   says HTTP/1: over mTLS the first bytes tell h2 from HTTP/1 there.
4. Allowed traffic goes to B's app at B's pod IP and the original port, from
   a socket made inside B's netns with the proxy mark (so capture skips it).
   Chosen over 127.0.0.1 as Linkerd does since 2.11 (linkerd2#6495): ports
   the app binds only on loopback are not exposed through the proxy, and apps
   that bind the pod IP only are reachable. The same in eBPF mode: sk_lookup
   cannot see the proxy mark, but it never steers a connection from the pod
   to its own address (bpf/sk_lookup.c), so this one does not loop back.
5. Until a port's policy arrives the connection waits up to
   `POLICY_WAIT_S`, then the node's default policy applies
   (`NodeInfo.default_inbound_policy`, Linkerd's `all-unauthenticated` by
   default); an invalid policy denies. Once one wait has timed out, the next
   connections to that port get the default at once until the policy arrives
   (the control plane is down, or the pod has more undeclared ports than the
   supervisor follows): the same decision, without a second's wait each. Live
   TCP connections are re-checked when the policy value changes
   (agent.proxy.plane rule 3).

The same-node path of outbound uses `authorize_http`, `app_target` and
`relay_to_app` with the calling pod's identity (tls=True, authenticated).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from agent.errors import AgentError
from agent.identity.tls import peer_identity
from agent.policy.authorize import Decision, Facts, IPAddress, authorize, parse_ip
from agent.policy.model import ProxyProtocol, ServerPolicy
from agent.proxy import accept, h1msg, h1plan, h2route, http1, httpproxy, tcp
from agent.proxy.detect import NEED_MORE, NeedMore, Protocol, detect, is_tls_client_hello, parse_sni
from agent.proxy.plane import Guard, Plane, plane_of, read_prefix
from agent.proxy.record import BoundAuthz, recorder
from agent.proxy.state import NODE, POD, POLICY, TLS, NodeInfo, PodInfo
from agent.proxy.tlsio import TlsHandshakeError, TlsTransport
from agent.proxy.upstream import UpstreamError, start_relay, transport_opener

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Hashable

    from agent.proxy.accept import Conn
    from agent.proxy.worker import Worker
    from agent.proxy.wstate import WorkerState

logger = logging.getLogger(__name__)

DIRECTION: Final = "inbound"
POLICY_WAIT_S: Final = 1.0
POD_WAIT_S: Final = 2.0
TLS_SNIFF_TIMEOUT_S: Final = 10.0
# server-speaks-first apps on opaque ports wait this long at most
OPAQUE_SNIFF_TIMEOUT_S: Final = 1.0
HANDSHAKE_TIMEOUT_S: Final = 10.0


class _Plain:
    """Verdict of the TLS sniff: not a ClientHello."""


_PLAIN: Final = _Plain()


def _sniff_tls(buf: bytes, eof: bool) -> str | _Plain | NeedMore | None:
    """SNI of a ClientHello (None: a hello without SNI), `_PLAIN`, or NEED_MORE."""
    hello = is_tls_client_hello(buf)
    if hello is NEED_MORE:
        return _PLAIN if eof else NEED_MORE
    if not hello:
        return _PLAIN
    sni = parse_sni(buf)
    if sni is NEED_MORE:
        return None if eof else NEED_MORE
    return sni


def _detect(buf: bytes, eof: bool) -> Protocol | NeedMore:
    return detect(buf, eof=eof)


# --- policy ----------------------------------------------------------------------


def default_policy(worker: Worker) -> ServerPolicy:
    """The policy used while a port's policy is unknown (see rule 5)."""
    node: NodeInfo | None = worker.state.get((NODE,))
    if node is None:
        return ServerPolicy.default("all-unauthenticated")
    try:
        return ServerPolicy.default(
            node.default_inbound_policy, cluster_networks=node.cluster_networks
        )
    except ValueError:
        return ServerPolicy.invalid()


def policy_from(worker: Worker, value: object) -> ServerPolicy:
    """A state value as the policy to apply: none yet: the default; not a policy: fail closed."""
    if isinstance(value, ServerPolicy):
        return value
    return default_policy(worker) if value is None else ServerPolicy.invalid()


async def current_policy(worker: Worker, key: Hashable) -> ServerPolicy:
    """The policy at `key`, waiting `POLICY_WAIT_S` for a first answer, else the default
    (at once if a wait for it timed out before and nothing came since: rule 5)."""
    value = worker.state.get(key)
    if value is None:
        if worker.state.unanswered(key):  # rule 5: waited once already
            return default_policy(worker)
        try:
            value = await worker.state.want(key, kind=POLICY, wait_s=POLICY_WAIT_S)
        except TimeoutError:
            logger.info("no policy yet, using the default", extra={"policy": str(key)})
            return default_policy(worker)
    return policy_from(worker, value)


def labels_for(pod: PodInfo, port: int, identity: str | None, *, tls: bool) -> dict[str, str]:
    """The inbound metric labels of a connection to `pod`'s `port` (HTTP/1, HTTP/2, TCP)."""
    return {
        "direction": DIRECTION,
        "namespace": pod.namespace,
        "pod": pod.name,
        "target_port": str(port),
        "tls": "true" if tls else "no_identity",
        "client_id": identity or "",
    }


def _is_grpc(headers: http1.Headers) -> bool:
    ctype = h1msg.get_header(headers, b"content-type")
    return ctype is not None and ctype.lower().startswith(b"application/grpc")


def path_of(target: bytes) -> str:
    """The path of a request target (origin- or absolute-form), query excluded."""
    text = target.decode("latin-1")
    if not text.startswith("/") and "://" in text:  # absolute-form: scheme://authority/path
        rest = text.partition("://")[2]
        slash = rest.find("/")
        text = rest[slash:] if slash >= 0 else "/"
    return text.partition("?")[0]


def deny_message(decision: Decision) -> str:
    """The `l5d-proxy-error` text of a denied request or stream."""
    return f"unauthorized request on server {decision.server.name}: {decision.reason.value}"


def decide(  # noqa: PLR0913 - the facts of one request
    policy: ServerPolicy,
    *,
    method: str,
    path: str,
    client_ip: IPAddress,
    identity: str | None,
    tls: bool,
    port: int,
    labels: dict[str, str],
) -> tuple[Decision, dict[str, str]]:
    """`policy`'s decision for one HTTP request or stream (`policy_from` resolves the policy),
    and the metric labels merged with the decision's."""
    facts = Facts(
        client_ip=client_ip,
        client_identity=identity,
        tls=tls,
        dst_port=port,
        method=method,
        path=path,
    )
    decision = authorize(policy, facts)
    return decision, {**labels, **decision.labels()}


def deny_answer(decision: Decision, headers: http1.Headers) -> httpproxy.Reject:
    """403 (404 for no route) with `l5d-proxy-error`, or gRPC PERMISSION_DENIED."""
    message = deny_message(decision)
    if _is_grpc(headers):
        return httpproxy.reject(200, message, grpc=h1msg.GRPC_PERMISSION_DENIED)
    return httpproxy.reject(decision.http_status, message)


# A cached decision: the policy object it was made with, the decision, its counting handle.
_Entry = tuple[ServerPolicy, Decision, BoundAuthz]
# A decision shared by a worker's connections: the policy object, the decision, the metric
# labels merged with it (each connection binds its own counting handle: `record` rule 5).
_Shared = tuple[ServerPolicy, Decision, dict[str, str]]
_E = TypeVar("_E", _Entry, _Shared)


class _PolicyMemo(Generic[_E]):
    """Entries whose first item is the policy object they were made with, reused while the
    policy is that same object; cleared when full."""

    __slots__ = ("_entries", "_max")

    def __init__(self, max_entries: int) -> None:
        self._entries: dict[Hashable, _E] = {}
        self._max = max_entries

    def get(self, key: Hashable, policy: ServerPolicy) -> _E | None:
        hit = self._entries.get(key)
        return hit if hit is not None and hit[0] is policy else None

    def put(self, key: Hashable, entry: _E) -> None:
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[key] = entry


class AuthzCache(_PolicyMemo[_Entry]):
    """Decisions of one client's requests, reused while the policy object is the same.

    `authorize` is pure and a connection's client facts (address, identity, TLS)
    never change, so a decision depends only on the policy value, the port and
    the method and target; the metric labels are merged, and bound to the recorder
    (`record` rule 5: for the connection's pod), once per decision. One connection's,
    or every connection's from the same client pod to one destination
    (agent.proxy.outbound rule 5).
    """

    __slots__ = ("last",)
    MAX_ENTRIES = 64

    def __init__(self) -> None:
        super().__init__(self.MAX_ENTRIES)
        # The last request's answer: (head, policy key, state generation, entry). The parser
        # hands out one head object per distinct head, so a repeat is an identity check.
        self.last: tuple[Any, Hashable, int, _Entry] | None = None


class SharedDecisions(_PolicyMemo[_Shared]):
    """Decisions across a worker's connections (`Plane.decisions`), so that a new
    connection's first request from a client seen before is decided by one lookup instead
    of `authorize` and its facts, a dozen interpreted calls (bench/RESULTS.md, fortieth
    pass). Keyed by everything `decide` reads: the policy key, method and target, the
    client's address, identity and TLS, the port and the labels; a hit must come from
    the same policy object."""

    __slots__ = ()
    MAX_ENTRIES = 1024

    def __init__(self) -> None:
        super().__init__(self.MAX_ENTRIES)


def authorize_http(  # noqa: PLR0913 - the facts of one request
    worker: Worker,
    policy_key: Hashable,
    method: bytes,
    target: bytes,
    *,
    client_ip: IPAddress,
    identity: str | None,
    tls: bool,
    port: int,
    labels: dict[str, str],
    cache: AuthzCache | None = None,
    token: object = None,
    shared_key: Hashable = None,
) -> tuple[Decision, BoundAuthz]:
    """Decide one HTTP/1 request or HTTP/2 stream with the current policy, and count it.

    Returns the decision and the handle it was counted with (`.labels`: under which
    labels; `.count()` counts it again).

    `method` and `target` as they came (the target's path is what routes match). The
    caller answers a denial (`deny_answer`; HTTP/2: agent.proxy.h2route). With `cache`
    (one per client connection: same client facts) a decision for the same policy
    object, port, method and target is reused; `token`, the parser's head object (one
    per distinct head), makes a repeat of the last request an identity check.
    `shared_key`, when given, stands for the client facts in `SharedDecisions`' key: it
    must differ wherever they do (the same-node router's names the client by its address
    as text, which hashes without an interpreted `IPv4Address.__hash__`).
    """
    state: WorkerState = worker.state  # typed: then a field read (agent.native rule 11)
    gen = state.generation
    entry = None
    if cache is not None:
        last = cache.last
        if last is not None and last[0] is token and last[1] is policy_key and last[2] == gen:
            entry = last[3]
    if entry is None:
        policy = policy_from(worker, state.get(policy_key))
        ckey = (policy_key, method, target)
        entry = cache.get(ckey, policy) if cache is not None else None
        if entry is None:
            plane = plane_of(worker)
            decisions = plane.decisions
            if decisions is None:
                decisions = plane.decisions = SharedDecisions()
            skey = (
                (ckey, shared_key)
                if shared_key is not None
                else (ckey, client_ip, identity, tls, port, tuple(labels.items()))
            )
            shared = decisions.get(skey, policy)
            if shared is None:
                decision, merged = decide(
                    policy,
                    method=method.decode("latin-1"),
                    path=path_of(target),
                    client_ip=client_ip,
                    identity=identity,
                    tls=tls,
                    port=port,
                    labels=labels,
                )
                decisions.put(skey, (policy, decision, merged))
            else:
                decision, merged = shared[1], shared[2]
            tally = recorder().bind_authz(merged, allowed=decision.allowed, http=True)
            entry = (policy, decision, tally)
            if cache is not None:
                cache.put(ckey, entry)
        if cache is not None and token is not None:
            cache.last = (token, policy_key, gen, entry)
    tally = entry[2]
    tally.count()
    return entry[1], tally


def app_addr(pod: PodInfo, port: int) -> tuple[str, int]:
    """Where B's app is reached from B's netns (rule 4): B's pod IP, in both capture modes."""
    return (pod.ip, port)


def app_target(worker: Worker, pod: PodInfo, port: int, identity: str | None) -> httpproxy.Target:
    """The pooled upstream to B's app (`app_addr`, original port, from B's netns)."""
    addr = app_addr(pod, port)
    opener = transport_opener(worker, netns=pod.netns, addr=addr)

    def rewrite(headers: http1.Headers) -> http1.Headers:
        return h1msg.set_client_id(headers, identity)

    key = plane_of(worker).pool.canonical(("app", pod.netns, addr))  # upstream rule 6
    return httpproxy.Target(key=key, open=opener, rewrite=rewrite)


class InboundRouter(h1plan.Router):
    """Per-request authorization, then B's app."""

    def __init__(  # noqa: PLR0913 - the facts of one connection
        self,
        worker: Worker,
        pod: PodInfo,
        port: int,
        *,
        client_ip: IPAddress,
        identity: str | None,
        tls: bool,
    ) -> None:
        super().__init__(DIRECTION)
        self.worker = worker
        self.pod = pod
        self.port = port
        self.client_ip = client_ip
        self.identity = identity
        self.tls = tls
        # An object, not tuple-typed: mypyc would make a new tuple at each read, and
        # `AuthzCache.last` finds a repeat by identity (agent.native rule 7).
        self.policy_key: Hashable = (POLICY, pod.key, port)
        self.labels = labels_for(pod, port, identity, tls=tls)
        self.target = app_target(worker, pod, port, identity)
        self.target.labels = self.labels
        self.authz_cache = AuthzCache()
        # Never mutated; its choice does not call back into the router (no reference cycle).
        self._plan = httpproxy.Plan(choose=_always(self.target), labels=self.labels)

    async def plan(self, head: http1.RequestHead) -> httpproxy.Plan | httpproxy.Reject:
        return self.plan_now(head)

    def plan_now(self, head: http1.RequestHead) -> httpproxy.Plan | httpproxy.Reject:
        decision, _ = authorize_http(
            self.worker,
            self.policy_key,
            head.method,
            head.target,
            client_ip=self.client_ip,
            identity=self.identity,
            tls=self.tls,
            port=self.port,
            labels=self.labels,
            cache=self.authz_cache,
            token=head,
        )
        return self._plan if decision.allowed else deny_answer(decision, head.headers)

    def close(self) -> None:
        """Nothing to drop: the plan holds no reference back to the router."""


def _always(target: httpproxy.Target) -> Callable[[int], httpproxy.Target]:
    """A plan's `choose` that picks `target` for every attempt."""
    return lambda _attempt: target


async def relay_to_app(  # noqa: PLR0913 - the facts of one connection
    conn: Conn,
    transport: asyncio.Transport,
    pod: PodInfo,
    port: int,
    facts: Facts,
    *,
    prefix: bytes,
    eof: bool,
    pair: bool = False,
) -> None:
    """Authorize a TCP connection once; relay it to B's app and guard it, or close it.

    `pair`: both legs are plain TCP inside pods of this node (the outbound's local
    hop), so the relay may hand its bytes to the kernel (agent.proxy.pairing).
    """
    worker = conn.worker
    plane = plane_of(worker)
    key = (POLICY, pod.key, port)
    held = tcp.hold(transport, prefix, eof=eof)  # the policy wait must not lose bytes
    policy = await current_policy(worker, key)
    prefix, eof = bytes(held.prefix), held.eof
    labels = labels_for(pod, port, facts.client_identity, tls=facts.tls)
    decision = authorize(policy, facts)
    recorder().authz({**labels, **decision.labels()}, allowed=decision.allowed, http=False)
    if not decision.allowed:
        logger.info(
            "connection denied",
            extra={**conn.log_extra(), "port": port, "reason": decision.reason.value},
        )
        transport.abort()
        return
    started = time.monotonic()
    recorder().tcp_open(DIRECTION, labels)
    relay = await start_relay(
        worker, transport, netns=pod.netns, addr=app_addr(pod, port), prefix=prefix, eof=eof
    )
    conn.relay = relay
    if pair and worker.pair_maps is not None:
        worker.pair_maps.pair(relay)  # agent.proxy.pairing
    plane.guard(
        Guard(
            policy_key=key,
            policy=policy,
            facts=facts,
            relay=relay,
            default=default_policy(worker),
            labels=labels,
        )
    )
    try:
        await relay.wait()
    finally:
        if not relay.done.done():
            relay.abort()
        recorder().tcp_close(
            DIRECTION,
            labels,
            bytes_in=relay.bytes_up,
            bytes_out=relay.bytes_down,
            duration_s=time.monotonic() - started,
        )


# --- the handler ---------------------------------------------------------------------


async def _pod(worker: Worker, key: str) -> PodInfo | None:
    pod = worker.state.get((POD, key))
    if pod is None:
        try:
            pod = await worker.state.want((POD, key), kind=POD, wait_s=POD_WAIT_S)
        except TimeoutError:
            return None
    return pod if isinstance(pod, PodInfo) else None


def _target_port(conn: Conn) -> int:
    """The original destination port (rule 1): SO_ORIGINAL_DST, else the local port."""
    try:
        return accept.target_of(conn)[1]
    except (OSError, AgentError):
        port: int = conn.local[1]
        return port


def _listener_port(conn: Conn) -> int | None:
    """The port the inbound listener itself is bound to (4143 unless annotated), as the
    worker read it when it began listening: asked of uvloop's server, each call made a
    `socket.socket` (two interpreted calls per connection)."""
    lst = conn.worker.listeners.get(conn.listener.listener_id)
    return lst.port if lst is not None else None


async def handle(conn: Conn) -> None:
    """Serve one connection accepted on a pod's inbound listener (see the module rules)."""
    worker = conn.worker
    pod = await _pod(worker, conn.listener.pod)
    if pod is None:
        logger.warning("inbound for an unknown pod, closing", extra=conn.log_extra())
        return
    port = _target_port(conn)
    # Redirected (iptables) connections arrive on the listener's port and name
    # another; steered (sk_lookup) ones arrive on their original port.
    if port == _listener_port(conn):
        logger.info("connection to the inbound port itself, closing", extra=conn.log_extra())
        return
    plane = plane_of(worker)
    policy = await current_policy(worker, (POLICY, pod.key, port))
    opaque = policy.protocol is ProxyProtocol.OPAQUE or port in pod.opaque_ports
    sniff_s = OPAQUE_SNIFF_TIMEOUT_S if opaque else TLS_SNIFF_TIMEOUT_S
    transport: asyncio.Transport = conn.transport
    sni, prefix, eof = await read_prefix(
        transport,
        bytes(conn.held.prefix),
        eof=conn.held.eof,
        decide=_sniff_tls,
        timeout=sniff_s,
        loop=conn.loop,
    )
    client_ip = parse_ip(conn.peer[0])
    identity: str | None = None
    tls = False
    if isinstance(sni, str) and sni == pod.identity:
        terminated = await _terminate(conn, plane, pod, prefix)
        if terminated is None:
            return
        transport, identity = terminated
        tls, prefix, eof = True, b"", False
    elif isinstance(sni, str) or (sni is None and is_tls_client_hello(prefix) is True):
        opaque = True  # TLS for someone else: pass through untouched
    await _serve(
        conn,
        transport,
        pod,
        port,
        policy,
        opaque=opaque,
        prefix=prefix,
        eof=eof,
        facts=Facts(client_ip=client_ip, client_identity=identity, tls=tls, dst_port=port),
    )


async def _terminate(
    conn: Conn, plane: Plane, pod: PodInfo, prefix: bytes
) -> tuple[asyncio.Transport, str] | None:
    """Terminate mTLS as B; the TLS transport and the verified client identity, or None."""
    material = conn.worker.state.get((TLS, pod.identity))
    try:
        ctx = plane.tls.server(material, pod.identity, now=time.time())
    except UpstreamError as exc:
        logger.warning(
            "cannot terminate tls, closing", extra={**conn.log_extra(), "error": str(exc)}
        )
        return None
    tlsx = TlsTransport(conn.transport, ctx, server_side=True, initial=prefix)
    try:
        await tlsx.handshake(HANDSHAKE_TIMEOUT_S)
    except TlsHandshakeError as exc:
        logger.info("tls handshake refused", extra={**conn.log_extra(), "error": exc.reason})
        tlsx.abort()
        return None
    identity = peer_identity(tlsx.get_extra_info("ssl_object"))
    if identity is None:
        logger.info("client certificate names no single identity", extra=conn.log_extra())
        tlsx.abort()
        return None
    return tlsx, identity


_DECLARED: Final = {  # a policy's declared protocol, as served (the others are detected)
    ProxyProtocol.HTTP1: Protocol.HTTP1,
    ProxyProtocol.HTTP2: Protocol.HTTP2,
    ProxyProtocol.GRPC: Protocol.HTTP2,
}


async def _serve(  # noqa: PLR0913 - the facts of one connection
    conn: Conn,
    transport: asyncio.Transport,
    pod: PodInfo,
    port: int,
    policy: ServerPolicy,
    *,
    opaque: bool,
    prefix: bytes,
    eof: bool,
    facts: Facts,
) -> None:
    proto: Protocol | None = Protocol.OPAQUE
    if not opaque:
        proto = _DECLARED.get(policy.protocol)  # None: detect
        # Over mTLS, a port declared HTTP/1 may get a peer proxy's HTTP/1 upgraded to h2
        # (l5d-orig-proto, agent.proxy.h2toh1): whether it did, the first bytes say.
        if proto is None or (proto is Protocol.HTTP1 and facts.tls):
            found, prefix, eof = await read_prefix(
                transport,
                prefix,
                eof=eof,
                decide=_detect,
                timeout=policy.detect_timeout_s,
                loop=conn.loop,
            )
            if proto is None or found is Protocol.HTTP2:
                proto = found
    if proto is Protocol.HTTP1:
        router = InboundRouter(
            conn.worker,
            pod,
            port,
            client_ip=facts.client_ip,
            identity=facts.client_identity,
            tls=facts.tls,
        )
        pool = plane_of(conn.worker).pool
        await httpproxy.serve(transport, router, pool, prefix, eof=eof, loop=conn.loop)
        return
    if proto is Protocol.HTTP2:  # authorized per stream (agent.proxy.h2route)
        await h2route.serve_inbound(conn, transport, pod, port, facts, prefix, eof=eof)
        return
    # Opaque TCP or a detect timeout: authorize once.
    await relay_to_app(conn, transport, pod, port, facts, prefix=prefix, eof=eof)
