"""Metrics hooks of the data path: a small recorder interface and a no-op default.

Rules:
1. The data path calls a `Recorder` at a few points (request, response, or
   both at once as `exchange`, TCP open/close, authorization); it never
   imports metrics code. The metrics helper's `WorkerMetrics` plugs in by
   assigning `agent.proxy.record.RECORDER` (read per connection, so a plugin
   may set it at import time).
2. Calls are cheap and never raise into the data path; labels are plain
   dicts of strings (Linkerd's label names: `direction`, `authority`,
   `dst_namespace`, `tls`, `client_id`, `srv_*`, `authz_*`, ...).
3. `direction` is "outbound" or "inbound"; durations are seconds.
4. Context, not arguments: the worker sets `CONN` (the accepted connection)
   in each connection's task, and the HTTP proxy sets `REQUEST` (the request
   head being served: `method`, `target` and `headers`, an `http1.RequestHead`
   or, per h2 stream, an `h2msg.RequestHead`), so a recorder can name the pod
   and, for tap, the method and path, without the data path passing them around.
   `agent.admin.observe` is the real recorder.
5. Bound handles for the hot path: `bind_http(direction, labels)` and
   `bind_authz(labels, ...)` resolve a label set once, in the connection's
   context, into a handle whose `exchange` / `count` is what `exchange` /
   `authz` would do for the same labels on that connection. An HTTP handle
   belongs to the connection that bound it (keep it in per-connection state
   only); an authorization handle counts for the pod whose listener accepted
   that connection, and may be kept for the pod's other connections from the
   same client (agent.proxy.outbound rule 5 shares them). Both stay right when
   the recorder's own caches change; `labels` is the dict a handle was bound
   with, so a holder can check identity before reusing it.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Final, Protocol

from agent.native import mypyc_attr

Labels = dict[str, str]

CONN: Final[ContextVar[Any]] = ContextVar("meshagent_conn", default=None)  # agent.proxy.accept.Conn
REQUEST: Final[ContextVar[Any]] = ContextVar("meshagent_request", default=None)  # see rule 4
# `REQUEST.set`, bound once: called per request, a method call by name was a lookup each time
SET_REQUEST: Final = REQUEST.set


class Recorder(Protocol):
    """What the data path reports; every method must be cheap and must not raise."""

    def request(self, direction: str, labels: Labels) -> None:
        """A request was sent towards its destination (after routing)."""

    def response(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        """A response (or a proxy error response) was sent back to the client."""

    def exchange(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        """`request` and then `response` for one request, in one call (the fast path's)."""

    def tcp_open(self, direction: str, labels: Labels) -> None:
        """A connection was accepted (or an upstream opened)."""

    def tcp_close(
        self, direction: str, labels: Labels, *, bytes_in: int, bytes_out: int, duration_s: float
    ) -> None:
        """A connection ended; bytes read from / written to the client."""

    def authz(self, labels: Labels, *, allowed: bool, http: bool) -> None:
        """An inbound authorization decision (per request for HTTP, per connection for TCP)."""

    def conn_end(self, conn: Any, error: BaseException | None) -> None:
        """An accepted connection's handler is done (`error`: what ended it, if anything)."""

    def bind_http(self, direction: str, labels: Labels) -> BoundHttp:
        """`exchange` for `labels` on the current connection, resolved once (rule 5)."""

    def bind_authz(self, labels: Labels, *, allowed: bool, http: bool) -> BoundAuthz:
        """`authz` for `labels` on the current connection, resolved once (rule 5)."""


@mypyc_attr(allow_interpreted_subclasses=True)
class BoundHttp:
    """`Recorder.exchange` for one label set of one connection; as it is, records nothing.
    A class, not a Protocol: the data path calls `exchange` per request, and through a
    Protocol that was a lookup by name (agent.native rule 12)."""

    __slots__ = ("labels",)

    def __init__(self, labels: Labels) -> None:
        self.labels = labels

    def exchange(self, status: int, latency_s: float, failure: bool) -> None:
        """As `Recorder.exchange(direction, labels, ...)` on the binding connection."""


@mypyc_attr(allow_interpreted_subclasses=True)
class BoundAuthz:
    """`Recorder.authz` for one label set and outcome on one connection's pod (rule 5); as
    it is, records nothing (a class for the reason `BoundHttp` is one)."""

    __slots__ = ("labels",)

    def __init__(self, labels: Labels) -> None:
        self.labels = labels

    def count(self) -> None:
        """As `Recorder.authz(labels, allowed=..., http=...)` on the binding connection's pod."""


class NoopRecorder:
    """The default: records nothing."""

    __slots__ = ()

    def request(self, direction: str, labels: Labels) -> None:
        pass

    def response(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        pass

    def exchange(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        pass

    def tcp_open(self, direction: str, labels: Labels) -> None:
        pass

    def tcp_close(
        self, direction: str, labels: Labels, *, bytes_in: int, bytes_out: int, duration_s: float
    ) -> None:
        pass

    def authz(self, labels: Labels, *, allowed: bool, http: bool) -> None:
        pass

    def conn_end(self, conn: Any, error: BaseException | None) -> None:
        pass

    def bind_http(self, direction: str, labels: Labels) -> BoundHttp:  # noqa: ARG002
        return BoundHttp(labels)

    def bind_authz(self, labels: Labels, *, allowed: bool, http: bool) -> BoundAuthz:  # noqa: ARG002
        return BoundAuthz(labels)


RECORDER: Recorder = NoopRecorder()


def recorder() -> Recorder:
    """The recorder in use (read at each call site, so it can be swapped at runtime)."""
    return RECORDER
