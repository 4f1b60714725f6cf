"""HTTP/2 proxying per stream: a thin asyncio shell over h2 connections (agent.proxy.h2codec).

`H2Conn` is one h2 connection (server side towards the client, client side
towards an upstream) as an `asyncio.Protocol`; `H2Stream` is one stream on
it, with a queue of what the peer sent and flow-controlled sends.
`agent.proxy.h2serve.serve` runs a client connection: each request stream asks a
`StreamRouter` where it goes, then is forwarded on a pooled upstream connection
(`H2Pool`), in the connections' callbacks when nothing in it waits (h2serve's
`Relay`), else in its own task (`proxy_stream`; `resume` takes over a relayed
stream where its callbacks stopped).

Rules:
1. Per stream: the router picks the upstream (outbound: the destination's
   balancer per stream; inbound: the app after authorizing the stream), or
   answers itself (`h2msg.Answer`: deny, no endpoint, 502...).
2. Flow control end to end, nothing buffered whole: a DATA frame's bytes are
   acknowledged to their sender (`H2Codec.acknowledge`, which opens
   the window again) only once the other side's h2 connection took them, and
   that side sends only what its peer's window allows, waiting for
   WINDOW_UPDATE (and for the transport to drain) otherwise. Memory per
   stream is bounded by the window we advertise (`STREAM_WINDOW`).
3. RST_STREAM both ways: a client reset cancels the upstream stream (CANCEL),
   an upstream reset resets the client stream with the same code. A stream
   error ends that stream only; a connection error ends that connection and
   resets its streams.
4. The balancer handle ends with `done(now, ok)` when the response ends;
   `ok` is `profile.classify` of the `:status` and the `grpc-status`
   (trailers, or the headers of a trailers-only response): grpc-status != 0
   is a failure. A reset or an abandoned attempt is a failure too.
5. A route timeout covers the time up to the response headers: past it the
   upstream stream is cancelled and the client gets 504 (gRPC: trailers-only
   grpc-status 4).
6. One upstream h2 connection per pool key (source pod, endpoint, identity),
   streams multiplexed on it; another is opened only when the peer's
   concurrent-stream limit is reached or the connection is going away.
   Connections idle (no stream) for `IDLE_TIMEOUT_S` are closed.
7. Metrics as HTTP/1 requests: `recorder().request` when a stream is sent
   upstream, `recorder().response` when its response ends (or the proxy
   answered); `record.REQUEST` holds an HTTP/1-shaped head of the stream's
   request in the stream's task, or before each recorder call in callbacks
   (`h2msg.RequestHead`, built only when read; h2serve rule 3).
8. Cost per stream stays low: the codec (h2codec, h2hpack) is ours and compiled
   with the rest of the path (agent.native), with no per-frame objects; frames of
   every stream go out in one write per connection per loop iteration (`flush`
   schedules it; `queued` writes at once past `FLUSH_BYTES` of DATA so `drained`
   sees the transport's buffer; a lane to another node's proxy, over mTLS, also
   writes as soon as it holds back as many streams as the other side has, h2conn's
   `write_early`); what is sent is not checked again (h2msg rule 4:
   what is forwarded was checked when received); a bodiless request gets no
   request-body task; a plain end queued behind DATA goes in that DATA's last frame;
   a stream's task has one done callback (the connection's set keeps it referenced);
   a finished stream holds no reference cycle (`H2Stream.discard`), so reference
   counting frees it, not the collector; what need not wait makes no coroutine (an
   established upstream connection, `H2Pool.stream_now`; an item already queued,
   `H2Stream.next_now`; DATA the window and the connection take at once,
   `H2Stream.send_data_now`); and a stream in which nothing waits has no task at
   all (agent.proxy.h2serve).

9. Inbound, a stream marked `l5d-orig-proto` (an HTTP/1 request a peer proxy
   upgraded) goes to the app as HTTP/1 (agent.proxy.h2toh1), after the same
   authorization.

The pieces: agent.proxy.h2stream (a stream and what its queue holds),
agent.proxy.h2conn (a connection), agent.proxy.h2pool (upstream connections),
agent.proxy.h2serve (a client connection, and its streams served in callbacks),
agent.proxy.h2codec (the protocol, sans-I/O), agent.proxy.h2hpack (HPACK).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable  # noqa: TC003 - a field type, see below
from dataclasses import dataclass
from typing import Final, Protocol

from agent import aio
from agent.proxy import h2msg
from agent.proxy.balance import Handle  # noqa: TC001 - a field type, see below
from agent.proxy.h2frame import ErrorCode
from agent.proxy.h2msg import Answer, H2Headers
from agent.proxy.h2pool import H2Pool, Opener  # noqa: TC001 - a field type, see below
from agent.proxy.h2stream import (
    CANCEL,
    NO_ERROR,
    Data,
    End,
    H2Stream,
    Head,
    StreamGoneError,
    Trailers,
)
from agent.proxy.h2toh1 import Downgrade  # noqa: TC001 - a field type, see below
from agent.proxy.model import Route  # noqa: TC001 - a field type, see below
from agent.proxy.origproto import Downgraded  # noqa: TC001 - a field type, see below
from agent.proxy.profile import classify
from agent.proxy.record import REQUEST, Labels, recorder
from agent.proxy.upstream import UpstreamError

# Routed's field types are imported at run time: compiled (agent.native), a dataclass
# resolves them when it is made.

logger = logging.getLogger(__name__)

ANSWER_DRAIN_S: Final = 5.0  # after answering early, how long the rest of a request is read


class _NoTimeout:
    """`async with` doing nothing, compiled with this module (contextlib's `nullcontext`
    runs in the interpreter, twice per stream); asyncio.timeout(None) costs a task lookup."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        return None


