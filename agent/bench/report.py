"""The bench's report: added latency, ratios, table, JSON document, plot.

Pure except `plot` (matplotlib, optional: without it there is no plot and a
note says so).

Rules:
1. `added_p99_ms` of a row is its p99 minus the p99 of its baseline under the
   same load: `direct-xnode` for cross-node setups (`-xnode`, `haproxy-tls*`,
   `python-floor-tls`), `direct` for the rest; None when either is missing.
2. A ratio is meshagent's number over the peer's, named
   `<metric>:<meshagent setup>/<peer setup>[@load]`; it is left out when
   either side is missing or the peer's is zero, and for added latency when
   the peer's is not positive (its p99 was within the noise of `direct`'s, so
   a quotient would only say which way the noise went). Lower is better for
   latency, CPU and memory ratios; higher for rps and Gbit/s.
3. Goals are reported, never asserted.
4. Acceleration (`accel_summary`): `meshagent-ebpf-accel` over
   `meshagent-ebpf` (the same agent without MESHAGENT_EBPF_ACCEL) for p50 and
   p99 of every small request/response load both ran (`http1-rr`,
   `http1-rate-N`, and `http1-side-N`, where the plain path is the accelerated
   agent's own on a port acceleration skips, in the row's `side`: rule 10), and
   Gbit/s of `tcp-throughput` and `tcp-reverse`. The latency goal is judged on
   the side-by-side loads where they ran (`judged_on` "side"), else on the others
   ("sequential"): it is met when the mean p50 ratio and the mean p99 ratio over
   those are both at most `ACCEL_LATENCY_GOAL`; bulk is sane when the accelerated iperf3 run
   completed without error at `ACCEL_BULK_FLOOR` or more of the plain run's
   Gbit/s, in each direction that ran (`bulk`, and `bulk["reverse"]` for the
   download). Opaque TCP request/response (`tcp-side-N`, side by side against the
   plain path too) is reported apart and never judged with HTTP: its ratios per
   load in `latency_tcp`, their means `tcp_p50_mean` and `tcp_p99_mean`, and
   `tcp_latency_goal_met` against the same `ACCEL_LATENCY_GOAL`; `latency`,
   `p50_mean`, `p99_mean` and `latency_goal_met` are the HTTP loads' only.
5. The Python floor (`python-floor`, agent.bench.floor): its http1-saturate
   rps and CPU per request over `haproxy-http`'s, and each same-node
   meshagent setup's over the floor's, named like rule 2's ratios. They say
   how much of the distance to HAProxy is Python's and how much the mesh's.
   Cross node the same with `python-floor-tls` (the floor on both hops, mTLS
   between them), `haproxy-tls` and the `-xnode` setups.
8. Cross node has two HAProxy peers per meshagent setup: `haproxy-tls` (mode
   tcp: the goal's yardstick, what mTLS alone costs) and its L7 peer
   (`l7_peer_of`: mode http on both hops, as the mesh's outbound and inbound
   parse, with what the setup sends between the proxies: `haproxy-tls-h1` for
   `-h1-xnode`, `haproxy-tls-h2` for the setups that upgrade to h2). Every
   `_RATIOS` entry of an `-xnode` setup is computed against both, and the
   floor over each L7 peer (rule 5).
6. Repeated rounds (`--repeat N`): `combine` makes one row per setup and load,
   each measured number the median over the rounds that did not fail
   (`rounds`, and `rps_rounds` for the spread); requests and errors are
   summed. Ratios and added latency are computed from those medians.
7. Paired ratios (`paired_ratios`, the document's `ratios_paired`): with
   repeated rounds, every ratio of rules 2, 4 and 5 computed within each round
   (the n-th row of a setup and load is round n; a failed row is left out of
   its round), then the median over the rounds that had both sides. On a
   machine whose speed drifts between minutes, a slow round slows both sides
   of its ratios, so these are steadier than ratios of medians that pair one
   side's fast round with the other's slow one. `{}` with one round.
9. Variants (`variants`, agent.bench.harness rule 7): for each variant and
   each setup and load both it and base measured, the n-th rows of the two
   are round n's pair (a pair with a failed row is left out). Per metric of
   `VARIANT_METRICS` the variant's number over base's in each round, their
   median, and in how many rounds the variant did better (higher rps and
   Gbit/s, lower CPU per request and latency). The variant's own rows are
   combined as rule 6 says.
10. Side by side (`http1-side-N`, and for sockmap `tcp-side-N`: `side_load`;
   agent.bench.harness rule 10): a row's `side`
   holds the peers measured in the same run of turns (`direct` and
   `haproxy-http`; across nodes `direct-xnode` and `haproxy-tls`; for sockmap
   `direct` and its plain path, `meshagent-ebpf`). Its
   `added_p99_ms`, and each peer's, is over the side's own baseline (rule 1's,
   `baseline_of`), not over a baseline row; a ratio's peer value on such a load
   comes from the row's `side` (across nodes `haproxy-tls` and the L7 peer that
   ran beside it; a side without the L7 peer has no ratio against it). `combine`
   takes each peer's numbers' median over the rounds, as rule 6 does the row's,
   and sums the row's `SIDE_COUNTS`.
   `side_notes` says each in one line. With more than one round the document
   keeps every round's rows under `measured`, and each variant its own (the
   sides' numbers per round). `saturate-side` (`SATURATE_SIDE`, agent.bench.loads
   rule 3) is http1-saturate in turns against the goal's peer only (`haproxy-http`,
   across nodes `haproxy-tls`; no baseline): its side holds that peer's requests/s,
   and its ratio is `http1_saturate_rps:<setup>/<peer>@saturate-side`.
11. Memory (`memory_summary`): per setup and pod count, RSS and PSS of the
   supervisor and of its workers, with `workers` and each worker's mean
   (`per_worker_rss_mb`, `per_worker_pss_mb`). The goal is judged on this
   machine's node agent (one worker per CPU, the `--workers` default);
   `memory_notes` says for the largest pod count what the same agent would take
   with `MEMORY_NOTE_WORKERS` workers (supervisor + that many times a worker), as
   on a node of that many CPUs.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

MEMORY_NOTE_WORKERS = (4, 8)  # rule 11: nodes of 4 and 8 CPUs
LINKERD_SIDECAR_MB = (17.0, 26.0)  # Linkerd proxy memory per meshed pod (brief, Linkerd benchmarks)
NODE_MEMORY_GOAL_MB = 150.0
ACCEL_SETUP = "meshagent-ebpf-accel"
ACCEL_PEER = "meshagent-ebpf"
ACCEL_LATENCY_GOAL = 0.85  # ">= 15% below the plain path"
BULK_LOADS = ("tcp-throughput", "tcp-reverse")  # iperf3 up (client sends) and down (-R)
ACCEL_BULK_FLOOR = 0.5  # "no bulk transfer failing": completes, at least half the plain rate
FLOOR_SETUP = "python-floor"
FLOOR_TLS_SETUP = "python-floor-tls"
CROSS_PEER = "haproxy-tls"
SIDE_PREFIX = "http1-side-"  # rule 10
TCP_SIDE_PREFIX = "tcp-side-"  # rule 10, opaque TCP echo (rule 4 keeps it apart)
SATURATE_SIDE = "saturate-side"  # rule 10, http1-saturate in turns
# a side-by-side row's counts of the mesh's path (agent.bench.harness rule 10), summed
SIDE_COUNTS = ("sent", "agent_requests", "agent_inbound_requests")
L7_PEERS = ("haproxy-tls-h1", "haproxy-tls-h2")  # rule 8
_FLOOR_METRICS = [  # (metric name, row key, load), rule 5
    ("http1_saturate_rps", "rps", "http1-saturate"),
    ("cpu_s_per_request", "cpu_s_per_req", "http1-saturate"),
]
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
    "steal_pct",
    "idle_pct",
    "errors",
]


def cross_node(setup: str) -> bool:
    """`setup`'s path spans both nodes (`a` and `b`)."""
    return setup.endswith("-xnode") or setup in (CROSS_PEER, *L7_PEERS, FLOOR_TLS_SETUP)


