"""The workers' metrics recording API, over the families in `agent.admin.families`.

Names, types, labels and buckets follow linkerd2-proxy's `/metrics` (see
Linkerd's "Proxy Metrics" reference), so Linkerd dashboards and queries work.
One proxy serves many pods, so every data-path series also carries the pod it
belongs to: `namespace`, `pod`, `serviceaccount` and one owner label
(`deployment`, `statefulset`, ...), as Linkerd's scrape config would add them.

Rules:
1. A family is declared once, in `agent.admin.families.FAMILIES`, with its kind, help, the label
   names it may carry (plus allowed label *prefixes* such as `dst_`) and, for
   histograms, its bucket bounds. A series with any other label name is a bug
   and is refused when it is first created.
2. Labels are bounded by construction: they name pods, directions,
   authorities, target addresses (`ip:port` of a Service or pod port),
   identities, policy objects, status codes, errnos. Nothing per connection
   (client port, peer address, connection id) is ever a label
   (`FORBIDDEN_LABELS`). As a backstop, a `WorkerMetrics` refuses new series
   past `max_series`; their increments go to a sink and are counted in
   `meshagent_metrics_series_dropped_total`.
3. Recording is cheap: a worker interns the label set of a connection (or
   route) once, getting a series object; per request it then does plain
   integer additions and one bucket lookup (`Histogram.index`: a table read for a
   latency up to `SMALL_MAX` ms, else a binary search, `bucket`). No locks (a
   worker is one thread), no label formatting on the hot path.
4. `WorkerMetrics.snapshot()` returns *cumulative* values since the worker
   started, as plain picklable data; the supervisor merges snapshots
   (`agent.admin.aggregate`).
"""

from __future__ import annotations

import errno as errno_mod
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast

from agent.admin.families import FAMILIES, FORBIDDEN_LABELS, OWNER_KINDS, Family, Kind

if TYPE_CHECKING:
    from collections.abc import Mapping

Labels = tuple[tuple[str, str], ...]
HistValue = tuple[tuple[int, ...], float]  # per-bucket counts (last: +Inf), sum
Value = float | HistValue
Samples = dict[Labels, Value]


# --- label building blocks (built once per connection / endpoint / route) -------


@dataclass(frozen=True, slots=True, kw_only=True)
class PodMeta:
    """The pod a series belongs to."""

    namespace: str
    pod: str
    serviceaccount: str = ""
    owner_kind: str = ""  # one of OWNER_KINDS, or "" for a bare pod
    owner_name: str = ""
    labels: Labels = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.owner_kind and self.owner_kind not in OWNER_KINDS:
            raise ValueError(f"owner kind {self.owner_kind!r} is not one of {sorted(OWNER_KINDS)}")
        out = [("namespace", self.namespace), ("pod", self.pod)]
        if self.owner_kind:
            out.append((self.owner_kind, self.owner_name))
        if self.serviceaccount:
            out.append(("serviceaccount", self.serviceaccount))
        object.__setattr__(self, "labels", tuple(out))