_NO_TIMEOUT: Final = _NoTimeout()  # reusable


# --- routing a stream ---------------------------------------------------------------------


@dataclass(slots=True, init=False)
class Routed:
    """Where one stream goes: a pool key, how to connect, the headers to send."""

    key: Hashable
    open: Opener
    headers: H2Headers
    handle: Handle | None
    route: Route | None
    timeout_s: float | None
    labels: Labels
    # Inbound, an upgraded HTTP/1 request (`l5d-orig-proto`): the way to the app over
    # HTTP/1 and the request it stands for.
    h1: tuple[Downgrade, Downgraded] | None

    def __init__(  # noqa: PLR0913 - one per stream: written (agent.native rule 5)
        self,
        *,
        key: Hashable,
        open: Opener,  # noqa: A002 - the field's name
        headers: H2Headers,
        handle: Handle | None = None,
        route: Route | None = None,
        timeout_s: float | None = None,
        labels: Labels | None = None,
        h1: tuple[Downgrade, Downgraded] | None = None,
    ) -> None:
        self.key = key
        self.open = open
        self.headers = headers
        self.handle = handle
        self.route = route
        self.timeout_s = timeout_s
        self.labels = {} if labels is None else labels
        self.h1 = h1


class StreamRouter(Protocol):
    """Decides, per stream, where it goes (outbound) or whether it may (inbound)."""

    direction: str

    async def route(self, headers: H2Headers) -> Routed | Answer:
        """The upstream for a request with these headers, or the proxy's answer."""
        ...

    def route_now(self, headers: H2Headers) -> Routed | Answer | None:
        """`route` when it would not wait; None when it would (`route` then decides)."""
        ...


async def proxy_stream(
    down: H2Stream,
    router: StreamRouter,
    pool: H2Pool,
    *,
    routed: Routed | None = None,
    t0: float | None = None,
) -> None:
    """Serve one request stream end to end (rules 1-5, 7); `routed` (and `t0`, when it
    was routed) when the stream was routed already (agent.proxy.h2serve)."""
    loop = down.conn.loop
    if t0 is None:
        t0 = loop.time()
        REQUEST.set(h2msg.RequestHead(down.request))
    up: H2Stream | None = None
    pump: asyncio.Task[int | None] | None = None
    try:
        if routed is None:
            got = await router.route(down.request)
            if isinstance(got, Answer):
                await _answer(down, got, router.direction, {}, t0)
                return
            routed = got
        recorder().request(router.direction, routed.labels)
        if routed.h1 is not None:  # rule 9
            way, request = routed.h1
            await way.serve(down, request, t0)
            return
        deadline = t0 + routed.timeout_s if routed.timeout_s is not None else None
        try:
            async with _NO_TIMEOUT if deadline is None else asyncio.timeout_at(deadline):
                up = pool.stream_now(routed.key, routed.headers, end=down.bodiless)
                if up is None:
                    up = await pool.stream(
                        routed.key, routed.open, routed.headers, end=down.bodiless
                    )
                pump = link(down, up)
                head = await _response_head(up)
        except (TimeoutError, UpstreamError) as exc:
            await _fail(down, up, routed, router.direction, t0, pump, exc)
            return
        await _respond(down, up, head, routed, router.direction, t0)
        await wait_request(down, pump)
    except StreamGoneError:
        gone(down, up, routed)
    finally:
        close(down, up, routed, pump)


