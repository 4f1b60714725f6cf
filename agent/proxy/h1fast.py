"""The HTTP/1 callback path: one request served inside protocol callbacks.

agent.proxy.httpproxy (module rule 7) starts a `CallbackExchange` from the
client's `data_received` when a request arrived whole and can go at once; the
upstream connection (agent.proxy.h1upstream) then feeds it the response, and
it answers the client from there, in the connection's context.

Rules:
1. The response leaves in one client write per batch of upstream events:
   head (`response_head`, hop-by-hop dropped) and body pieces joined; a
   whole response is held to the end of the loop's batch of callbacks
   (agent.proxy.writes).
2. At the end: the balancer handle is done with the response's class, the
   upstream connection goes back to the pool, the recorder counts request and
   response, and the connection takes its next queued request (`pump`).
3. Failure before the head: a pooled connection that died without a byte is
   not the request's fault, so the request is handed to the coroutine
   (`Handoff`) to be sent again on a fresh connection; garbage is answered
   502. After the head the client is aborted (httpproxy's module rule 5).
4. A late callback of an exchange its connection no longer serves is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, cast

from agent.proxy import h1msg, http1
from agent.proxy.h1plan import Plan, Target  # noqa: TC001 - field types: compiled, a dataclass resolves them
from agent.proxy.http1 import (
    BodyData,
    Framing,
    MessageEnd,
    ProtocolError,
    RequestHead,
    ResponseHead,
    Upgraded,
)
from agent.proxy.profile import classify
from agent.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from collections import deque

    from agent.proxy.h1upstream import UpstreamConn
    from agent.proxy.httpproxy import HttpConn

WHOLE_PIECES_MAX: Final = 16  # body pieces of a request the callback path takes at once
KEEP_TE: Final = frozenset({b"transfer-encoding"})
NO_KEEP: Final[frozenset[bytes]] = frozenset()

HeadOut = tuple[list[bytes | memoryview], bool]


@dataclass(slots=True)
class Handoff:
    """A request the callbacks began (head taken, maybe planned) that the coroutine finishes."""

    head: RequestHead
    t0: float
    plan: Plan | None = None
    target: Target | None = None


class CallbackExchange:
    """One request served in protocol callbacks: the upstream connection's exchange."""

    __slots__ = (
        "body",
        "conn",
        "ended",
        "failure",
        "got_bytes",
        "head",
        "interim",
        "keep",
        "out",
        "plan",
        "resp",
        "t0",
        "target",
        "up",
    )

    def __init__(  # noqa: PLR0913 - the facts of one request
        self,
        conn: HttpConn,
        up: UpstreamConn,
        *,
        head: RequestHead,
        t0: float,
        plan: Plan,
        target: Target,
        body: list[bytes | memoryview],
    ) -> None:
        self.conn = conn
        self.up = up
        self.head = head
        self.t0 = t0
        self.plan = plan
        self.target = target
        self.body = body  # kept to hand the request back if the connection was dead
        self.resp: ResponseHead | None = None
        self.out: list[bytes | memoryview] = []  # for the client, written once per batch
        self.ended = False
        self.got_bytes = False
        self.interim = False
        self.failure = False
        self.keep = True

    # What UpstreamConn calls (outside the connection's context)
    # (the methods run in the context are passed unbound: `self._on_whole` made a bound
    # method by name per response, agent.native rule 12)
    def on_events(self, events: list[http1.Event]) -> None:
        if events and self.conn.fast is self:
            self.conn.in_ctx(_ON_EVENTS, self, events)

    def on_whole(self, head: ResponseHead, data: bytes) -> None:
        if self.conn.fast is self:
            self.conn.in_ctx(_ON_WHOLE, self, head, data)

    def fail(self, err: UpstreamError) -> None:
        if self.conn.fast is self and not self.ended:
            self.conn.in_ctx(_BROKEN, self, err)

    def _on_whole(self, resp: ResponseHead, data: bytes) -> None:
        """A whole final response: forwarded as it came when its head needs no change."""
        self.got_bytes = True
        parts = self._final_head(resp)
        out = self.out
        if parts[0] is resp.raw and not out:  # `response_head` kept the head as received
            conn = self.conn
            conn.batch.hold(conn.transport, data)  # agent.proxy.writes
            self._finish()
            return
        out += parts
        end = len(resp.raw) + 4
        if len(data) > end:
            out.append(memoryview(data)[end:])
        self._end()

    def _on_events(self, events: list[http1.Event]) -> None:
        self.got_bytes = True
        out = self.out
        for ev in events:
            kind = type(ev)
            if kind is BodyData:
                out.append(cast("BodyData", ev).data)
            elif kind is MessageEnd:
                if self.interim:
                    self.interim = False
                    continue
                self._end()
                return
            elif kind is ResponseHead:
                resp = cast("ResponseHead", ev)
                if resp.status < 200:
                    self.interim = True  # no Expect on this path: nobody waits for a 100
                    continue
                out += self._final_head(resp)
            elif kind is ProtocolError:
                reason = cast("ProtocolError", ev).reason
                self._broken(UpstreamError("upstream", f"bad response: {reason}"))
                return
            elif kind is Upgraded:
                self._broken(UpstreamError("upstream", "protocol switch is not supported here"))
                return
            else:
                raise AssertionError(f"BUG: unexpected response event {ev!r}")
        self._flush()

    def _final_head(self, resp: ResponseHead) -> list[bytes | memoryview]:
        """Take the final response head: its classification, and its bytes for the client."""
        self.resp = resp
        self.failure = classify(self.plan.route, resp.status)
        parts, self.keep = self.conn.response_head(self.head, resp)
        return parts

    def _flush(self) -> None:
        out = self.out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        conn = self.conn
        conn.write(data)
        tr = self.up.transport
        if conn.write_paused and tr is not None:
            tr.pause_reading()

    def _end(self) -> None:
        self._flush()
        self._finish()

    def _finish(self) -> None:
        """The response was written whole: settle the endpoint, pool, metrics; next request."""
        self.ended = True
        conn = self.conn
        up = self.up
        resp = self.resp
        assert resp is not None  # noqa: S101 - the parser ends a message only after its head
        now = conn.now()
        target = self.target
        if target.handle is not None:
            target.handle.done(now, not self.failure)
        up.finish()
        conn.current = None
        if resp.keep_alive:
            conn.pool.release(up)  # closes it when not reusable
        else:
            up.close()
        conn.exchanged(
            target.labels, resp.status, now - self.t0, failure=self.failure, keep=self.keep
        )

    def _broken(self, err: UpstreamError) -> None:
        """The upstream failed: resend, answer 502, or abort the client (rule 5)."""
        self.ended = True
        conn = self.conn
        up = self.up
        target = self.target
        handle = target.handle
        up.finish()
        up.abort()
        conn.current = None
        conn.fast = None
        now = conn.now()
        if self.resp is not None:  # the head went out: the client cannot be told
            if handle is not None:
                handle.done(now, ok=False)
            conn.transport.abort()
            conn.stop = True
        elif conn.down.lost:  # we aborted it because the client went away
            if handle is not None:
                handle.cancel()
        elif not self.got_bytes:  # a pooled connection that was dead: send it again
            if handle is not None:
                handle.cancel()
            conn.down.push_front(self.body)
            conn.handoff = Handoff(self.head, self.t0, self.plan)
        else:
            if handle is not None:
                handle.done(now, ok=False)
            conn.answer_failed(
                err.status, str(err), self.t0, target.labels, keep_alive=self.head.keep_alive
            )
        conn.pump()