@dataclass(frozen=True, slots=True, kw_only=True)
class Tls:
    """The TLS state of a connection, as Linkerd labels it.

    `state` is "true" (mTLS with `peer_id`), "no_identity" (plaintext; `reason`
    says why, e.g. "not_provided_by_remote", "loopback"), "disabled" or
    "opaque" (passthrough; `peer_id` holds the SNI).
    """

    state: str
    peer_id: str = ""
    reason: str = ""

    @classmethod
    def established(cls, peer_id: str) -> Tls:
        return cls(state="true", peer_id=peer_id)

    @classmethod
    def no_identity(cls, reason: str) -> Tls:
        return cls(state="no_identity", reason=reason)

    def labels(self, direction: str) -> Labels:
        if self.state == "true":
            peer = "client_id" if direction == "inbound" else "server_id"
            return (("tls", "true"), (peer, self.peer_id))
        if self.state == "no_identity":
            return (("tls", "no_identity"), ("no_tls_reason", self.reason))
        if self.state == "opaque":
            return (("tls", "opaque"), ("sni", self.peer_id))
        return (("tls", self.state),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ref:
    """A policy object (Server, route, authorization) as Linkerd labels it."""

    group: str
    kind: str
    name: str
    port: int | None = None

    def labels(self, prefix: str) -> Labels:
        out = [(f"{prefix}_group", self.group), (f"{prefix}_kind", self.kind)]
        out.append((f"{prefix}_name", self.name))
        if self.port is not None:
            out.append((f"{prefix}_port", str(self.port)))
        return tuple(out)


def target_labels(addr: tuple[str, int]) -> Labels:
    """`target_addr`, `target_ip`, `target_port` of an (ip, port)."""
    ip, port = addr
    text = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    return (("target_addr", text), ("target_ip", ip), ("target_port", str(port)))


def dst_labels(metric_labels: Mapping[str, str]) -> Labels:
    """An endpoint's Destination `metric_labels`, prefixed `dst_`, sorted (cache per endpoint)."""
    return tuple(sorted((f"dst_{k}", v) for k, v in metric_labels.items()))


def errno_label(err: int | None) -> str:
    """`ECONNRESET` for 104; "" for a clean close."""
    if not err:
        return ""
    return errno_mod.errorcode.get(err, str(err))


def is_success(status: int, grpc_status: int | None = None) -> bool:
    """Linkerd's default response classification: 5xx and gRPC errors are failures."""
    if grpc_status is not None:
        return grpc_status == 0
    return status < 500


# --- cells: the mutable values behind one series -------------------------------


class Counter:
    """A monotonically increasing count; `value += n` is the whole cost."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


class Gauge:
    """A value that goes up and down."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, v: float) -> None:
        self.value = v


class Histogram:
    """Fixed buckets: `counts[i]` counts observations <= bounds[i]; the last is +Inf."""

    __slots__ = ("bounds", "counts", "small", "small_max", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        # As floats: `bucket` reads them as C doubles, and an int bound (families.py
        # writes them so) would be converted through its `__float__` at every read.
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.small, self.small_max = small_table(self.bounds)

    def index(self, v: float) -> int:
        """`bucket(bounds, v)`: for 0 <= v <= `small_max` one read of `small` at v rounded
        up (rule 3), else the binary search."""
        if 0.0 <= v <= self.small_max:
            k = int(v)
            if k < v:
                k += 1
            return self.small[k]
        return bucket(self.bounds, v)

    def observe(self, v: float) -> None:
        """Count `v` in its bucket and its sum. The count is read into an int and written
        back: compiled, `counts[i] += 1` was a generic add of two objects."""
        counts = self.counts
        i = self.index(v)
        n: int = counts[i]
        counts[i] = n + 1
        self.total += v


SMALL_MAX: Final = 100  # the table's last whole value (latencies in ms: most fall below)
_SMALL: Final[dict[tuple[float, ...], tuple[bytes, float]]] = {}


def small_table(bounds: tuple[float, ...]) -> tuple[bytes, float]:
    """`bucket(bounds, k)` for k = 0..K, and K as a float (-1.0: no table), shared by the
    histograms of the same bounds. Rounding v up to a whole k keeps the answer when no
    bound lies between two whole numbers, so K stops below the first bound that is not
    whole, and at `SMALL_MAX`."""
    known = _SMALL.get(bounds)
    if known is not None:
        return known
    top = SMALL_MAX
    for b in bounds:
        if 0.0 < b <= top and not b.is_integer():
            top = int(b)  # v just above it would round up past b
    table = bytes(bucket(bounds, float(k)) for k in range(top + 1)) if len(bounds) < 256 else b""
    made = (table, float(len(table) - 1))
    _SMALL[bounds] = made
    return made


def bucket(bounds: tuple[float, ...], v: float) -> int:
    """The index of the first bound >= `v` (len(bounds): above them all): `bisect_left`,
    written out so the compiled build compares C doubles instead of calling the C module
    and comparing float objects."""
    lo = 0
    hi = len(bounds)
    while lo < hi:
        mid = (lo + hi) // 2
        if bounds[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo


Cell = Counter | Gauge | Histogram


class HttpSeries:
    """request/response counters and latency of one label set (endpoint or route)."""

    __slots__ = (
        "_base",
        "_last_cells",
        "_last_status",
        "_last_success",
        "_latency",
        "_m",
        "_names",
        "_responses",
        "requests",
    )

    def __init__(self, m: WorkerMetrics, base: Labels, names: tuple[str, str, str]) -> None:
        self._m = m
        self._base = base
        self._names = names  # request, response, latency family names
        self.requests = m.counter(names[0], base)
        self._responses: dict[tuple[int, bool], Counter] = {}
        self._latency: dict[int, Histogram] = {}
        # The cells of the last (status, success) seen: most responses repeat it.
        self._last_status = -1
        self._last_success = False
        self._last_cells: tuple[Counter, Histogram] | None = None

    def request(self) -> None:
        """A request stream began."""
        self.requests.value += 1

    def response(self, status: int, latency_ms: float, success: bool) -> None:
        """A response ended: `status`, time to first byte in ms, classification."""
        cells = self._last_cells
        if cells is not None and status == self._last_status and success is self._last_success:
            counter, hist = cells
        else:
            key = (status, success)
            counter = self._responses.get(key) or self._new_response(key)
            hist = self._latency.get(status) or self._new_latency(status)
            self._last_status = status
            self._last_success = success
            self._last_cells = (counter, hist)
        counter.value += 1
        hist.observe(latency_ms)

    def _new_response(self, key: tuple[int, bool]) -> Counter:
        status, success = key
        labels = (
            *self._base,
            ("classification", "success" if success else "failure"),
            ("status_code", str(status)),
        )
        cell = self._m.counter(self._names[1], labels)
        self._responses[key] = cell
        return cell

    def _new_latency(self, status: int) -> Histogram:
        labels = (*self._base, ("status_code", str(status)))
        cell = self._m.histogram(self._names[2], labels)
        self._latency[status] = cell
        return cell


class TcpSeries:
    """Open/close counts, bytes and lifetimes of the connections of one label set."""

    __slots__ = ("_base", "_closes", "_m", "open_connections", "opens", "read_bytes", "write_bytes")

    def __init__(self, m: WorkerMetrics, base: Labels) -> None:
        self._m = m
        self._base = base
        self.opens = m.counter("tcp_open_total", base)
        self.open_connections = m.gauge("tcp_open_connections", base)
        self.read_bytes = m.counter("tcp_read_bytes_total", base)
        self.write_bytes = m.counter("tcp_write_bytes_total", base)
        self._closes: dict[str, tuple[Counter, Histogram]] = {}

    def open(self) -> None:
        """A connection opened."""
        self.opens.value += 1
        self.open_connections.value += 1

    def transferred(self, read: int, written: int) -> None:
        """Bytes read from and written to the peer (call per chunk or once at close)."""
        self.read_bytes.value += read
        self.write_bytes.value += written

    def close(self, duration_ms: float, errno: str = "") -> None:
        """A connection closed after `duration_ms`; `errno` from `errno_label` ("" if clean)."""
        self.open_connections.value -= 1
        cells = self._closes.get(errno)
        if cells is None:
            labels = (*self._base, ("errno", errno))
            cells = (
                self._m.counter("tcp_close_total", labels),
                self._m.histogram("tcp_connection_duration_ms", labels),
            )
            self._closes[errno] = cells
        cells[0].value += 1
        cells[1].observe(duration_ms)


# --- the per-worker recorder ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSnapshot:
    """Cumulative values of one worker incarnation; picklable for the channel.

    `families` maps a family name to {labels: value}; a histogram value is
    (per-bucket counts ending with +Inf, sum).
    """

    worker_id: int
    incarnation: int  # the worker's PID: a replacement in the same slot differs
    seq: int
    families: dict[str, Samples]

    def __reduce__(self) -> tuple[object, tuple[int, int, int, dict[str, Samples]]]:
        # Pickled by its fields: a frozen class compiled by mypyc (agent.native) cannot
        # be rebuilt through object.__setattr__, pickle's default.
        return _snapshot, (self.worker_id, self.incarnation, self.seq, self.families)


def _snapshot(
    worker_id: int, incarnation: int, seq: int, families: dict[str, Samples]
) -> MetricsSnapshot:
    return MetricsSnapshot(worker_id=worker_id, incarnation=incarnation, seq=seq, families=families)


class WorkerMetrics:
    """The recorder one worker process owns. Single-threaded; see the module rules."""

    def __init__(
        self, worker_id: int, *, incarnation: int | None = None, max_series: int = 100_000
    ) -> None:
        self.worker_id = worker_id
        self.incarnation = os.getpid() if incarnation is None else incarnation
        self.max_series = max_series
        self._cells: dict[str, dict[Labels, Cell]] = {}
        self._series = 0
        self._seq = 0
        self._interned: dict[tuple[object, ...], object] = {}
        self._worker_labels: Labels = (("process", "worker"), ("worker", str(worker_id)))

    # --- interning (once per connection / route / endpoint) ----------------

    def http(  # noqa: PLR0913 - these are the label dimensions Linkerd has
        self,
        pod: PodMeta,
        *,
        direction: str,
        authority: str,
        target: tuple[str, int] | None,
        tls: Tls | None,
        dst: Labels = (),
        server: Ref | None = None,
        route: Ref | None = None,
        authz: Ref | None = None,
    ) -> HttpSeries:
        """The request/response series of an HTTP endpoint label set (interned).

        `target`/`tls` are None for answers the proxy gave before choosing an endpoint.
        """
        key = ("http", pod, direction, authority, target, tls, dst, server, route, authz)
        found = self._interned.get(key)
        if found is not None:
            return cast("HttpSeries", found)
        base: Labels = (*pod.labels, ("direction", direction))
        if authority:
            base += (("authority", authority),)
        if target is not None:
            base += target_labels(target)
        if tls is not None:
            base += tls.labels(direction)
        base += dst
        for prefix, ref in (("srv", server), ("route", route), ("authz", authz)):
            if ref is not None:
                base += ref.labels(prefix)
        names = ("request_total", "response_total", "response_latency_ms")
        series = HttpSeries(self, base, names)
        self._interned[key] = series
        return series

    def route(
        self, pod: PodMeta, *, direction: str, dst: str, rt_route: str, rt: Labels = ()
    ) -> HttpSeries:
        """The per-route series (`route_*` families) of a profile route (interned)."""
        key = ("route", pod, direction, dst, rt_route, rt)
        found = self._interned.get(key)
        if found is not None:
            return cast("HttpSeries", found)
        base: Labels = (*pod.labels, ("direction", direction), ("dst", dst))
        base += (("rt_route", rt_route), *rt)
        names = ("route_request_total", "route_response_total", "route_response_latency_ms")
        series = HttpSeries(self, base, names)
        self._interned[key] = series
        return series

    def tcp(  # noqa: PLR0913 - these are the label dimensions Linkerd has
        self,
        pod: PodMeta,
        *,
        direction: str,
        peer: str,
        target: tuple[str, int],
        tls: Tls,
        dst: Labels = (),
        server: Ref | None = None,
    ) -> TcpSeries:
        """The transport series of a connection label set (interned).

        `peer` is "src" for the accepted side, "dst" for the side the proxy opened.
        """
        key = ("tcp", pod, direction, peer, target, tls, dst, server)
        found = self._interned.get(key)
        if found is not None:
            return cast("TcpSeries", found)
        base: Labels = (*pod.labels, ("direction", direction), ("peer", peer))
        base += target_labels(target) + tls.labels(direction) + dst
        if server is not None:
            base += server.labels("srv")
        series = TcpSeries(self, base)
        self._interned[key] = series
        return series

    def http_authz(  # noqa: PLR0913 - Linkerd's authz label dimensions
        self,
        pod: PodMeta,
        *,
        allowed: bool,
        target: tuple[str, int] | None,
        tls: Tls,
        server: Ref,
        route: Ref | None = None,
        authz: Ref | None = None,
    ) -> Counter:
        """`inbound_http_authz_{allow,deny}_total` counter for this label set."""
        name = "inbound_http_authz_allow_total" if allowed else "inbound_http_authz_deny_total"
        authz = authz if allowed else None
        labels = self._authz_labels(
            pod, target=target, tls=tls, server=server, route=route, authz=authz
        )
        return self.counter(name, labels)

    def tcp_authz(  # noqa: PLR0913 - Linkerd's authz label dimensions
        self,
        pod: PodMeta,
        *,
        allowed: bool,
        target: tuple[str, int] | None,
        tls: Tls,
        server: Ref,
        authz: Ref | None = None,
    ) -> Counter:
        """`inbound_tcp_authz_{allow,deny}_total` counter for this label set."""
        name = "inbound_tcp_authz_allow_total" if allowed else "inbound_tcp_authz_deny_total"
        authz = authz if allowed else None
        labels = self._authz_labels(
            pod, target=target, tls=tls, server=server, route=None, authz=authz
        )
        return self.counter(name, labels)

    def tcp_error(
        self, pod: PodMeta, *, direction: str, target: tuple[str, int], error: str
    ) -> Counter:
        """`{inbound,outbound}_tcp_errors_total`; `error` is a short fixed word."""
        labels = (*pod.labels, *target_labels(target), ("error", error))
        return self.counter(f"{direction}_tcp_errors_total", labels)

    def accept_error(self, pod: PodMeta, *, direction: str, port: int, error: str) -> Counter:
        """`{inbound,outbound}_tcp_accept_errors_total`: tls_detect_timeout | io | other."""
        labels = (*pod.labels, ("target_port", str(port)), ("error", error))
        return self.counter(f"{direction}_tcp_accept_errors_total", labels)

    def balancer_endpoints(
        self, *, namespace: str, name: str, port: int, ready: int, pending: int
    ) -> None:
        """Set `outbound_http_balancer_endpoints` of the balancer for a Service port."""
        parent: Labels = (
            ("parent_group", "core"),
            ("parent_kind", "Service"),
            ("parent_namespace", namespace),
            ("parent_name", name),
            ("parent_port", str(port)),
        )
        backend = tuple((k.replace("parent_", "backend_"), v) for k, v in parent)
        for state, count in (("ready", ready), ("pending", pending)):
            labels = (*parent, *backend, ("endpoint_state", state))
            gauge = self.gauge("outbound_http_balancer_endpoints", labels)
            gauge.value = float(count)

    def set_loop_lag(self, seconds: float) -> None:
        """Report this worker's event-loop lag (see `agent.admin.node.measure_loop_lag`)."""
        gauge = self.gauge("meshagent_event_loop_lag_seconds", self._worker_labels)
        gauge.value = seconds

    def set_reported(self, unix_s: float) -> None:
        """Stamp the snapshot about to be reported with the Unix time it is taken
        (`meshagent_worker_last_report_timestamp_seconds`): a reader that needs every
        count made before a moment waits for a stamp past it."""
        gauge = self.gauge("meshagent_worker_last_report_timestamp_seconds", self._worker_labels)
        gauge.value = unix_s

    # --- generic cells -----------------------------------------------------

    def counter(self, family: str, labels: Labels) -> Counter:
        """The counter cell of `family` at `labels` (created once)."""
        return cast("Counter", self.cell(family, labels))

    def gauge(self, family: str, labels: Labels) -> Gauge:
        """The gauge cell of `family` at `labels` (created once)."""
        return cast("Gauge", self.cell(family, labels))

    def histogram(self, family: str, labels: Labels) -> Histogram:
        """The histogram cell of `family` at `labels` (created once)."""
        return cast("Histogram", self.cell(family, labels))

    def cell(self, family: str, labels: Labels) -> Cell:
        """The cell of `family` at `labels`; a sink past `max_series`.

        Raises:
            ValueError: BUG: unknown family, or a label the family does not allow.
        """
        cells = self._cells.get(family)
        if cells is None:
            cells = self._cells[family] = {}
        cell = cells.get(labels)
        if cell is not None:
            return cell
        spec = FAMILIES.get(family)
        if spec is None:
            raise ValueError(f"BUG: unknown metric family {family}")
        bad = [k for k, _ in labels if not spec.allows(k) or k in FORBIDDEN_LABELS]
        if bad:
            raise ValueError(f"BUG: {family} does not take labels {bad}")
        cell = _new_cell(spec)
        if self._series >= self.max_series:
            self._dropped(family).value += 1
            return cell  # recorded into, never exported
        self._series += 1
        cells[labels] = cell
        return cell

    def _dropped(self, family: str) -> Counter:
        labels = (*self._worker_labels, ("family", family))
        cells = self._cells.setdefault("meshagent_metrics_series_dropped_total", {})
        cell = cells.get(labels)
        if cell is None:
            cell = cells[labels] = Counter()
        return cast("Counter", cell)

    @property
    def series(self) -> int:
        """How many series this worker holds."""
        return self._series

    def forget_pod(self, namespace: str, pod: str) -> int:
        """Drop every series of a pod that left this node; returns how many."""
        want = {("namespace", namespace), ("pod", pod)}
        dropped = 0
        for cells in self._cells.values():
            gone = [labels for labels in cells if want.issubset(labels)]
            for labels in gone:
                del cells[labels]
            dropped += len(gone)
        self._series -= dropped
        self._interned = {
            k: v
            for k, v in self._interned.items()
            if not (isinstance(k[1], PodMeta) and (k[1].namespace, k[1].pod) == (namespace, pod))
        }
        return dropped

    # --- export ---------------------------------------------------------------

    def snapshot(self) -> MetricsSnapshot:
        """Cumulative values of every series, as plain data."""
        self._seq += 1
        families: dict[str, Samples] = {}
        for name, cells in self._cells.items():
            if not cells:
                continue
            out: Samples = {}
            for labels, cell in cells.items():
                if isinstance(cell, Histogram):
                    out[labels] = (tuple(cell.counts), cell.total)
                else:
                    out[labels] = cell.value
            families[name] = out
        return MetricsSnapshot(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            seq=self._seq,
            families=families,
        )

    def _authz_labels(  # noqa: PLR0913
        self,
        pod: PodMeta,
        *,
        target: tuple[str, int] | None,
        tls: Tls,
        server: Ref,
        route: Ref | None,
        authz: Ref | None,
    ) -> Labels:
        labels: Labels = pod.labels
        if target is not None:
            labels += target_labels(target)
        labels += server.labels("srv")
        if route is not None:
            labels += route.labels("route")
        if authz is not None:
            labels += authz.labels("authz")
        return labels + tls.labels("inbound")


def _new_cell(spec: Family) -> Cell:
    if spec.kind is Kind.HISTOGRAM:
        return Histogram(spec.buckets)
    if spec.kind is Kind.GAUGE:
        return Gauge()
    return Counter()