async def resume(  # noqa: PLR0913, PLR0917 - where the callbacks left the stream
    down: H2Stream,
    up: H2Stream,
    routed: Routed,
    direction: str,
    t0: float,
    pump: asyncio.Task[int | None] | None,
    status: int | None,
) -> None:
    """Serve the rest of a stream whose callbacks (agent.proxy.h2serve) handed it over: from
    the response head (`status` None), or from the response body after a head of `status`
    was sent."""
    try:
        if status is None:
            try:
                head = await _response_head(up)
            except UpstreamError as exc:
                await _fail(down, up, routed, direction, t0, pump, exc)
                return
            await _respond(down, up, head, routed, direction, t0)
        else:
            grpc_status = await _pump(up, down, propagate=True)
            responded(down, routed, direction, t0, status, grpc_status)
        await wait_request(down, pump)
    except StreamGoneError:
        gone(down, up, routed)
    finally:
        close(down, up, routed, pump)


async def linger(
    down: H2Stream, up: H2Stream, routed: Routed, pump: asyncio.Task[int | None]
) -> None:
    """The response ended first and the request goes on in `pump` (rule 3)."""
    try:
        await wait_request(down, pump)
    finally:
        close(down, up, routed, pump)


async def wait_request(down: H2Stream, pump: asyncio.Task[int | None] | None) -> None:
    """The response ended: give the request's body a while to end too (rule 3)."""
    if pump is not None and not pump.done():
        done, _ = await asyncio.wait([pump], timeout=ANSWER_DRAIN_S)
        if not done:
            pump.cancel()
            down.reset(NO_ERROR)


def gone(down: H2Stream, up: H2Stream | None, routed: Routed | None) -> None:
    """Either stream was reset or lost: a failure, and both reset (rule 3)."""
    if routed is not None and routed.handle is not None:
        routed.handle.done(down.conn.loop.time(), ok=False)
    down.reset(CANCEL)
    if up is not None:
        up.reset(CANCEL)


def close(
    down: H2Stream,
    up: H2Stream | None,
    routed: Routed | None,
    pump: asyncio.Task[int | None] | None,
) -> None:
    """The stream is over: stop the request's body, end the balancer handle, close both."""
    if pump is not None and not pump.done():
        pump.cancel()
    if routed is not None and routed.handle is not None:
        routed.handle.cancel()  # no-op when done already
    down.close()
    if up is not None:
        up.close()


def link(down: H2Stream, up: H2Stream) -> asyncio.Task[int | None] | None:
    """Resets travel both ways (rule 3); the task forwarding the request body, if any."""
    link_resets(down, up)
    if up.local_ended:  # the request had no body: no task for it
        return None
    return pump_request(down, up)


def link_resets(down: H2Stream, up: H2Stream) -> None:
    """A reset of either stream resets the other (rule 3): the client's cancels upstream,
    the upstream's reaches the client with its code."""
    down.on_reset = up.cancel
    up.on_reset = down.reset


def pump_request(down: H2Stream, up: H2Stream) -> asyncio.Task[int | None]:
    """The task forwarding the rest of the request's body."""
    return aio.spawn(_pump(down, up), name="h2-request-body")


async def _response_head(up: H2Stream) -> Head:
    item = await up.next()
    if not isinstance(item, Head):
        raise UpstreamError("upstream", f"response began with {type(item).__name__}")
    return item


async def _respond(  # noqa: PLR0913, PLR0917 - the facts of one response
    down: H2Stream,
    up: H2Stream,
    head: Head,
    routed: Routed,
    direction: str,
    t0: float,
) -> None:
    status = h2msg.status_of(head.headers)
    down.send_headers(head.headers, end=head.end)
    grpc_status = h2msg.grpc_status(head.headers) if head.end else None
    if not head.end:
        grpc_status = await _pump(up, down, propagate=True)
    responded(down, routed, direction, t0, status, grpc_status)


def responded(  # noqa: PLR0913, PLR0917 - the facts of one response
    down: H2Stream,
    routed: Routed,
    direction: str,
    t0: float,
    status: int,
    grpc_status: int | None,
) -> None:
    """The response ended: its outcome to the balancer handle and the recorder (rule 4)."""
    now = down.conn.loop.time()
    failure = classify(routed.route, status, grpc_status)
    if routed.handle is not None:
        routed.handle.done(now, ok=not failure)
    recorder().response(
        direction, routed.labels, status=status, latency_s=now - t0, failure=failure
    )