def side_load(load: str) -> bool:
    """Whether `load` ran side by side (rule 10): its peers' numbers are in its row."""
    return load == SATURATE_SIDE or load.startswith((SIDE_PREFIX, TCP_SIDE_PREFIX))


def baseline_of(setup: str) -> str:
    return "direct-xnode" if cross_node(setup) else "direct"


def l7_peer_of(setup: str) -> str:
    """The HAProxy that does the L7 work of cross-node `setup` (rule 8)."""
    return L7_PEERS[0] if setup.endswith("-h1-xnode") else L7_PEERS[1]


def added_ms(mine: float | None, base: float | None) -> float | None:
    """Latency added over `base` (rule 1), None when either is missing."""
    return round(mine - base, 3) if mine is not None and base is not None else None


def added_ratio(mine: float | None, theirs: float | None) -> float | None:
    """Added latency over a peer's (rule 2): None when the peer's is missing or not
    positive (within the noise of its baseline, the quotient would only say which way
    the noise went)."""
    return _ratio(mine, theirs) if theirs is not None and theirs > 0 else None


def add_latency_over_baseline(rows: Sequence[Row]) -> None:
    """Fill `added_p99_ms` in place (module rules 1 and 10); a side is copied, not
    written into."""
    p99 = {(r["setup"], r["load"]): r.get("p99_ms") for r in rows}
    for r in rows:
        if r.get("side"):
            side = {name: dict(peer) for name, peer in r["side"].items()}
            base = side.get(baseline_of(r["setup"]), {}).get("p99_ms")
            for peer in side.values():
                peer["added_p99_ms"] = added_ms(peer.get("p99_ms"), base)
            r["side"] = side
        else:
            base = p99.get((baseline_of(r["setup"]), r["load"]))
        r["added_p99_ms"] = added_ms(r.get("p99_ms"), base)


