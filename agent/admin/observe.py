"""The worker side of observability: the data path's recorder, metrics reports, tap events.

Installed in every worker by the data-plane plugin (`agent.proxy.dataplane`):
`start(worker)` (a `worker.START_HOOKS` entry) makes an `Observer`, sets it
as `agent.proxy.record.RECORDER`, and runs its reporting task; `final(worker)`
(a `worker.DRAIN_HOOKS` entry) sends the last report before the worker exits.

Rules:
1. Labels follow `agent.admin.metrics`: the pod the traffic belongs to
   (outbound: the pod whose listener accepted, from `record.CONN`; inbound:
   the pod named in the data path's labels), its service account and owner
   (from the `("pod", key)` PodInfo), `direction`, `authority` (outbound
   only: an inbound Host header is client-chosen, so unbounded), `target_addr`,
   `tls` with `server_id`/`client_id`, `dst_*` from the endpoint's metric
   labels, `srv_*`/`route_*`/`authz_*` from the policy decision.
2. The same-node path is two proxies in one: an HTTP request an outbound
   router sends to a pod on this node is also counted as that pod's inbound
   traffic (tls "true", client_id = the caller's identity, which the kernel
   vouched for), as it would be with a sidecar on each side.
3. TCP series: relays report open/close themselves (`tcp_open`/`tcp_close`);
   an HTTP connection is opened in the metrics at its first request and
   closed when its handler ends (`conn_end`), with its errno if it failed.
   Bytes are counted for relays only.
4. Every label set is interned once per (pod, direction, labels); a call then
   costs a dict lookup and integer additions (on an HTTP connection, one
   lookup by the label dict's identity in the connection's own cache), and a
   bound handle (`bind_http`, `bind_authz`) only the additions: it keeps what
   it resolved while the observer's `gen` is the one it resolved in.
   Nothing here raises into the data path: a failure is logged once per
   kind and the event dropped.
5. Reports: a `Metrics` snapshot every `REPORT_S` and at drain. Tap: only
   while the supervisor's `("tap",)` state names the pod (or "*"), responses
   become events in a bounded ring (`TAP_RING`; the oldest are dropped and
   counted), flushed as `TapEvents` every `TAP_FLUSH_S`; traffic never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from agent import aio
from agent.admin.families import OWNER_KINDS
from agent.admin.metrics import (
    Counter,
    HttpSeries,
    PodMeta,
    Ref,
    TcpSeries,
    Tls,
    WorkerMetrics,
    dst_labels,
    errno_label,
)
from agent.admin.node import measure_loop_lag
from agent.proxy import channel as ch
from agent.proxy import record
from agent.proxy.state import POD, POD_IP, PodInfo

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agent.proxy.record import Labels
    from agent.proxy.worker import Conn, Worker

logger = logging.getLogger(__name__)

REPORT_S = 1.0
TAP_FLUSH_S = 0.1
TAP_RING = 1024
TAP = "tap"  # state key ("tap",) -> frozenset of pod keys being tapped ("*": all)
_SVC_AUTHORITY = re.compile(r"^([^.]+)\.([^.]+)\.svc\.[^:]*:(\d+)$")


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


class _BoundHttp:
    """`Observer.exchange` for one label set of one connection (`record` rule 5)."""

    __slots__ = ("_conn", "_direction", "_gen", "_obs", "_series", "_state", "labels")

    def __init__(self, obs: Observer, conn: Conn | None, direction: str, labels: Labels) -> None:
        self._obs = obs
        self._state = obs.worker.state
        self._conn = conn
        self._direction = direction
        self.labels = labels
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
            taps = self._state.get(_TAP_KEY)
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


class _BoundAuthz:
    """`Observer.authz` for one label set and outcome of one connection (`record` rule 5)."""

    __slots__ = ("_allowed", "_conn", "_counter", "_gen", "_http", "_obs", "labels")

    def __init__(
        self, obs: Observer, conn: Conn | None, labels: Labels, *, allowed: bool, http: bool
    ) -> None:
        self._obs = obs
        self._conn = conn
        self.labels = labels
        self._allowed = allowed
        self._http = http
        self._gen = -1
        self._counter: Counter | None = None

    def count(self) -> None:
        obs = self._obs
        try:
            counter = self._counter
            if counter is None or self._gen != obs.gen:
                counter = obs._authz_cell(self._conn, self.labels, self._allowed, self._http)  # noqa: SLF001 - same module
                self._counter = counter
                self._gen = obs.gen
            counter.value += 1
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            obs._fail(exc, "authz")  # noqa: SLF001


_CLOSED = object()
_TAP_KEY = (TAP,)
_CONN_CACHE_MAX = 64  # label sets cached per connection (cleared when full)


def _addr(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _owner(info: PodInfo) -> tuple[str, str]:
    for kind, name in sorted(info.owner_labels.items()):
        if kind in OWNER_KINDS and name:
            return kind, name
    return "", ""


class Observer:
    """The data path's `Recorder` in one worker; see the module rules."""

    def __init__(self, worker: Worker, metrics: WorkerMetrics | None = None) -> None:
        self.worker = worker
        self.m = metrics or WorkerMetrics(worker.worker_id)
        self._pods: dict[str, tuple[Any, PodMeta]] = {}
        self._http: dict[tuple[Any, ...], list[HttpSeries]] = {}
        self._tcp: dict[tuple[Any, ...], TcpSeries] = {}
        self._authz: dict[tuple[Any, ...], Counter] = {}
        self._endpoints: dict[tuple[str, str], tuple[str | None, tuple[tuple[str, str], ...]]] = {}
        self.tap_ring: deque[dict[str, Any]] = deque(maxlen=TAP_RING)
        self.tap_dropped = 0
        self._failed: set[str] = set()
        self.gen = 0  # bumped when interned series are dropped (per-connection caches, handles)

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
            taps = self.worker.state.get(_TAP_KEY)
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
            self._authz_cell(record.CONN.get(), labels, allowed, http).value += 1
        except Exception as exc:  # noqa: BLE001 - rule 4: never into the data path
            self._fail(exc, "authz")

    def bind_http(self, direction: str, labels: Labels) -> record.BoundHttp:
        return _BoundHttp(self, record.CONN.get(), direction, labels)

    def bind_authz(self, labels: Labels, *, allowed: bool, http: bool) -> record.BoundAuthz:
        return _BoundAuthz(self, record.CONN.get(), labels, allowed=allowed, http=http)

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

    # --- pods -------------------------------------------------------------------------

    def pod_meta(self, key: str) -> PodMeta:
        """Labels of the pod `ns/name` (from its PodInfo; cached while that is unchanged)."""
        info = self.worker.state.get((POD, key))
        cached = self._pods.get(key)
        if cached is not None and cached[0] is info:
            return cached[1]
        ns, _, name = key.partition("/")
        if isinstance(info, PodInfo):
            kind, owner = _owner(info)
            meta = PodMeta(
                namespace=info.namespace,
                pod=info.name,
                serviceaccount=info.service_account,
                owner_kind=kind,
                owner_name=owner,
            )
        else:
            meta = PodMeta(namespace=ns, pod=name)
        self._pods[key] = (info, meta)
        return meta

    def _pod_info(self, key: str) -> PodInfo | None:
        info = self.worker.state.get((POD, key))
        return info if isinstance(info, PodInfo) else None

    def _own_pod(self, conn: Conn | None, labels: Labels) -> str:
        if "namespace" in labels and "pod" in labels:
            return f"{labels['namespace']}/{labels['pod']}"
        return conn.listener.pod if conn is not None else "/"

    def forget_departed(self) -> list[str]:
        """Drop the series of pods no longer enrolled here; their keys."""
        gone = [k for k in self._pods if k != "/" and (POD, k) not in self.worker.state]
        for key in gone:
            ns, _, name = key.partition("/")
            self.m.forget_pod(ns, name)
            del self._pods[key]
        if gone:  # re-intern everything (the recorder's caches may name them)
            self.gen += 1
            self._http.clear()
            self._tcp.clear()
            self._authz.clear()
        return gone

    # --- label sets --------------------------------------------------------------------

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

    def _http_series(self, conn: Conn | None, direction: str, labels: Labels) -> list[HttpSeries]:
        pod_key = self._own_pod(conn, labels) if direction == "inbound" else _conn_pod(conn)
        key = (pod_key, direction, tuple(labels.items()))
        found = self._http.get(key)
        if found is None:
            found = self._http[key] = self._new_http(pod_key, direction, labels)
        return found

    def _new_http(self, pod_key: str, direction: str, labels: Labels) -> list[HttpSeries]:
        pod = self.pod_meta(pod_key)
        if direction == "inbound":
            in_target, in_tls = self._inbound_target(pod_key, labels)
            return [
                self.m.http(pod, direction="inbound", authority="", target=in_target, tls=in_tls)
            ]
        authority = labels.get("authority", "")
        dst_addr = labels.get("dst_addr", "")
        target = _addr(dst_addr) if dst_addr else None
        hop = labels.get("hop")
        server_id, ep_labels = self._endpoint(authority, dst_addr)
        dst = dst_labels({**_service_dst(authority), **dict(ep_labels)})
        tls: Tls | None = None
        peer: PodInfo | None = None
        if hop == "local" and target is not None:
            peer_key = self.worker.state.get((POD_IP, target[0]))
            peer = self._pod_info(peer_key) if isinstance(peer_key, str) else None
            tls = Tls.established(peer.identity) if peer is not None else Tls(state="true")
        elif hop == "mtls":
            tls = Tls.established(server_id or "")
        elif hop == "plain":
            tls = Tls.no_identity("not_provided_by_service_discovery")
        out = [
            self.m.http(
                pod, direction="outbound", authority=authority, target=target, tls=tls, dst=dst
            )
        ]
        if "rt_route" in labels:
            out.append(
                self.m.route(pod, direction="outbound", dst=authority, rt_route=labels["rt_route"])
            )
        if peer is not None and target is not None:  # rule 2
            src = self._pod_info(pod_key)
            client_tls = Tls.established(src.identity) if src else Tls.no_identity("loopback")
            out.append(
                self.m.http(
                    self.pod_meta(peer.key),
                    direction="inbound",
                    authority="",
                    target=target,
                    tls=client_tls,
                )
            )
        return out

    def _inbound_target(
        self, pod_key: str, labels: Labels
    ) -> tuple[tuple[str, int] | None, Tls | None]:
        port = labels.get("target_port", "")
        info = self._pod_info(pod_key)
        target = (info.ip, int(port)) if info is not None and port.isdigit() else None
        if "tls" not in labels:
            return target, None
        if labels["tls"] == "true":
            return target, Tls.established(labels.get("client_id", ""))
        return target, Tls.no_identity("no_tls_from_remote")

    def _endpoint(
        self, authority: str, dst_addr: str
    ) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """The tls identity and metric labels of endpoint `dst_addr` of `authority`."""
        if not dst_addr:
            return None, ()
        key = (authority, dst_addr)
        found = self._endpoints.get(key)
        if found is not None:
            return found
        from agent.proxy.plane import plane_of  # noqa: PLC0415 - the worker's plane, lazily

        result: tuple[str | None, tuple[tuple[str, str], ...]] = (None, ())
        for entry in plane_of(self.worker).dsts.values():
            for ep in entry.dst.endpoints:
                if f"{ep.addr[0]}:{ep.addr[1]}" == dst_addr:
                    result = (ep.tls_identity, tuple(sorted(ep.labels.items())))
                    break
        self._endpoints[key] = result
        return result

    def _conn_open(self, conn: Conn | None, direction: str, labels: Labels) -> None:
        """Rule 3: an HTTP connection counts as opened at its first request."""
        if conn is None or conn.obs is not None:
            return
        series = self._tcp_series(conn, direction, labels)
        series.open()
        conn.obs = _Open(series, time.monotonic(), self.gen)

    def _tcp_series(self, conn: Conn | None, direction: str, labels: Labels) -> TcpSeries:
        if direction == "inbound":
            pod_key = self._own_pod(conn, labels)
            target, tls = self._inbound_target(pod_key, labels)
        else:
            pod_key = _conn_pod(conn)
            target, tls = _orig_dst(conn), Tls.no_identity("loopback")
        key = (pod_key, direction, target, tls)
        found = self._tcp.get(key)
        if found is None:
            found = self._tcp[key] = self.m.tcp(
                self.pod_meta(pod_key),
                direction=direction,
                peer="src",
                target=target or ("0.0.0.0", 0),
                tls=tls or Tls.no_identity("not_provided_by_remote"),
            )
        return found

    def _authz_cell(self, conn: Conn | None, labels: Labels, allowed: bool, http: bool) -> Counter:
        key = (http, allowed, tuple(labels.items()), conn.listener.pod if conn else "")
        counter = self._authz.get(key)
        if counter is None:
            counter = self._authz[key] = self._authz_counter(conn, labels, allowed, http)
        return counter

    def _authz_counter(
        self, conn: Conn | None, labels: Labels, allowed: bool, http: bool
    ) -> Counter:
        pod_key = self._own_pod(conn, labels)
        target, tls = self._inbound_target(pod_key, labels)
        if tls is None:  # the same-node path: the caller is the connection's pod
            src = self._pod_info(_conn_pod(conn))
            tls = Tls.established(src.identity) if src else Tls.no_identity("loopback")
        server = _ref(labels, "srv") or Ref(group="", kind="default", name="unknown")
        pod = self.pod_meta(pod_key)
        authz = _ref(labels, "authz")
        if http:
            return self.m.http_authz(
                pod,
                allowed=allowed,
                target=target,
                tls=tls,
                server=server,
                route=_ref(labels, "route"),
                authz=authz,
            )
        return self.m.tcp_authz(
            pod, allowed=allowed, target=target, tls=tls, server=server, authz=authz
        )

    # --- tap ---------------------------------------------------------------------------

    def _tap(  # noqa: PLR0913 - the facts of one response
        self,
        taps: Any,
        *,
        conn: Conn | None,
        direction: str,
        labels: Labels,
        status: int,
        latency_ms: float,
    ) -> None:
        pod_key = self._own_pod(conn, labels) if direction == "inbound" else _conn_pod(conn)
        peer_key: str | None = None
        if direction == "outbound" and labels.get("hop") == "local":
            addr = _addr(labels.get("dst_addr", ""))
            found = self.worker.state.get((POD_IP, addr[0])) if addr else None
            peer_key = found if isinstance(found, str) else None
        wanted = [k for k in (pod_key, peer_key) if k and ("*" in taps or k in taps)]
        if not wanted:
            return
        event = self._event(
            conn,
            direction=direction,
            labels=labels,
            status=status,
            latency_ms=latency_ms,
            pod_key=pod_key,
        )
        ring = self.tap_ring
        for key in wanted:
            if len(ring) == ring.maxlen:
                self.tap_dropped += 1
            if key == pod_key:
                ring.append(event)
            else:  # the same request seen from the called pod's side (rule 2)
                ring.append({**event, "pod": key, "direction": "inbound", "from_pod": pod_key})

    def _event(  # noqa: PLR0913 - the facts of one response
        self,
        conn: Conn | None,
        *,
        direction: str,
        labels: Labels,
        status: int,
        latency_ms: float,
        pod_key: str,
    ) -> dict[str, Any]:
        head = record.REQUEST.get()
        method = path = host = ""
        if head is not None:
            method = head.method.decode("latin-1")
            path = head.target.decode("latin-1").partition("?")[0]
            host = _header(head.headers, b"host")
        event: dict[str, Any] = {
            "ts": round(time.time(), 6),
            "pod": pod_key,
            "direction": direction,
            "method": method,
            "authority": labels.get("authority") or host,
            "path": path,
            "status": status,
            "latency_ms": round(latency_ms, 3),
            "src": f"{conn.peer[0]}:{conn.peer[1]}" if conn is not None else "",
            "dst": labels.get("dst_addr", ""),
        }
        if direction == "inbound":
            event["tls"] = labels.get("tls", "")
            event["client_id"] = labels.get("client_id", "")
        else:
            hop = labels.get("hop", "")
            server_id, ep_labels = self._endpoint(labels.get("authority", ""), event["dst"])
            src = self._pod_info(pod_key)
            event["tls"] = "true" if hop in ("mtls", "local") else "no_identity"
            event["client_id"] = src.identity if src is not None else ""
            event["server_id"] = server_id or ""
            if hop == "local":
                event["tls"] = "true"
            event["dst_pod"] = dict(ep_labels).get("pod", "")
        return event

    def take_tap(self) -> ch.TapEvents | None:
        """The queued tap events as one message (None when there are none)."""
        if not self.tap_ring and not self.tap_dropped:
            return None
        msg = ch.TapEvents(
            worker_id=self.worker.worker_id,
            events=tuple(self.tap_ring),
            dropped=self.tap_dropped,
        )
        self.tap_ring.clear()
        self.tap_dropped = 0
        return msg

    # --- reports ---------------------------------------------------------------------

    def update_balancers(self) -> None:
        """`outbound_http_balancer_endpoints` of every Service this worker balances for."""
        from agent.proxy.plane import plane_of  # noqa: PLC0415 - the worker's plane, lazily

        seen: set[str] = set()
        for entry in plane_of(self.worker).dsts.values():
            authority = entry.dst.authority
            match = _SVC_AUTHORITY.match(authority) if authority else None
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
        self.worker.send(ch.Metrics(worker_id=self.worker.worker_id, snapshot=self.m.snapshot()))
        self.flush_tap()

    def flush_tap(self) -> None:
        msg = self.take_tap()
        if msg is not None:
            self.worker.send(msg)

    async def run(self) -> None:
        """Forever: tap flushes every `TAP_FLUSH_S`, reports every `REPORT_S`."""
        lag = aio.spawn(measure_loop_lag(self.m.set_loop_lag), name="loop-lag")
        loop = asyncio.get_running_loop()
        next_report = loop.time() + REPORT_S
        try:
            while True:
                await asyncio.sleep(TAP_FLUSH_S)
                try:
                    if loop.time() >= next_report:
                        next_report = loop.time() + REPORT_S
                        self.report()
                    else:
                        self.flush_tap()
                except Exception:
                    logger.exception("BUG: metrics report failed")
        finally:
            lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lag


def _conn_pod(conn: Conn | None) -> str:
    return conn.listener.pod if conn is not None else "/"


def _orig_dst(conn: Conn | None) -> tuple[str, int] | None:
    if conn is None:
        return None
    from agent.proxy import worker as worker_mod  # noqa: PLC0415 - in the worker only

    try:
        return worker_mod.resolve_target(conn)
    except Exception:  # noqa: BLE001 - a label is not worth failing for
        return None


def _service_dst(authority: str) -> dict[str, str]:
    """`namespace`/`service` of a Service authority (the endpoint's labels may repeat them)."""
    match = _SVC_AUTHORITY.match(authority) if authority else None
    if match is None:
        return {}
    return {"namespace": match.group(2), "service": match.group(1)}


def _ref(labels: Mapping[str, str], prefix: str) -> Ref | None:
    kind = labels.get(f"{prefix}_kind")
    if kind is None:
        return None
    return Ref(
        group=labels.get(f"{prefix}_group", ""), kind=kind, name=labels.get(f"{prefix}_name", "")
    )


def _header(headers: Any, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


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
