"""The bench's report: added latency, ratios, table, JSON document, plot.

Pure except `plot` (matplotlib, optional: without it there is no plot and a
note says so).

Rules:
1. `added_p99_ms` of a row is its p99 minus the p99 of its baseline under the
   same load: `direct-xnode` for cross-node setups and `haproxy-tls`,
   `direct` for the rest; None when either is missing.
2. A ratio is meshagent's number over the peer's, named
   `<metric>:<meshagent setup>/<peer setup>[@load]`; it is left out when
   either side is missing or the peer's is zero. Lower is better for
   latency, CPU and memory ratios; higher for rps and Gbit/s.
3. Goals are reported, never asserted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

LINKERD_SIDECAR_MB = (17.0, 26.0)  # Linkerd proxy memory per meshed pod (brief, Linkerd benchmarks)
NODE_MEMORY_GOAL_MB = 150.0
Row = dict[str, Any]

COLUMNS = [
    "setup",
    "load",
    "rps",
    "p50_ms",
    "p99_ms",
    "p999_ms",
    "added_p99_ms",
    "gbps",
    "cpu_s",
    "rss_mb",
    "errors",
]


def baseline_of(setup: str) -> str:
    return "direct-xnode" if setup.endswith("-xnode") or setup == "haproxy-tls" else "direct"


def add_latency_over_baseline(rows: Sequence[Row]) -> None:
    """Fill `added_p99_ms` in place (module rule 1)."""
    p99 = {(r["setup"], r["load"]): r.get("p99_ms") for r in rows}
    for r in rows:
        base = p99.get((baseline_of(r["setup"]), r["load"]))
        mine = r.get("p99_ms")
        r["added_p99_ms"] = round(mine - base, 3) if mine is not None and base is not None else None


def _get(rows: Sequence[Row], setup: str, load: str, key: str) -> float | None:
    for r in rows:
        if r["setup"] == setup and r["load"] == load:
            value = r.get(key)
            return float(value) if value is not None else None
    return None


def _ratio(mine: float | None, peer: float | None) -> float | None:
    if mine is None or peer is None or peer == 0:
        return None
    return round(mine / peer, 3)


# (metric name, row key, load, same-node peer, cross-node peer)
_RATIOS: list[tuple[str, str, str, str, str]] = [
    ("http1_saturate_rps", "rps", "http1-saturate", "haproxy-http", "haproxy-tls"),
    ("h2_saturate_rps", "rps", "h2-saturate", "haproxy-http", "haproxy-tls"),
    ("added_p99", "added_p99_ms", "http1-rate-1000", "haproxy-http", "haproxy-tls"),
    ("added_p99", "added_p99_ms", "http1-rate-2000", "haproxy-http", "haproxy-tls"),
    ("tcp_gbps", "gbps", "tcp-throughput", "haproxy-tcp", "haproxy-tls"),
    ("conn_rate", "rps", "conn-rate", "haproxy-http", "haproxy-tls"),
    ("cpu_s_per_request", "cpu_s_per_req", "http1-rate-1000", "haproxy-http", "haproxy-tls"),
    ("cpu_s_per_request", "cpu_s_per_req", "http1-saturate", "haproxy-http", "haproxy-tls"),
    ("cpu_s_per_gb", "cpu_s_per_gb", "tcp-throughput", "haproxy-tcp", "haproxy-tls"),
]


def ratios(rows: Sequence[Row]) -> dict[str, float]:
    """Every ratio both sides of which were measured (module rule 2)."""
    out: dict[str, float] = {}
    meshed = sorted({r["setup"] for r in rows if r["setup"].startswith("meshagent-")})
    for setup in meshed:
        xnode = setup.endswith("-xnode")
        for metric, key, load, peer_same, peer_x in _RATIOS:
            peer = peer_x if xnode else peer_same
            value = _ratio(_get(rows, setup, load, key), _get(rows, peer, load, key))
            if value is not None:
                out[f"{metric}:{setup}/{peer}@{load}"] = value
    return out


def memory_summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Node memory per meshed-pod count beside Linkerd's sidecars (module rule 3)."""
    out: dict[str, Any] = {}
    for r in rows:
        if not r["load"].startswith("memory-") or r.get("rss_mb") is None:
            continue
        pods = int(r["load"].split("-", 1)[1])
        low, high = LINKERD_SIDECAR_MB
        out[f"{r['setup']}@{pods}"] = {
            "rss_mb": r["rss_mb"],
            "pss_mb": r.get("pss_mb"),
            **{
                k: r[k]
                for k in (
                    "supervisor_rss_mb",
                    "supervisor_pss_mb",
                    "workers_rss_mb",
                    "workers_pss_mb",
                )
                if k in r
            },
            "linkerd_sidecars_mb": [round(low * pods, 1), round(high * pods, 1)],
            "goal_mb": NODE_MEMORY_GOAL_MB if pods == 100 else None,
        }
    return out


def document(
    machine: Mapping[str, Any], rows: Sequence[Row], notes: Sequence[str]
) -> dict[str, Any]:
    """The `-o json` document."""
    rows = [dict(r) for r in rows]
    add_latency_over_baseline(rows)
    return {
        "machine": dict(machine),
        "results": rows,
        "ratios": ratios(rows),
        "memory": memory_summary(rows),
        "notes": list(notes),
    }


def table_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in doc["results"]:
        row = {}
        for c in COLUMNS:
            v = r.get(c)
            row[c] = "" if v is None else (round(v, 3) if isinstance(v, float) else v)
        if r.get("error"):
            row["errors"] = f"{row['errors']} {r['error'][:60]}".strip()
        out.append(row)
    return out


def plot(doc: Mapping[str, Any], path: str) -> str | None:
    """Latency percentiles per setup for each http1-rate load, as a PNG at `path`.

    Returns None when written, else why not (matplotlib missing, nothing to plot).
    """
    try:
        import matplotlib as mpl  # noqa: PLC0415 - optional

        mpl.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed: no plot"
    rows = [r for r in doc["results"] if r["load"].startswith("http1-rate-") and r.get("p50_ms")]
    loads = sorted({r["load"] for r in rows}, key=lambda s: int(s.rsplit("-", 1)[1]))
    if not loads:
        return "no http1-rate results: no plot"
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 5), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        mine = [r for r in rows if r["load"] == load]
        xs = range(len(mine))
        width = 0.27
        for k, (key, label) in enumerate(
            (("p50_ms", "p50"), ("p99_ms", "p99"), ("p999_ms", "p99.9"))
        ):
            ax.bar(
                [x + (k - 1) * width for x in xs],
                [r.get(key) or 0 for r in mine],
                width,
                label=label,
            )
        ax.set_xticks(list(xs), [r["setup"] for r in mine], rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("latency (ms)")
        ax.set_yscale("log")
        ax.set_title(load)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