def _row_of(rows: Sequence[Row], setup: str, load: str) -> Row | None:
    return next((r for r in rows if r["setup"] == setup and r["load"] == load), None)


def _number(value: Any) -> float | None:
    return float(value) if value is not None else None


def _get(rows: Sequence[Row], setup: str, load: str, key: str) -> float | None:
    row = _row_of(rows, setup, load)
    return None if row is None else _number(row.get(key))


def _peer_get(rows: Sequence[Row], setup: str, peer: str, load: str, key: str) -> float | None:
    """The peer's `key` under `load` to compare `setup` with: from `setup`'s own row's
    side on a side-by-side load (rule 10), else from the peer's row."""
    if not side_load(load):
        return _get(rows, peer, load, key)
    row = _row_of(rows, setup, load)
    return None if row is None else _number((row.get("side") or {}).get(peer, {}).get(key))


def _ratio(mine: float | None, peer: float | None) -> float | None:
    if mine is None or peer is None or peer == 0:
        return None
    return round(mine / peer, 3)


# (metric name, row key, load, same-node peer, cross-node peer)
_RATIOS: list[tuple[str, str, str, str, str]] = [
    ("http1_saturate_rps", "rps", "http1-saturate", "haproxy-http", CROSS_PEER),
    ("http1_saturate_rps", "rps", SATURATE_SIDE, "haproxy-http", CROSS_PEER),
    ("h2_saturate_rps", "rps", "h2-saturate", "haproxy-http", CROSS_PEER),
    ("http1_post_rps", "rps", "http1-post-saturate", "haproxy-http", CROSS_PEER),
    ("added_p99", "added_p99_ms", "http1-rate-1000", "haproxy-http", CROSS_PEER),
    ("added_p99", "added_p99_ms", "http1-rate-2000", "haproxy-http", CROSS_PEER),
    ("added_p99", "added_p99_ms", SIDE_PREFIX + "1000", "haproxy-http", CROSS_PEER),
    ("added_p99", "added_p99_ms", SIDE_PREFIX + "2000", "haproxy-http", CROSS_PEER),
    ("tcp_gbps", "gbps", "tcp-throughput", "haproxy-tcp", CROSS_PEER),
    ("added_p99", "added_p99_ms", "http1-rr", "haproxy-http", CROSS_PEER),
    ("conn_rate", "rps", "conn-rate", "haproxy-http", CROSS_PEER),
    ("cpu_s_per_request", "cpu_s_per_req", "http1-rate-1000", "haproxy-http", CROSS_PEER),
    ("cpu_s_per_request", "cpu_s_per_req", "http1-saturate", "haproxy-http", CROSS_PEER),
    ("cpu_s_per_gb", "cpu_s_per_gb", "tcp-throughput", "haproxy-tcp", CROSS_PEER),
]


