"""Every metric family meshagent exports: name, kind, help, labels, buckets.

Names, types, labels and buckets follow linkerd2-proxy's `/metrics` (see
Linkerd's "Proxy Metrics" reference), so Linkerd dashboards and queries work.
`agent.admin.metrics` records series of these families in the workers;
`agent.admin.node` registers the node's own families here too.

Rules:
1. A family is declared once, in `FAMILIES`, with its kind, help, the label
   names it may carry (plus allowed label *prefixes* such as `dst_`) and, for
   histograms, its bucket bounds. A series with any other label name is a bug
   and is refused when it is first created.
2. Nothing per connection (client port, peer address, connection id) is ever a
   label: `FORBIDDEN_LABELS`, checked when a family is declared.
3. Declarations only: no state, no I/O; `register` is the one way to add a
   family after import, and a clash is a bug.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """Prometheus metric types."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Merge(enum.Enum):
    """How a gauge combines across worker processes."""

    SUM = "sum"  # e.g. open connections: each worker holds its own
    MAX = "max"  # e.g. balancer endpoints: every worker sees the same set


# Linkerd's latency buckets, in milliseconds (linkerd_metrics::latency).
LATENCY_MS_BUCKETS: tuple[float, ...] = (
    1, 2, 3, 4, 5, 10, 20, 30, 40, 50, 100, 200, 300, 400, 500,
    1000, 2000, 3000, 4000, 5000, 10000, 20000, 30000, 40000, 50000,
)  # fmt: skip

OWNER_KINDS = frozenset(
    {
        "deployment",
        "statefulset",
        "daemonset",
        "replicaset",
        "replicationcontroller",
        "job",
        "cronjob",
    }
)
POD_LABELS = frozenset({"namespace", "pod", "serviceaccount"}) | OWNER_KINDS
TLS_LABELS = frozenset({"tls", "no_tls_reason", "client_id", "server_id", "sni"})
TARGET_LABELS = frozenset({"target_addr", "target_ip", "target_port"})
SRV_LABELS = frozenset({"srv_group", "srv_kind", "srv_name", "srv_port"})
ROUTE_LABELS = frozenset({"route_group", "route_kind", "route_name"})
AUTHZ_LABELS = frozenset({"authz_group", "authz_kind", "authz_name"})
HTTP_LABELS = (
    POD_LABELS
    | TLS_LABELS
    | TARGET_LABELS
    | SRV_LABELS
    | ROUTE_LABELS
    | AUTHZ_LABELS
    | {"direction", "authority"}
)
RESPONSE_LABELS = frozenset({"classification", "status_code", "grpc_status", "error"})
WORKER_LABELS = frozenset({"process", "worker"})

