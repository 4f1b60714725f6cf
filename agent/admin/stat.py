"""`meshagent stat`: Linkerd-viz-style golden metrics from two scrapes of the admin endpoint(s).

Pure: text in (`parse`), rows out (`rows`); the CLI does the fetching.

Rules:
1. Everything is a delta between two scrapes `window` seconds apart, as
   Prometheus' `increase()` would see it: a counter lower in the second
   scrape was reset (a restarted process), so its increase is its new value.
   Scrapes of several agents taken together are summed first (`merge`).
2. Success rate = successful / all responses (`response_total`
   `classification`), rps = responses / window, latency percentiles by
   Prometheus' `histogram_quantile` interpolation over the summed bucket
   increases of `response_latency_ms` (`route_*` families for routes).
3. pods: the inbound traffic of each pod (what its server side saw), TCP
   connections = its open inbound `tcp_open_connections`. services: the
   outbound traffic addressed to each Service authority, from every client.
   routes: per ServiceProfile route (`dst`, `rt_route`). A pod that appears in
   any series is meshed (an agent serves it).
4. `namespace` filters on the pod's namespace (pods) or the Service's
   (services, routes). A row without responses in the window has no success
   rate or latency (None), as Linkerd prints "-".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

KINDS = ("pods", "services", "routes")
Key = tuple[str, tuple[tuple[str, str], ...]]  # sample name, sorted labels
_SVC = re.compile(r"^([^.]+)\.([^.]+)\.svc\.[^:]*(?::\d+)?$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Scrape:
    """Every sample of a scrape (summed over agents) and when it was taken."""

    t: float
    samples: dict[Key, float]


def parse(text: str, t: float) -> Scrape:
    """Samples of one Prometheus text body.

    Raises:
        ValueError: the text is not Prometheus text format.
    """
    samples: dict[Key, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + float(s.value)
    return Scrape(t=t, samples=samples)


def merge(scrapes: Iterable[Scrape]) -> Scrape:
    """Several agents' scrapes as one (values summed; the time is their mean)."""
    items = list(scrapes)
    out: dict[Key, float] = {}
    for sc in items:
        for key, v in sc.samples.items():
            out[key] = out.get(key, 0.0) + v
    t = sum(sc.t for sc in items) / len(items) if items else 0.0
    return Scrape(t=t, samples=out)


def increase(before: float | None, after: float) -> float:
    """Counter increase (rule 1)."""
    if before is None or after < before:
        return after
    return after - before


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:  # noqa: PLR0911
    """Prometheus' `histogram_quantile` over cumulative bucket counts by upper bound.

    None when there are no observations.
    """
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for i, bound in enumerate(bounds):
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return bounds[i - 1] if i > 0 else None
            if i == 0 and bound <= 0:
                return bound
            in_bucket = count - prev_count
            if in_bucket <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket
        prev_bound, prev_count = bound, count
    return None


@dataclass(slots=True)
class _Acc:
    success: float = 0.0
    total: float = 0.0
    buckets: dict[float, float] | None = None
    tcp: float = 0.0
    meta: dict[str, str] | None = None

    def add_bucket(self, le: float, v: float) -> None:
        if self.buckets is None:
            self.buckets = {}
        self.buckets[le] = self.buckets.get(le, 0.0) + v


def _deltas(before: Scrape, after: Scrape, name: str) -> Iterable[tuple[dict[str, str], float]]:
    for (n, labels), v in after.samples.items():
        if n == name:
            yield dict(labels), increase(before.samples.get((n, labels)), v)


def _collect(
    before: Scrape,
    after: Scrape,
    prefix: str,
    group: Callable[[dict[str, str]], tuple[str, ...] | None],
) -> dict[tuple[str, ...], _Acc]:
    accs: dict[tuple[str, ...], _Acc] = {}
    for labels, inc in _deltas(before, after, f"{prefix}response_total"):
        key = group(labels)
        if key is None:
            continue
        acc = accs.setdefault(key, _Acc())
        acc.total += inc
        if labels.get("classification") == "success":
            acc.success += inc
    for labels, inc in _deltas(before, after, f"{prefix}response_latency_ms_bucket"):
        key = group(labels)
        if key is None:
            continue
        le = float(labels["le"])
        accs.setdefault(key, _Acc()).add_bucket(le, inc)
    return accs