def ratios(rows: Sequence[Row]) -> dict[str, float]:
    """Every ratio both sides of which were measured (module rule 2)."""
    out: dict[str, float] = {}
    meshed = sorted({r["setup"] for r in rows if r["setup"].startswith("meshagent-")})
    for setup in meshed:
        xnode = setup.endswith("-xnode")
        for metric, key, load, peer_same, peer_x in _RATIOS:
            for peer in (peer_x, l7_peer_of(setup)) if xnode else (peer_same,):
                theirs = _peer_get(rows, setup, peer, load, key)
                ratio = added_ratio if key == "added_p99_ms" else _ratio
                value = ratio(_get(rows, setup, load, key), theirs)
                if value is not None:
                    out[f"{metric}:{setup}/{peer}@{load}"] = value
    out.update(_accel_ratios(rows))
    same_node = [m for m in meshed if not m.endswith("-xnode")]
    out.update(_floor_ratios(rows, FLOOR_SETUP, "haproxy-http", same_node))
    cross_node = [m for m in meshed if m.endswith("-xnode")]
    out.update(_floor_ratios(rows, FLOOR_TLS_SETUP, CROSS_PEER, cross_node))
    for peer in L7_PEERS:
        out.update(_floor_ratios(rows, FLOOR_TLS_SETUP, peer, []))
    return out


def _floor_ratios(
    rows: Sequence[Row], floor_setup: str, haproxy: str, meshed: list[str]
) -> dict[str, float]:
    """Rule 5: the floor over HAProxy, each meshagent setup of its topology over the floor."""
    out: dict[str, float] = {}
    for metric, key, load in _FLOOR_METRICS:
        floor = _get(rows, floor_setup, load, key)
        pairs = [(floor_setup, haproxy, floor, _get(rows, haproxy, load, key))]
        pairs += [(s, floor_setup, _get(rows, s, load, key), floor) for s in meshed]
        for mine, peer, a, b in pairs:
            value = _ratio(a, b)
            if value is not None:
                out[f"{metric}:{mine}/{peer}@{load}"] = value
    return out


def _accel_ratios(rows: Sequence[Row]) -> dict[str, float]:
    """`accel_<metric>:meshagent-ebpf-accel/meshagent-ebpf@<load>` (module rule 4)."""
    out: dict[str, float] = {}
    loads = sorted({r["load"] for r in rows if r["setup"] == ACCEL_SETUP})
    for load in loads:
        small = _small_rr_load(load) or _tcp_rr_load(load)
        keys: tuple[str, ...] = ("p50_ms", "p99_ms") if small else ()
        keys += ("gbps",) if load in BULK_LOADS else ()
        for key in keys:
            value = _accel_ratio(rows, load, key)
            if value is not None:
                out[f"accel_{key.removesuffix('_ms')}:{ACCEL_SETUP}/{ACCEL_PEER}@{load}"] = value
    return out


def _accel_ratio(rows: Sequence[Row], load: str, key: str) -> float | None:
    """Sockmap's `key` over the plain path's under `load` (rule 4; rule 10's side)."""
    return _ratio(
        _get(rows, ACCEL_SETUP, load, key), _peer_get(rows, ACCEL_SETUP, ACCEL_PEER, load, key)
    )


def _small_rr_load(load: str) -> bool:
    """An HTTP small request/response load (rule 4's `latency`)."""
    return load == "http1-rr" or load.startswith(("http1-rate-", SIDE_PREFIX))


def _tcp_rr_load(load: str) -> bool:
    """An opaque TCP request/response load (rule 4's `latency_tcp`)."""
    return load.startswith(TCP_SIDE_PREFIX)


def accel_judged(loads: Sequence[str]) -> tuple[list[str], str]:
    """Of sockmap's latency `loads`, those its (HTTP) goal is judged on, and which kind
    (rule 4): the HTTP side-by-side ones where any ran, else all HTTP ones; never TCP's."""
    http = [load for load in loads if not _tcp_rr_load(load)]
    side = [load for load in http if load.startswith(SIDE_PREFIX)]
    return (side, "side") if side else (http, "sequential")


def accel_tcp_judged(loads: Sequence[str]) -> list[str]:
    """Of sockmap's latency `loads`, those its opaque TCP verdict is judged on (rule 4)."""
    return [load for load in loads if _tcp_rr_load(load)]


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None