async def _pump(src: H2Stream, dst: H2Stream, *, propagate: bool = False) -> int | None:
    """Forward DATA and trailers from `src` to `dst` until the end; the grpc-status seen.

    A reset on either side resets the other (rule 3) and ends the pump
    (re-raised when `propagate`). Each DATA item is acknowledged to `src`'s
    sender once `dst` took it (rule 2).
    """
    try:
        while True:
            item = src.next_now()
            if item is None:
                item = await src.next()
            if isinstance(item, Data):
                if await _forward(src, dst, item):
                    return None
            elif isinstance(item, Trailers):
                dst.send_headers(item.headers, end=True)
                return h2msg.grpc_status(item.headers)
            elif isinstance(item, End):
                if not dst.dismissed:
                    dst.end()
                return None
            else:  # a second HEADERS that is not trailers
                raise StreamGoneError(ErrorCode.PROTOCOL_ERROR)  # noqa: TRY301
    except StreamGoneError as exc:
        src.reset(CANCEL)
        dst.reset(exc.code)
        if propagate:
            raise
        return None


async def _forward(src: H2Stream, dst: H2Stream, item: Data) -> bool:
    """Send one DATA item on, then acknowledge it to `src`'s sender; True when the
    stream is over for `dst` (the plain end queued behind it went in the last frame).

    Raises:
        StreamGoneError: `dst` is gone (and not just done reading a complete stream).
    """
    end = src.peek_end()
    try:
        if not dst.send_data_now(item.data, end=end):
            await dst.send_data(item.data, end=end)
    except StreamGoneError:
        if dst.dismissed:
            await _discard_rest(src)  # the response is complete: rule 3
            return True
        raise
    finally:
        src.ack(item.flow)
    if end and src.peek_end():
        src.drop_end()
    return end


async def _discard_rest(src: H2Stream) -> None:
    """Read what is left of `src` (acknowledging it) until its end."""
    while True:
        item = await src.next()
        if isinstance(item, Data):
            src.ack(item.flow)
        elif isinstance(item, (Trailers, End)):
            return


async def _drain_request(down: H2Stream) -> None:
    """We answered first: read (and discard) the rest of the request, else reset it."""
    try:
        async with asyncio.timeout(ANSWER_DRAIN_S):
            while True:
                item = await down.next()
                if isinstance(item, Data):
                    down.ack(item.flow)
                elif isinstance(item, (Trailers, End)):
                    return
    except (TimeoutError, StreamGoneError):
        down.reset(NO_ERROR)


async def _fail(  # noqa: PLR0913, PLR0917 - the facts of one failed stream
    down: H2Stream,
    up: H2Stream | None,
    routed: Routed,
    direction: str,
    t0: float,
    pump: asyncio.Task[int | None] | None,
    exc: TimeoutError | UpstreamError,
) -> None:
    """No response head: the request's body stops, the upstream stream is cancelled,
    and the client gets the proxy's answer (504 past the route timeout, rule 5; else
    the error's status, 502 by default)."""
    if pump is not None:
        pump.cancel()
    if isinstance(exc, TimeoutError):
        why = (504, "request timed out")
    else:
        why = (getattr(exc, "status", 502), str(exc))
    down.on_reset = None
    if up is not None:
        up.on_reset = None
        up.reset(CANCEL)
    if routed.handle is not None:
        routed.handle.done(down.conn.loop.time(), ok=False)
    answer = h2msg.answer_for(why[0], why[1], grpc=h2msg.is_grpc(down.request))
    await _answer(down, answer, direction, routed.labels, t0)


async def _answer(
    down: H2Stream, answer: Answer, direction: str, labels: Labels, t0: float
) -> None:
    """Answer the stream ourselves, then read the rest of its request."""
    if answer_now(down, answer, direction, labels, t0):
        await _drain_request(down)


def answer_now(down: H2Stream, answer: Answer, direction: str, labels: Labels, t0: float) -> bool:
    """Send our answer and record it; whether the rest of the request is still to read.

    Raises:
        StreamGoneError: the stream is gone.
    """
    down.send_headers(h2msg.answer_headers(answer), end=True)
    status, failure = h2msg.answer_outcome(answer)
    recorder().response(
        direction,
        labels,
        status=status,
        latency_s=down.conn.loop.time() - t0,
        failure=failure,
    )
    return not down.remote_ended


async def drain(down: H2Stream) -> None:
    """After `answer_now`: read the rest of the request, then close the stream."""
    try:
        await _drain_request(down)
    finally:
        down.close()