# Never labels: each would make one series per connection or client.
FORBIDDEN_LABELS = frozenset(
    {
        "client_addr",
        "client_ip",
        "client_port",
        "peer_addr",
        "peer_ip",
        "peer_port",
        "src_addr",
        "src_ip",
        "src_port",
        "local_port",
        "connection",
        "conn_id",
        "request_id",
        "path",
        "url",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One metric family: name, kind, help and the labels it may carry."""

    name: str
    kind: Kind
    help: str
    labels: frozenset[str]
    prefixes: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    merge: Merge = Merge.SUM

    def __post_init__(self) -> None:
        if self.kind is Kind.HISTOGRAM and not self.buckets:
            raise ValueError(f"BUG: histogram {self.name} needs buckets")
        if self.labels & FORBIDDEN_LABELS:
            raise ValueError(f"BUG: {self.name} declares per-connection labels")

    def allows(self, name: str) -> bool:
        """True when a series of this family may carry label `name`."""
        return name in self.labels or name.startswith(self.prefixes)


def _family(  # noqa: PLR0913 - a declaration table reads best flat
    name: str,
    kind: Kind,
    help_: str,
    labels: frozenset[str] | set[str],
    *,
    prefixes: tuple[str, ...] = (),
    buckets: tuple[float, ...] = (),
    merge: Merge = Merge.SUM,
) -> Family:
    return Family(
        name=name,
        kind=kind,
        help=help_,
        labels=frozenset(labels),
        prefixes=prefixes,
        buckets=buckets,
        merge=merge,
    )


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
_ROUTE = POD_LABELS | {"direction", "dst"}
_TCP = POD_LABELS | TLS_LABELS | TARGET_LABELS | SRV_LABELS | {"direction", "peer"}
_AUTHZ = POD_LABELS | TLS_LABELS | TARGET_LABELS | SRV_LABELS | ROUTE_LABELS | AUTHZ_LABELS
_BALANCER = frozenset({"endpoint_state"})
_LAT = LATENCY_MS_BUCKETS

_DATA_PATH: tuple[Family, ...] = (
    _family("request_total", C, "Total count of HTTP requests.", HTTP_LABELS, prefixes=("dst_",)),
    _family(
        "response_total",
        C,
        "Total count of HTTP responses.",
        HTTP_LABELS | RESPONSE_LABELS,
        prefixes=("dst_",),
    ),
    _family(
        "response_latency_ms",
        H,
        "Elapsed times between a request's headers being received and its response stream "
        "completing",
        HTTP_LABELS | {"status_code"},
        prefixes=("dst_",),
        buckets=_LAT,
    ),
    _family("route_request_total", C, "Total count of HTTP requests.", _ROUTE, prefixes=("rt_",)),
    _family(
        "route_response_total",
        C,
        "Total count of HTTP responses.",
        _ROUTE | RESPONSE_LABELS,
        prefixes=("rt_",),
    ),
    _family(
        "route_response_latency_ms",
        H,
        "Elapsed times between a request's headers being received and its response stream "
        "completing",
        _ROUTE | {"status_code"},
        prefixes=("rt_",),
        buckets=_LAT,
    ),
    _family("tcp_open_total", C, "Total count of opened connections", _TCP, prefixes=("dst_",)),
    _family(
        "tcp_close_total",
        C,
        "Total count of closed connections",
        _TCP | {"errno"},
        prefixes=("dst_",),
    ),
    _family(
        "tcp_open_connections", G, "Number of currently-open connections", _TCP, prefixes=("dst_",)
    ),
    _family(
        "tcp_read_bytes_total", C, "Total count of bytes read from peers", _TCP, prefixes=("dst_",)
    ),
    _family(
        "tcp_write_bytes_total",
        C,
        "Total count of bytes written to peers",
        _TCP,
        prefixes=("dst_",),
    ),
    _family(
        "tcp_connection_duration_ms",
        H,
        "Connection lifetimes",
        _TCP | {"errno"},
        prefixes=("dst_",),
        buckets=_LAT,
    ),
    _family(
        "inbound_http_authz_allow_total",
        C,
        "The total number of inbound HTTP requests that were authorized",
        _AUTHZ,
    ),
    _family(
        "inbound_http_authz_deny_total",
        C,
        "The total number of inbound HTTP requests that could not be processed due to a proxy "
        "error.",
        _AUTHZ - AUTHZ_LABELS,
    ),
    _family(
        "inbound_tcp_authz_allow_total",
        C,
        "The total number of inbound TCP connections that were authorized",
        _AUTHZ - ROUTE_LABELS,
    ),
    _family(
        "inbound_tcp_authz_deny_total",
        C,
        "The total number of inbound TCP connections that were denied",
        _AUTHZ - ROUTE_LABELS - AUTHZ_LABELS,
    ),
    _family(
        "inbound_tcp_errors_total",
        C,
        "The total number of inbound TCP connections that could not be processed due to a "
        "proxy error.",
        POD_LABELS | TARGET_LABELS | {"error"},
    ),
    _family(
        "outbound_tcp_errors_total",
        C,
        "The total number of outbound TCP connections that could not be processed due to a "
        "proxy error.",
        POD_LABELS | TARGET_LABELS | {"error"},
    ),
    _family(
        "inbound_tcp_accept_errors_total",
        C,
        "The total number of inbound TCP connections that could not be processed due to a "
        "proxy error.",
        POD_LABELS | {"target_port", "error"},
    ),
    _family(
        "outbound_tcp_accept_errors_total",
        C,
        "The total number of outbound TCP connections that could not be processed due to a "
        "proxy error.",
        POD_LABELS | {"target_port", "error"},
    ),
    _family(
        "outbound_http_balancer_endpoints",
        G,
        "The number of endpoints currently in a HTTP request balancer",
        _BALANCER,
        prefixes=("parent_", "backend_"),
        merge=Merge.MAX,
    ),
    _family(
        "meshagent_event_loop_lag_seconds",
        G,
        "Largest event-loop scheduling delay seen in the last measurement interval",
        WORKER_LABELS,
        merge=Merge.MAX,
    ),
    _family(
        "meshagent_worker_last_report_timestamp_seconds",
        G,
        "When the worker took the metrics snapshot it last reported (Unix time): every "
        "count it serves was made before then",
        WORKER_LABELS,
        merge=Merge.MAX,
    ),
    _family(
        "meshagent_metrics_series_dropped_total",
        C,
        "Increments lost because a worker reached its series limit",
        WORKER_LABELS | {"family"},
    ),
)

FAMILIES: dict[str, Family] = {f.name: f for f in _DATA_PATH}


def register(family: Family) -> Family:
    """Add a family declared elsewhere (node metrics); a clash with another is a bug."""
    old = FAMILIES.setdefault(family.name, family)
    if old != family:
        raise ValueError(f"BUG: metric family {family.name} declared twice, differently")
    return family