def accel_latency_met(p50: float | None, p99: float | None) -> bool | None:
    """Rule 4's latency verdict on the mean p50 and p99 ratios; None when one is missing."""
    return None if p50 is None or p99 is None else max(p50, p99) <= ACCEL_LATENCY_GOAL


def accel_summary(rows: Sequence[Row]) -> dict[str, Any] | None:
    """Acceleration against the plain eBPF path (module rule 4); None unless sockmap's
    setup ran a latency load or a bulk one."""
    if not any(r["setup"] == ACCEL_SETUP for r in rows):
        return None
    latency = _accel_latency(rows, _small_rr_load)
    latency_tcp = _accel_latency(rows, _tcp_rr_load)
    bulk = _accel_bulk(rows)
    if not latency and not latency_tcp and bulk is None:
        return None
    judged, kind = accel_judged(list(latency))
    p50, p99 = _means(latency, judged)
    tcp_p50, tcp_p99 = _means(latency_tcp, accel_tcp_judged(list(latency_tcp)))
    return {
        "latency": latency,
        "judged_on": kind,
        "p50_mean": p50,
        "p99_mean": p99,
        "latency_goal": ACCEL_LATENCY_GOAL,
        "latency_goal_met": accel_latency_met(p50, p99),
        "latency_tcp": latency_tcp,
        "tcp_p50_mean": tcp_p50,
        "tcp_p99_mean": tcp_p99,
        "tcp_latency_goal_met": accel_latency_met(tcp_p50, tcp_p99),
        "bulk": bulk,
    }


def _accel_latency(
    rows: Sequence[Row], kind: Callable[[str], bool]
) -> dict[str, dict[str, float | None]]:
    """Sockmap's p50 and p99 ratios per load of `kind` (rule 4), loads with neither left out."""
    latency: dict[str, dict[str, float | None]] = {}
    for load in sorted({r["load"] for r in rows if kind(r["load"])}):
        pair = {key: _accel_ratio(rows, load, key) for key in ("p50_ms", "p99_ms")}
        if any(v is not None for v in pair.values()):
            latency[load] = {"p50": pair["p50_ms"], "p99": pair["p99_ms"]}
    return latency


def _means(
    latency: Mapping[str, Mapping[str, float | None]], judged: Sequence[str]
) -> tuple[float | None, float | None]:
    """The mean p50 and p99 ratios over the `judged` loads of `latency`."""
    p50, p99 = (
        mean([v for x in judged if (v := latency[x][key]) is not None]) for key in ("p50", "p99")
    )
    return p50, p99


def _accel_bulk(rows: Sequence[Row]) -> dict[str, Any] | None:
    """The upload's verdict (None: not run), with the download's under "reverse" when it
    ran; "sane" only when each direction that ran is."""
    up, down = (_accel_bulk_one(rows, load) for load in BULK_LOADS)
    if up is None:
        return None
    if down is not None:
        up["reverse"] = down
        up["sane"] = up["sane"] and down["sane"]
    return up


def _accel_bulk_one(rows: Sequence[Row], load: str) -> dict[str, Any] | None:
    mine = next((r for r in rows if r["setup"] == ACCEL_SETUP and r["load"] == load), None)
    if mine is None:
        return None
    ratio = _ratio(_get(rows, ACCEL_SETUP, load, "gbps"), _get(rows, ACCEL_PEER, load, "gbps"))
    failed = bool(mine.get("error")) or not mine.get("gbps")
    return {
        "gbps": mine.get("gbps"),
        "gbps_ratio": ratio,
        "error": mine.get("error"),
        "sane": not failed and (ratio is None or ratio >= ACCEL_BULK_FLOOR),
    }


def accel_notes(summary: Mapping[str, Any] | None) -> list[str]:
    """One line for the table output: the acceleration goal and its numbers."""
    if summary is None:
        return []
    met = summary["latency_goal_met"]
    verdict = "not measured" if met is None else ("met" if met else "not met")
    bulk = summary["bulk"]
    bulk_text = "not measured"
    if bulk is not None:
        bulk_text = (
            f"{'sane' if bulk['sane'] else 'FAILED'} ({bulk['gbps']} Gbit/s, "
            f"{bulk['gbps_ratio']}x plain"
        )
        down = bulk.get("reverse")
        if down is not None:
            bulk_text += f"; reverse {down['gbps']} Gbit/s, {down['gbps_ratio']}x plain"
        bulk_text += ")"
    loads = ", ".join(accel_judged(list(summary["latency"]))[0]) or "no loads"
    line = (
        f"sockmap acceleration ({ACCEL_SETUP} / {ACCEL_PEER}): p50 {summary['p50_mean']}x, "
        f"p99 {summary['p99_mean']}x over {loads}; "
        f"goal <= {ACCEL_LATENCY_GOAL}x {verdict}; bulk {bulk_text}"
    )
    return [line, *_accel_tcp_notes(summary)]