def whole_request(events: deque[http1.Event]) -> int:
    """How many events after the head at `events[0]` end its request (body pieces and end).

    0 when the request has not arrived whole or its body came in too many pieces.
    """
    for i in range(1, min(len(events), WHOLE_PIECES_MAX + 2)):
        kind = type(events[i])
        if kind is MessageEnd:
            return i
        if kind is not BodyData:
            return 0
    return 0


def response_head(head: RequestHead, resp: ResponseHead) -> HeadOut:
    """The response head for the client (hop-by-hop dropped), and whether it keeps alive."""
    keep = head.keep_alive and resp.framing is not Framing.UNTIL_CLOSE
    headers = h1msg.strip_hop_by_hop(
        resp.headers, keep=KEEP_TE if resp.framing is Framing.CHUNKED else NO_KEEP
    )
    if (
        headers is resp.headers
        and keep
        and head.version == b"1.1"
        and resp.version == b"1.1"
        and resp.reason
        and resp.raw
    ):
        return [resp.raw, b"\r\n\r\n"], keep  # nothing to change: as received
    if not keep:
        headers = [*headers, (b"connection", b"close")]
    elif head.version == b"1.0":
        headers = [*headers, (b"connection", b"keep-alive")]
    return [h1msg.response_head_bytes(resp.status, headers, resp.reason or None)], keep


_ON_EVENTS: Final = CallbackExchange._on_events  # noqa: SLF001 - its own module
_ON_WHOLE: Final = CallbackExchange._on_whole  # noqa: SLF001
_BROKEN: Final = CallbackExchange._broken  # noqa: SLF001