def _row(name: dict[str, Any], acc: _Acc, window: float) -> dict[str, Any]:
    buckets = acc.buckets or {}
    has = acc.total > 0
    return {
        **name,
        "success_rate": acc.success / acc.total if has else None,
        "rps": acc.total / window if window > 0 else 0.0,
        "latency_p50_ms": histogram_quantile(0.5, buckets) if has else None,
        "latency_p95_ms": histogram_quantile(0.95, buckets) if has else None,
        "latency_p99_ms": histogram_quantile(0.99, buckets) if has else None,
    }


def rows(
    before: Scrape, after: Scrape, kind: str = "pods", namespace: str | None = None
) -> list[dict[str, Any]]:
    """The stat table of `kind` (see the module rules), sorted by namespace and name.

    Raises:
        ValueError: `kind` is not one of `KINDS`.
    """
    window = max(after.t - before.t, 0.0)
    if kind == "pods":
        return _pods(before, after, window, namespace)
    if kind == "services":
        return _services(before, after, window, namespace)
    if kind == "routes":
        return _routes(before, after, window, namespace)
    raise ValueError(f"stat kind {kind!r} is not one of {', '.join(KINDS)}")


def _pods(
    before: Scrape, after: Scrape, window: float, namespace: str | None
) -> list[dict[str, Any]]:
    def group(labels: dict[str, str]) -> tuple[str, ...] | None:
        if labels.get("direction") != "inbound" or "pod" not in labels:
            return None
        return (labels.get("namespace", ""), labels["pod"])

    accs = _collect(before, after, "", group)
    seen: set[tuple[str, str]] = set()
    tcp: dict[tuple[str, str], float] = {}
    for (name, labels), v in after.samples.items():
        lb = dict(labels)
        if "pod" not in lb or "namespace" not in lb:
            continue
        key = (lb["namespace"], lb["pod"])
        seen.add(key)
        if name == "tcp_open_connections" and lb.get("direction") == "inbound":
            tcp[key] = tcp.get(key, 0.0) + v
    out = []
    for ns, pod in sorted(seen):
        if namespace is not None and ns != namespace:
            continue
        acc = accs.get((ns, pod), _Acc())
        row = _row({"namespace": ns, "name": pod, "meshed": "1/1"}, acc, window)
        row["tcp_conn"] = int(tcp.get((ns, pod), 0.0))
        out.append(row)
    return out


def _service_of(authority: str) -> tuple[str, str] | None:
    m = _SVC.match(authority)
    return (m.group(2), m.group(1)) if m else None


def _services(
    before: Scrape, after: Scrape, window: float, namespace: str | None
) -> list[dict[str, Any]]:
    def group(labels: dict[str, str]) -> tuple[str, ...] | None:
        if labels.get("direction") != "outbound":
            return None
        svc = _service_of(labels.get("authority", ""))
        return (*svc, labels["authority"]) if svc else None

    accs = _collect(before, after, "", group)
    out = []
    for (ns, name, authority), acc in sorted(accs.items()):
        if namespace is not None and ns != namespace:
            continue
        out.append(_row({"namespace": ns, "name": name, "authority": authority}, acc, window))
    return out


def _routes(
    before: Scrape, after: Scrape, window: float, namespace: str | None
) -> list[dict[str, Any]]:
    def group(labels: dict[str, str]) -> tuple[str, ...] | None:
        dst, route = labels.get("dst", ""), labels.get("rt_route")
        if route is None:
            return None
        svc = _service_of(dst)
        return (svc[0] if svc else "", dst, route)

    accs = _collect(before, after, "route_", group)
    out = []
    for (ns, dst, route), acc in sorted(accs.items()):
        if namespace is not None and ns != namespace:
            continue
        out.append(_row({"namespace": ns, "route": route, "dst": dst}, acc, window))
    return out