def _accel_tcp_notes(summary: Mapping[str, Any]) -> list[str]:
    """Rule 4's opaque TCP line, apart from HTTP's; none when no `tcp-side-N` ran."""
    tcp = accel_tcp_judged(list(summary.get("latency_tcp") or {}))
    if not tcp:
        return []
    met = summary["tcp_latency_goal_met"]
    verdict = "not measured" if met is None else ("met" if met else "not met")
    line = (
        f"sockmap acceleration, opaque TCP ({ACCEL_SETUP} / {ACCEL_PEER}, not in the goal "
        f"above): p50 {summary['tcp_p50_mean']}x, p99 {summary['tcp_p99_mean']}x over "
        f"{', '.join(tcp)}; <= {ACCEL_LATENCY_GOAL}x {verdict}"
    )
    return [line]


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
            **_per_worker(r),
        }
    return out


def _per_worker(row: Row) -> dict[str, Any]:
    """Rule 11: how many workers a memory row measured, and each one's mean."""
    workers = (row.get("processes") or 0) - 1  # the supervisor and its workers
    if workers < 1 or row.get("workers_rss_mb") is None:
        return {}
    pss = row.get("workers_pss_mb")
    return {
        "workers": workers,
        "per_worker_rss_mb": round(row["workers_rss_mb"] / workers, 1),
        "per_worker_pss_mb": None if pss is None else round(pss / workers, 1),
    }


def memory_notes(summary: Mapping[str, Any]) -> list[str]:
    """Rule 11: per setup, at its largest pod count, the node agent with
    `MEMORY_NOTE_WORKERS` workers."""
    largest: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for key, m in summary.items():
        setup, count = key.rsplit("@", 1)
        if "per_worker_rss_mb" in m and int(count) >= largest.get(setup, (0, {}))[0]:
            largest[setup] = (int(count), m)
    lines = []
    for setup, (pods, m) in largest.items():
        sup, one = m["supervisor_rss_mb"], m["per_worker_rss_mb"]
        more = ", ".join(f"{n}: {sup + n * one:.0f}" for n in MEMORY_NOTE_WORKERS)
        lines.append(
            f"memory at {pods} pods ({setup}): supervisor {sup} MB + {m['workers']} workers"
            f" x {one} MB RSS (PSS {m.get('supervisor_pss_mb')} + {m['per_worker_pss_mb']}"
            f" each); one worker per CPU by default, so with more workers (MB RSS) {more}"
        )
    return lines


_MEDIAN_KEYS = (
    "rps",
    "ir_per_request",
    "p50_ms",
    "p99_ms",
    "p999_ms",
    "gbps",
    "rss_mb",
    "cpu_s",
    "cpu_s_per_req",
    "cpu_s_per_gb",
    "steal_pct",
    "idle_pct",
)


