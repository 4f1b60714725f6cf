"""The supervisor's merged view of every worker's metrics, and the text exposition.

Workers send cumulative `MetricsSnapshot`s (every second and when they
drain); `MetricsAggregator` keeps the latest one per live worker incarnation
and a "retired" base holding what dead incarnations had counted.

Rules:
1. Counters and histograms: merged = retired base + sum over live snapshots
   (histograms bucket-wise, sums added). Gauges: live workers only, summed or
   maxed as their family says (`Merge`).
2. An incarnation is (worker_id, incarnation); a snapshot of a new
   incarnation in a slot retires the old one first. `retire(worker_id)` folds
   the last snapshot's counters and histograms into the base and forgets its
   gauges, so totals never go backwards when a replacement starts from zero.
3. Nothing is counted twice: a late snapshot from a retired incarnation adds
   only its increase over what was already folded in (the last few retired
   incarnations are remembered for this); a snapshot older than the one held
   (lower `seq`) is ignored.
4. `render` writes Prometheus text format 0.0.4 itself (one pass, sorted for
   stable output); only families that have samples are written.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import TYPE_CHECKING

from agent.admin.families import FAMILIES, Family, Kind, Merge

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from agent.admin.metrics import HistValue, Labels, MetricsSnapshot, Samples, Value

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _add_hist(a: HistValue, b: HistValue) -> HistValue:
    return tuple(x + y for x, y in zip(a[0], b[0], strict=True)), a[1] + b[1]


def _sub_hist(a: HistValue, b: HistValue) -> HistValue:
    return tuple(max(x - y, 0) for x, y in zip(a[0], b[0], strict=True)), max(a[1] - b[1], 0.0)


def _accumulates(name: str) -> bool:
    spec = FAMILIES.get(name)
    return spec is not None and spec.kind is not Kind.GAUGE


class MetricsAggregator:
    """Merges worker snapshots; see the module rules."""

    def __init__(self, *, remember_retired: int = 32) -> None:
        self._live: dict[int, MetricsSnapshot] = {}
        self._base: dict[str, Samples] = {}
        self._retired: OrderedDict[tuple[int, int], MetricsSnapshot] = OrderedDict()
        self._remember = remember_retired

    @property
    def live_workers(self) -> dict[int, int]:
        """worker_id -> incarnation of the workers whose snapshots are live."""
        return {wid: snap.incarnation for wid, snap in self._live.items()}

    def update(self, snap: MetricsSnapshot) -> None:
        """Take a worker's latest cumulative snapshot."""
        key = (snap.worker_id, snap.incarnation)
        if key in self._retired:
            self._fold_late(key, snap)
            return
        held = self._live.get(snap.worker_id)
        if held is not None and held.incarnation != snap.incarnation:
            logger.info(
                "worker replaced, retiring its previous metrics",
                extra={"worker": snap.worker_id, "old": held.incarnation},
            )
            self.retire(snap.worker_id)
        elif held is not None and snap.seq <= held.seq:
            return  # out of order: we already hold a newer one
        self._live[snap.worker_id] = snap

    def retire(self, worker_id: int) -> None:
        """The worker in `worker_id`'s slot is gone: keep its counts, drop its gauges."""
        snap = self._live.pop(worker_id, None)
        if snap is None:
            return
        self._fold(snap.families)
        self._retired[(snap.worker_id, snap.incarnation)] = snap
        while len(self._retired) > self._remember:
            self._retired.popitem(last=False)

    def _fold_late(self, key: tuple[int, int], snap: MetricsSnapshot) -> None:
        old = self._retired[key]
        if snap.seq <= old.seq:
            return
        delta: dict[str, Samples] = {}
        for name, samples in snap.families.items():
            if not _accumulates(name):
                continue
            before = old.families.get(name, {})
            out: Samples = {}
            for labels, value in samples.items():
                prev = before.get(labels)
                out[labels] = value if prev is None else _minus(value, prev)
            delta[name] = out
        self._fold(delta)
        self._retired[key] = snap

    def _fold(self, families: Mapping[str, Samples]) -> None:
        for name, samples in families.items():
            if not _accumulates(name):
                continue
            base = self._base.setdefault(name, {})
            _merge_into(base, samples, Merge.SUM)

    def forget_pod(self, namespace: str, pod: str) -> None:
        """Drop a departed pod's series from the retired base (workers drop their own)."""
        want = {("namespace", namespace), ("pod", pod)}
        for samples in self._base.values():
            for labels in [lb for lb in samples if want.issubset(lb)]:
                del samples[labels]

    def merged(self) -> dict[str, Samples]:
        """family -> {labels: value} across retired and live workers."""
        out: dict[str, Samples] = {name: dict(samples) for name, samples in self._base.items()}
        for snap in self._live.values():
            for name, samples in snap.families.items():
                spec = FAMILIES.get(name)
                merge = spec.merge if spec is not None else Merge.SUM
                _merge_into(out.setdefault(name, {}), samples, merge)
        return out

    def families(self) -> list[tuple[Family, Samples]]:
        """The merged view as (family, samples) pairs, ready for `render`."""
        return [(FAMILIES[name], s) for name, s in self.merged().items() if name in FAMILIES]


