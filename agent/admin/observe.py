"""The worker side of observability: the data path's recorder, metrics reports, tap events.

Installed in every worker by the data-plane plugin (`agent.proxy.dataplane`):
`start(worker)` (a `worker.START_HOOKS` entry) makes an `Observer`, sets it
as `agent.proxy.record.RECORDER`, and runs its reporting task; `final(worker)`
(a `worker.DRAIN_HOOKS` entry) sends the last report before the worker exits.
This module holds what runs per request; the rest is in the `Observer`'s
bases: `agent.admin.tapping.Tapping` (tap events) over
`agent.admin.labelsets.LabelSets` (label sets into series), inherited so
that the per-request calls run the same statements as they would in one class.

Rules:
1. Labels follow `agent.admin.metrics`, as `agent.admin.labelsets` rule 1
   resolves them: the pod the traffic belongs to, its service account and
   owner, the target, tls and identities, destination and policy labels.
2. The same-node path is two proxies in one: an HTTP request an outbound
   router sends to a pod on this node is also counted (and tapped) as that
   pod's inbound traffic (`agent.admin.labelsets` rule 2).
3. TCP series: relays report open/close themselves (`tcp_open`/`tcp_close`);
   an HTTP connection is opened in the metrics at its first request and
   closed when its handler ends (`conn_end`), with its errno if it failed.
   Bytes are counted for relays only.
4. Every label set is interned once (`agent.admin.labelsets` rule 3); a call then
   costs a dict lookup and integer additions (on an HTTP connection, one
   lookup by the label dict's identity in the connection's own cache), and a
   bound handle (`bind_http`, `bind_authz`) only the additions: it keeps what
   it resolved while the observer's `gen` is the one it resolved in.
   Nothing here raises into the data path: a failure is logged once per
   kind and the event dropped.
5. Reports: a `Metrics` snapshot every `REPORT_S` and at drain, stamped with the
   wall-clock time it was taken (`meshagent_worker_last_report_timestamp_seconds`):
   a reader waits for every worker's stamp to pass a moment to hold every count
   made before it (the bench's settle, `agent.bench.mesh`). Tap: only
   while the supervisor's `("tap",)` state names the pod (or "*"), responses
   become events in a bounded ring (`agent.admin.tapping`; the oldest are
   dropped and counted), flushed as `TapEvents` `TAP_FLUSH_S` after the first
   event entered an empty ring, and with each report; traffic never waits. An idle
   worker (no connection) wakes once per `REPORT_S` for the reports and once per the
   loop-lag probe's window, not to look for tap events.
6. The taps are read from the worker's state (`WorkerState`, agent.proxy.wstate)
   only when its `generation` moved (`taps_now`), for bound and unbound calls alike:
   when the state was interpreted, each h2 response called `WorkerState.get` (found
   by counting interpreted calls under load: `agent.bench.interp`); compiled now, a
   lookup per response would still hash the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Final

from agent import aio
from agent.admin.labelsets import IDS_MAX, SVC_AUTHORITY, conn_pod
from agent.admin.metrics import Counter, HttpSeries, TcpSeries, errno_label
from agent.admin.node import measure_loop_lag
from agent.admin.tapping import TAP, Tapping
from agent.proxy import channel as ch
from agent.proxy import record
from agent.proxy.wstate import WorkerState  # noqa: TC001 - an attribute type of a compiled class

if TYPE_CHECKING:
    from agent.admin.metrics import WorkerMetrics
    from agent.proxy.accept import Conn
    from agent.proxy.record import Labels
    from agent.proxy.worker import Worker

logger = logging.getLogger(__name__)

REPORT_S: Final = 1.0
TAP_FLUSH_S: Final = 0.1


class _Open:
    """A connection counted as open in `series` since `t0` (monotonic seconds).

    `http` caches the connection's resolved HTTP series by the identity of the
    label dict the data path passed (routers reuse one dict per label set), so
    a request costs one lookup; valid while `gen` is the observer's generation.
    """

    __slots__ = ("gen", "http", "series", "t0")

    def __init__(self, series: TcpSeries, t0: float, gen: int = 0) -> None:
        self.series = series
        self.t0 = t0
        self.gen = gen
        self.http: dict[int, tuple[Labels, str, list[HttpSeries]]] = {}


class _BoundHttp(record.BoundHttp):
    """`Observer.exchange` for one label set of one connection (`record` rule 5)."""

    __slots__ = (
        "_conn",
        "_direction",
        "_gen",
        "_obs",
        "_series",
    )

    def __init__(self, obs: Observer, conn: Conn | None, direction: str, labels: Labels) -> None:
        super().__init__(labels)
        self._obs = obs
        self._conn = conn
        self._direction = direction
        self._gen = -1  # resolved at the first exchange: the connection opens then (rule 3)
        self._series: list[HttpSeries] = []

    def exchange(self, status: int, latency_s: float, failure: bool) -> None:
        obs = self._obs
        try:
            if self._gen != obs.gen:
                self._series = obs._conn_http(self._conn, self._direction, self.labels)  # noqa: SLF001 - same module
                self._gen = obs.gen
            latency_ms = latency_s * 1000.0
            success = not failure
            for series in self._series:
                series.requests.value += 1
                series.response(status, latency_ms, success)
            taps = obs.taps_now()
            if taps:
                obs._tap(  # noqa: SLF001
                    taps,
                    conn=self._conn,
                    direction=self._direction,
                    labels=self.labels,
                    status=status,
                    latency_ms=latency_ms,
                )
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            obs._fail(exc, "exchange")  # noqa: SLF001


class _BoundAuthz(record.BoundAuthz):
    """`Observer.authz` for one label set and outcome on one pod (`record` rule 5): it keeps
    the pod whose listener accepted the binding connection, not the connection."""

    __slots__ = ("_allowed", "_counter", "_gen", "_http", "_obs", "_pod")

    def __init__(
        self, obs: Observer, pod: str, labels: Labels, *, allowed: bool, http: bool
    ) -> None:
        super().__init__(labels)
        self._obs = obs
        self._pod = pod
        self._allowed = allowed
        self._http = http
        self._gen = -1
        self._counter: Counter | None = None

    def count(self) -> None:
        obs = self._obs
        try:
            counter = self._counter
            if counter is None or self._gen != obs.gen:
                counter = obs._authz_cell(self._pod, self.labels, self._allowed, self._http)  # noqa: SLF001 - same module
                self._counter = counter
                self._gen = obs.gen
            counter.value += 1
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            obs._fail(exc, "authz")  # noqa: SLF001


_CLOSED: Final = object()
_TAP_KEY: Final = (TAP,)
_CONN_CACHE_MAX: Final = 64  # label sets cached per connection (cleared when full)


class Observer(Tapping):
    """The data path's `Recorder` in one worker; see the module rules."""

    def __init__(self, worker: Worker, metrics: WorkerMetrics | None = None) -> None:
        super().__init__(worker, metrics)
        # typed: read through the interpreted worker, a lookup by name per request
        # (agent.native rule 11)
        self.state: WorkerState = worker.state
        self._failed: set[str] = set()
        # The taps in the worker's state, looked up again only when the state changed
        # (`generation`; rule 6).
        self._taps: Any = None
        self._taps_gen = -1
        self._loop: asyncio.AbstractEventLoop | None = None  # run()'s: it times tap flushes

    # --- Recorder -----------------------------------------------------------------

    def request(self, direction: str, labels: Labels) -> None:
        try:
            for series in self._conn_http(record.CONN.get(), direction, labels):
                series.requests.value += 1
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "request")

    def response(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        self._answered(direction, labels, status, latency_s, failure, request=False)

    def exchange(
        self, direction: str, labels: Labels, *, status: int, latency_s: float, failure: bool
    ) -> None:
        self._answered(direction, labels, status, latency_s, failure, request=True)

    def _answered(  # noqa: PLR0913 - the recorder call's facts
        self,
        direction: str,
        labels: Labels,
        status: int,
        latency_s: float,
        failure: bool,
        *,
        request: bool,
    ) -> None:
        """A response went back; `request`: count its request too (`exchange`)."""
        try:
            conn = record.CONN.get()
            latency_ms = latency_s * 1000.0
            success = not failure
            for series in self._conn_http(conn, direction, labels):
                if request:
                    series.requests.value += 1
                series.response(status, latency_ms, success)
            taps = self.taps_now()
            if taps:
                self._tap(
                    taps,
                    conn=conn,
                    direction=direction,
                    labels=labels,
                    status=status,
                    latency_ms=latency_ms,
                )
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "exchange" if request else "response")

    def tcp_open(self, direction: str, labels: Labels) -> None:
        try:
            conn = record.CONN.get()
            series = self._tcp_series(conn, direction, labels)
            series.open()
            if conn is not None and conn.obs is None:
                conn.obs = _Open(series, time.monotonic(), self.gen)
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "tcp_open")

    def tcp_close(
        self, direction: str, labels: Labels, *, bytes_in: int, bytes_out: int, duration_s: float
    ) -> None:
        try:
            conn = record.CONN.get()
            obs = conn.obs if conn is not None else None
            if isinstance(obs, _Open):
                series = obs.series
                conn.obs = _CLOSED
            else:
                series = self._tcp_series(conn, direction, labels)
            series.transferred(bytes_in, bytes_out)
            series.close(duration_s * 1000.0)
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "tcp_close")

    def authz(self, labels: Labels, *, allowed: bool, http: bool) -> None:
        try:
            self._authz_cell(conn_pod(record.CONN.get()), labels, allowed, http).value += 1
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "authz")

    def bind_http(self, direction: str, labels: Labels) -> record.BoundHttp:
        return _BoundHttp(self, record.CONN.get(), direction, labels)

    def bind_authz(self, labels: Labels, *, allowed: bool, http: bool) -> record.BoundAuthz:
        return _BoundAuthz(self, conn_pod(record.CONN.get()), labels, allowed=allowed, http=http)

    def conn_end(self, conn: Any, error: BaseException | None) -> None:
        try:
            obs = conn.obs
            conn.obs = _CLOSED
            if isinstance(obs, _Open):
                err = getattr(error, "errno", None) if isinstance(error, OSError) else None
                obs.series.close((time.monotonic() - obs.t0) * 1000.0, errno_label(err))
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "conn_end")

    def _fail(self, exc: Exception, where: str) -> None:
        if where not in self._failed:
            self._failed.add(where)
            logger.error(
                "BUG: recording failed, event dropped", extra={"where": where}, exc_info=exc
            )

    def taps_now(self) -> Any:
        """The `("tap",)` value of the worker's state (None: no tap), read from the state
        only when its generation moved (rule 6)."""
        state = self.state
        gen = state.generation
        if gen != self._taps_gen:
            self._taps = state.get(_TAP_KEY)
            self._taps_gen = gen
        return self._taps

    # --- the connection's caches ------------------------------------------------------

    def _conn_http(self, conn: Conn | None, direction: str, labels: Labels) -> list[HttpSeries]:
        """Rule 3's open, then the HTTP series of `labels`: cached on the connection."""
        if conn is None:
            return self._http_series(conn, direction, labels)
        obs = conn.obs
        if obs is None:
            self._conn_open(conn, direction, labels)
            obs = conn.obs
        if type(obs) is not _Open:
            return self._http_series(conn, direction, labels)
        cache = obs.http
        if obs.gen != self.gen:
            cache.clear()
            obs.gen = self.gen
        hit = cache.get(id(labels))
        if hit is not None and hit[0] is labels and hit[1] == direction:
            return hit[2]
        found = self._http_series(conn, direction, labels)
        if len(cache) >= _CONN_CACHE_MAX:
            cache.clear()
        cache[id(labels)] = (labels, direction, found)
        return found

    def _conn_open(self, conn: Conn | None, direction: str, labels: Labels) -> None:
        """Rule 3: an HTTP connection counts as opened at its first request."""
        if conn is None or conn.obs is not None:
            return
        series = self._tcp_series(conn, direction, labels)
        series.open()
        conn.obs = _Open(series, time.monotonic(), self.gen)

    def _authz_cell(self, pod: str, labels: Labels, allowed: bool, http: bool) -> Counter:
        """The counter of `labels` and outcome, for traffic accepted by `pod`'s listener
        (`labelsets.conn_pod`)."""
        ikey = (id(labels), allowed, http, pod)  # labelsets rule 3: by identity first
        hit = self._authz_ids.get(ikey)
        if hit is not None and hit[0] is labels:
            return hit[1]
        key = (http, allowed, tuple(labels.items()), pod)
        counter = self._authz.get(key)
        if counter is None:
            counter = self._authz[key] = self._authz_counter(pod, labels, allowed, http)
        if len(self._authz_ids) >= IDS_MAX:
            self._authz_ids.clear()
        self._authz_ids[ikey] = (labels, counter)
        return counter

    # --- reports ---------------------------------------------------------------------

    def update_balancers(self) -> None:
        """`outbound_http_balancer_endpoints` of every Service this worker balances for."""
        from agent.proxy.plane import plane_of  # noqa: PLC0415 - the worker's plane, lazily

        seen: set[str] = set()
        for entry in plane_of(self.worker).dsts.values():
            authority = entry.dst.authority
            match = SVC_AUTHORITY.match(authority) if authority else None
            if match is None or authority in seen:
                continue
            seen.add(authority)
            name, ns, port = match.groups()
            ready = len(entry.dst.endpoints)
            self.m.balancer_endpoints(
                namespace=ns, name=name, port=int(port), ready=ready, pending=0
            )

    def report(self) -> None:
        """Send the current snapshot (and queued tap events) to the supervisor."""
        self.forget_departed()
        self.update_balancers()
        self.m.set_reported(time.time())
        self.worker.send(ch.Metrics(worker_id=self.worker.worker_id, snapshot=self.m.snapshot()))
        self.flush_tap()

    def flush_tap(self) -> None:
        msg = self.take_tap()
        if msg is not None:
            self.worker.send(msg)

    def _tap_waiting(self) -> None:
        loop = self._loop
        if loop is not None:  # rule 5: the ring was empty, so no flush is pending
            loop.call_later(TAP_FLUSH_S, self._flush_tap_due)

    def _flush_tap_due(self) -> None:
        try:
            self.flush_tap()
        except Exception:
            logger.exception("BUG: tap flush failed")

    async def run(self) -> None:
        """Forever: a report every `REPORT_S`; tap events are flushed when they come."""
        worker = self.worker
        lag = aio.spawn(
            measure_loop_lag(self.m.set_loop_lag, busy=lambda: bool(worker.conns)),
            name="loop-lag",
        )
        self._loop = asyncio.get_running_loop()
        try:
            while True:
                await asyncio.sleep(REPORT_S)
                try:
                    self.report()
                except Exception:
                    logger.exception("BUG: metrics report failed")
        finally:
            self._loop = None
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag


# --- worker hooks (installed by agent.proxy.dataplane) ------------------------------


def start(worker: Worker) -> asyncio.Task[None]:
    """START_HOOKS entry: record into a new `Observer` and run its reports."""
    observer = Observer(worker)
    record.RECORDER = observer  # one worker per process
    return aio.spawn(observer.run(), name="metrics-report")


def final(worker: Worker) -> None:
    """DRAIN_HOOKS entry: the last report, so nothing counted is lost on a clean exit."""
    observer = record.RECORDER
    if isinstance(observer, Observer) and observer.worker is worker:
        observer.report()