def _rounds(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows by (setup, load), in the order measured: the n-th is round n's."""
    out: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        out.setdefault((r["setup"], r["load"]), []).append(r)
    return out


def combine(rows: Sequence[Row]) -> list[Row]:
    """One row per (setup, load) from rows of repeated rounds (rule 6), first-seen order."""
    out: list[Row] = []
    for group in _rounds(rows).values():
        good = [r for r in group if not r.get("error")]
        if len(group) == 1 or not good:
            out.append(dict(group[0]))
            continue
        row = dict(good[0])
        for key in _MEDIAN_KEYS:
            values = [r[key] for r in good if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        for key in ("requests", "errors"):
            row[key] = sum(r.get(key) or 0 for r in good)
        _combine_extras(row, good)
        row["rounds"] = len(good)
        row["rps_rounds"] = [r.get("rps") for r in good]
        if any("ir_per_request" in r for r in good):
            row["ir_rounds"] = [r.get("ir_per_request") for r in good]
        out.append(row)
    return out


def _combine_extras(row: Row, good: list[Row]) -> None:
    """`combine`'s error kinds (summed), idle per CPU (medians) and side (rule 10)."""
    kinds: dict[str, int] = {}
    for r in good:
        for kind, n in (r.get("error_kinds") or {}).items():
            kinds[kind] = kinds.get(kind, 0) + n
    if kinds:
        row["error_kinds"] = kinds
    cpus = [r["idle_pct_cpus"] for r in good if r.get("idle_pct_cpus")]
    if cpus and len({len(c) for c in cpus}) == 1:
        row["idle_pct_cpus"] = [statistics.median(col) for col in zip(*cpus, strict=True)]
    if any(r.get("side") for r in good):
        row["side"] = _combine_side([r["side"] for r in good if r.get("side")])
        for key in SIDE_COUNTS:
            row[key] = sum(r.get(key) or 0 for r in good)


def _combine_side(sides: list[dict[str, Any]]) -> dict[str, Any]:
    """Rule 10: each peer's medians (and summed counts) over the rounds' sides."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(name for side in sides for name in side):
        mine = [side[name] for side in sides if name in side]
        peer: dict[str, Any] = {}
        for key in ("rps", "p50_ms", "p99_ms", "p999_ms"):
            values = [m[key] for m in mine if m.get(key) is not None]
            peer[key] = round(statistics.median(values), 3) if values else None
        for key in ("requests", "errors"):
            peer[key] = sum(m.get(key) or 0 for m in mine)
        out[name] = peer
    return out


def side_notes(rows: Sequence[Row]) -> list[str]:
    """Rule 10: one line per side-by-side row (after `add_latency_over_baseline`)."""
    lines = []
    for r in rows:
        side = r.get("side")
        if not side or r.get("error"):
            continue
        if r["load"] == SATURATE_SIDE:
            lines.append(_saturate_side_note(r, side))
            continue
        tcp = _tcp_rr_load(r["load"])
        rate = r["load"].removeprefix(TCP_SIDE_PREFIX if tcp else SIDE_PREFIX)
        base = baseline_of(r["setup"])
        cross = cross_node(r["setup"])
        haproxy = CROSS_PEER if cross else "haproxy-http"
        parts = []
        for name, peer in [*side.items(), (r["setup"], r)]:
            added = peer.get("added_p99_ms")
            p99 = peer.get("p99_ms")
            text = f"{name} p99 {p99 if p99 is None else round(p99, 3)} ms"
            parts.append(text if name == base else f"{text} (added {added})")
        if r["setup"] == ACCEL_SETUP:
            p50, p99 = (_accel_ratio([r], r["load"], key) for key in ("p50_ms", "p99_ms"))
            verdict = f": p50 {p50}x, p99 {p99}x the plain path's ({ACCEL_PEER})"
        else:
            quotients = []
            for peer_name in (haproxy, l7_peer_of(r["setup"])) if cross else (haproxy,):
                theirs = side.get(peer_name, {}).get("added_p99_ms")
                ratio = added_ratio(r.get("added_p99_ms"), theirs)
                if ratio is not None:
                    quotients.append(f"{ratio}x {peer_name}'s")
            verdict = f": {', '.join(quotients)} added p99" if quotients else ""
        what = "opaque TCP echo " if tcp else ""
        lines.append(f"{what}side by side at {rate} req/s (1 s turns): {'; '.join(parts)}{verdict}")
    return lines


def _saturate_side_note(r: Row, side: dict[str, Any]) -> str:
    """`side_notes`' line for a `saturate-side` row (rule 10)."""
    parts = [f"{name} {round(one.get('rps') or 0)} req/s" for name, one in side.items()]
    parts.append(f"{r['setup']} {round(r.get('rps') or 0)} req/s")
    quotients = [
        f"{ratio}x {name}'s"
        for name, one in side.items()
        if (ratio := _ratio(_number(r.get("rps")), _number(one.get("rps")))) is not None
    ]
    verdict = f": {', '.join(quotients)}" if quotients else ""
    return f"http1-saturate side by side (in turns): {'; '.join(parts)}{verdict}"


def paired_ratios(rows: Sequence[Row]) -> dict[str, float]:
    """Rule 7: the median over rounds of each round's own ratios; `rows` as measured,
    before `combine`."""
    rounds: list[list[Row]] = []
    seen: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r["setup"], r["load"])
        n = seen.get(key, 0)
        seen[key] = n + 1
        while len(rounds) <= n:
            rounds.append([])
        if not r.get("error"):
            rounds[n].append(dict(r))
    if len(rounds) < 2:  # one round pairs nothing
        return {}
    each: dict[str, list[float]] = {}
    for round_rows in rounds:
        add_latency_over_baseline(round_rows)
        for name, value in ratios(round_rows).items():
            each.setdefault(name, []).append(value)
    return {name: round(statistics.median(values), 3) for name, values in each.items()}


# (row key, higher is better): what a variant is compared on with base (rule 9)
VARIANT_METRICS: list[tuple[str, bool]] = [
    ("rps", True),
    ("gbps", True),
    ("cpu_s_per_req", False),
    ("p50_ms", False),
    ("p99_ms", False),
]


def variants(
    base: Sequence[Row],
    by_variant: Mapping[str, Sequence[Row]],
    envs: Mapping[str, Mapping[str, str]],
) -> dict[str, Any]:
    """Rule 9: each variant against base, round by round; rows as measured."""
    base_rounds = _rounds(base)
    out: dict[str, Any] = {}
    for name, rows in by_variant.items():
        paired: dict[str, Any] = {}
        for (setup, load), mine in _rounds(rows).items():
            theirs = base_rounds.get((setup, load), [])
            pairs = [
                (m, t) for m, t in zip(mine, theirs, strict=False)
                if not m.get("error") and not t.get("error")
            ]  # fmt: skip
            for key, higher_better in VARIANT_METRICS:
                each = [_ratio(m.get(key), t.get(key)) for m, t in pairs]
                values = [v for v in each if v is not None]
                if not values:
                    continue
                better = sum(1 for v in values if (v > 1 if higher_better else v < 1))
                paired[f"{key}:{setup}@{load}"] = {
                    "median": round(statistics.median(values), 3),
                    "rounds": values,
                    "better": better,
                }
        out[name] = {"env": dict(envs.get(name, {})), "results": combine(rows), "paired": paired}
        if len(rows) > len(_rounds(rows)):  # as `document` keeps base's (rule 10)
            out[name]["measured"] = [dict(r) for r in rows]
    return out


def variant_lines(summary: Mapping[str, Any]) -> list[str]:
    """One line per variant metric, for the table output."""
    lines = []
    for name, v in summary.items():
        env = ",".join(f"{k}={val}" for k, val in v["env"].items())
        for metric, p in v["paired"].items():
            lines.append(
                f"{name} ({env}) / base: {metric} = {p['median']} "
                f"(better in {p['better']} of {len(p['rounds'])} rounds)"
            )
    return lines


def document(
    machine: Mapping[str, Any],
    rows: Sequence[Row],
    notes: Sequence[str],
    *,
    measured: Sequence[Row] = (),
) -> dict[str, Any]:
    """The `-o json` document: `rows` combined (rule 6), `measured` the rows of every
    round as measured (rule 7), kept under `measured` when there was more than one."""
    rows = [dict(r) for r in rows]
    add_latency_over_baseline(rows)
    accel = accel_summary(rows)
    memory = memory_summary(rows)
    rounds = len(measured) > len(_rounds(measured))  # some setup and load ran twice
    return {
        **({"measured": [dict(r) for r in measured]} if rounds else {}),
        "machine": dict(machine),
        "results": rows,
        "ratios": ratios(rows),
        "ratios_paired": paired_ratios(measured),
        "memory": memory,
        "accel": accel,
        "notes": [*notes, *accel_notes(accel), *side_notes(rows), *memory_notes(memory)],
    }


def table_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    columns = list(COLUMNS)
    if any(r.get("ir_per_request") is not None for r in doc["results"]):
        columns.insert(3, "ir_per_request")  # `--icount` (agent.bench.callgrind)
    for r in doc["results"]:
        row = {}
        for c in columns:
            v = r.get(c)
            row[c] = "" if v is None else (round(v, 3) if isinstance(v, float) else v)
        if r.get("error"):
            row["errors"] = f"{row['errors']} {r['error'][:60]}".strip()
        elif r.get("error_kinds"):
            kinds = ", ".join(f"{k} x{n}" for k, n in r["error_kinds"].items())
            row["errors"] = f"{row['errors']} ({kinds})"[:120]
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