def _merge_into(into: Samples, samples: Mapping[Labels, Value], merge: Merge) -> None:
    for labels, value in samples.items():
        have = into.get(labels)
        into[labels] = value if have is None else _combine(have, value, merge)


def _combine(a: Value, b: Value, merge: Merge) -> Value:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return _add_hist(a, b)
    if isinstance(a, tuple) or isinstance(b, tuple):
        raise TypeError("BUG: a series is a histogram in one snapshot and not in another")
    return max(a, b) if merge is Merge.MAX else a + b


def _minus(a: Value, b: Value) -> Value:
    """Increase of cumulative `a` over earlier `b`, never negative."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return _sub_hist(a, b)
    if isinstance(a, tuple) or isinstance(b, tuple):
        raise TypeError("BUG: a series is a histogram in one snapshot and not in another")
    return max(a - b, 0.0)


# --- text exposition --------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _label_text(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _bound_text(bound: float) -> str:
    return _number(bound)


def render(families: Iterable[tuple[Family, Mapping[Labels, Value]]]) -> str:
    """Prometheus text format 0.0.4 for `families` (rule 4)."""
    lines: list[str] = []
    for family, samples in sorted(families, key=lambda fs: fs[0].name):
        if not samples:
            continue
        name = family.name
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {family.kind.value}")
        for labels in sorted(samples):
            value = samples[labels]
            if isinstance(value, tuple):
                _render_histogram(lines, family, labels, value)
            else:
                lines.append(f"{name}{_label_text(labels)} {_number(value)}")
    lines.append("")
    return "\n".join(lines)


def _render_histogram(lines: list[str], family: Family, labels: Labels, value: HistValue) -> None:
    counts, total = value
    name = family.name
    running = 0
    bounds = [*map(_bound_text, family.buckets), "+Inf"]
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        le = 'le="' + bound + '"'
        lines.append(f"{name}_bucket{_label_text(labels, le)} {running}")
    lines.append(f"{name}_sum{_label_text(labels)} {_number(total)}")
    lines.append(f"{name}_count{_label_text(labels)} {running}")


class Exposition:
    """What `/metrics` serves: the aggregator's merged view plus supervisor-side sources.

    A source is a callable returning (family, samples) pairs (e.g.
    `NodeMetrics.families`); a source that raises is logged and skipped so one
    broken collector never breaks the scrape.
    """

    def __init__(self, aggregator: MetricsAggregator | None = None) -> None:
        self.aggregator = aggregator or MetricsAggregator()
        self._sources: list[Callable[[], Iterable[tuple[Family, Mapping[Labels, Value]]]]] = []

    def add_source(
        self, source: Callable[[], Iterable[tuple[Family, Mapping[Labels, Value]]]]
    ) -> None:
        self._sources.append(source)

    def render(self) -> str:
        """The full scrape body."""
        by_name: dict[str, tuple[Family, dict[Labels, Value]]] = {}
        collected: list[tuple[Family, Mapping[Labels, Value]]] = list(self.aggregator.families())
        for source in self._sources:
            try:
                collected.extend(source())
            except Exception:
                logger.exception("metrics source failed", extra={"source": repr(source)})
        for family, samples in collected:
            slot = by_name.setdefault(family.name, (family, {}))
            _merge_into(slot[1], samples, family.merge)
        return render(by_name.values())
