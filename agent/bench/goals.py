"""The bench's goals (bench/README.md, "Goals") judged from one run's document.

Pure: reads a document `agent.bench.report.document` made (its `ratios`,
`ratios_paired`, `accel` and `memory`), returns what each goal measured and whether
that meets it. The document's `goals` and the table's goal lines come from here.

Rules:
1. A ratio goal is judged per judged setup (the caller's: the harness's
   `QUICK_SETUPS`, the setups the goals are judged on, not the ones that explain)
   the document has a number for, on the topology the goal names (one node, or
   across nodes: agent.bench.report.cross_node), and met only when every one of
   those numbers meets it. The added-p99 goal leaves the sockmap setup out: an
   opt-in mode with a latency goal of its own, against the plain path.
2. With rounds (`--repeat`) a ratio goal's number is the median of the ratios within
   each round (`ratios_paired`, agent.bench.report rule 7, `source` "paired"), else
   the run's ratio (`ratios`, "run"). Sockmap's latency is the mean over its loads
   of those (`accel_p50` / `accel_p99`, agent.bench.report rule 4: over the
   side-by-side loads where they ran, as `accel_summary` judges); its bulk verdict
   and memory are the run's (medians over its rounds). One round of a latency ratio
   moves with the machine's minute (bench/RESULTS.md, forty-third pass), so judge
   those over rounds.
3. Added p99 is judged on the side-by-side load at each rate (`http1-side-N`,
   agent.bench.harness rule 10) where the setup ran it, else on the rate load
   (`http1-rate-N`); saturation on `saturate-side` (in turns with its peer) where the
   setup ran it, else on `http1-saturate`; the number's name says which.
4. A goal nothing was measured for is listed with `met` None ("not measured"), so a
   run that skipped a load says so; a number that exists but whose peer added no
   latency has no ratio (agent.bench.report rule 2) and counts as not measured.
5. Goals are reported, never asserted (agent.bench.report rule 3).
6. Loads shorter than `VERDICT_LOAD_S` judge the goals all the same, and the
   document's `goals_caveat` (`caveat`, printed above the goal lines) says what
   that is worth; else it is None.
7. Sockmap's opaque TCP request/response (`tcp-side-N`, agent.bench.report rule 4)
   has a line of its own right after sockmap's (`sockmap-tcp`): the same limit on
   the mean p50 and p99 ratios over those loads (`tcp_p50_mean`, `tcp_p99_mean`;
   with rounds, the means of the ratios within rounds), judged apart; the sockmap
   line's numbers and verdict stay HTTP's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent.bench import report

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

RATES = (1000, 2000)  # the added-p99 goal's rates
MEMORY_PODS = 100
VERDICT_LOAD_S = 5.0  # rule 6: shorter loads (--quick's 1 s) make a smoke check


def caveat(duration_s: float) -> str | None:
    """Rule 6: what the goal lines are worth when each load ran `duration_s` seconds."""
    if duration_s >= VERDICT_LOAD_S:
        return None
    return (
        f"loads of {duration_s:g} s: a smoke check, not a verdict (--quick printed iptables "
        "saturation at 0.91x where 10 s rounds gave 1.02x); judge on the full run, with --repeat"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RatioGoal:
    """A goal on ratios named `<metric>:<setup>/<peer>@<load>` (agent.bench.report rule 2)."""

    name: str
    text: str
    metric: str
    loads: tuple[tuple[str, ...], ...]  # per number, its loads in order of preference (rule 3)
    limit: float
    higher: bool  # higher is better: the limit is a floor, else a ceiling
    same_peer: str | None  # the peer on one node, None: not judged on one node
    cross_peer: str | None  # across nodes


SATURATE = RatioGoal(
    name="saturate",
    text="same-node http1-saturate >= 1.0x haproxy-http",
    metric="http1_saturate_rps",
    loads=((report.SATURATE_SIDE, "http1-saturate"),),
    limit=1.0,
    higher=True,
    same_peer="haproxy-http",
    cross_peer=None,
)
SATURATE_XNODE = RatioGoal(
    name="saturate-xnode",
    text="cross-node http1-saturate (mTLS) >= 1.0x haproxy-tls",
    metric="http1_saturate_rps",
    loads=((report.SATURATE_SIDE, "http1-saturate"),),
    limit=1.0,
    higher=True,
    same_peer=None,
    cross_peer=report.CROSS_PEER,
)
ADDED_P99 = RatioGoal(
    name="added-p99",
    text="added p99 at 1,000 and 2,000 requests/s <= 1.2x haproxy-http's",
    metric="added_p99",
    loads=tuple((report.SIDE_PREFIX + str(r), f"http1-rate-{r}") for r in RATES),
    limit=1.2,
    higher=False,
    same_peer="haproxy-http",
    cross_peer=None,
)
TCP = RatioGoal(
    name="tcp-throughput",
    text="tcp-throughput >= 0.9x haproxy-tcp",
    metric="tcp_gbps",
    loads=(("tcp-throughput",),),
    limit=0.9,
    higher=True,
    same_peer="haproxy-tcp",
    cross_peer=None,
)
CPU = RatioGoal(
    name="cpu",
    text="CPU per request <= 2x HAProxy's (haproxy-http; across nodes haproxy-tls)",
    metric="cpu_s_per_request",
    loads=(("http1-rate-1000",), ("http1-saturate",)),
    limit=2.0,
    higher=False,
    same_peer="haproxy-http",
    cross_peer=report.CROSS_PEER,
)


def judge(doc: Mapping[str, Any], judged: Sequence[str]) -> list[dict[str, Any]]:
    """Every goal's numbers and verdict for the `judged` setups (module rules), in the
    order bench/README.md lists them: the ratio goals, sockmap (HTTP, then opaque TCP:
    rule 7), then node memory."""
    paired = bool(doc.get("ratios_paired"))
    ratios: Mapping[str, float] = doc["ratios_paired"] if paired else doc.get("ratios", {})
    source = "paired" if paired else "run"
    plain = [s for s in judged if s != report.ACCEL_SETUP]

    def ratio(goal: RatioGoal, setups: Sequence[str] = judged) -> dict[str, Any]:
        return _ratio_goal(goal, setups, ratios, source)

    return [
        ratio(SATURATE),
        ratio(SATURATE_XNODE),
        ratio(ADDED_P99, plain),
        ratio(TCP),
        _sockmap_goal(doc.get("accel"), ratios if paired else None),
        _sockmap_tcp_goal(doc.get("accel"), ratios if paired else None),
        ratio(CPU),
        _memory_goal(doc.get("memory", {}), judged),
    ]


def _ratio_goal(
    goal: RatioGoal, setups: Sequence[str], ratios: Mapping[str, float], source: str
) -> dict[str, Any]:
    values: dict[str, float] = {}
    for setup in setups:
        peer = goal.cross_peer if report.cross_node(setup) else goal.same_peer
        if peer is None:
            continue
        for loads in goal.loads:
            names = (f"{goal.metric}:{setup}/{peer}@{load}" for load in loads)
            name = next((n for n in names if n in ratios), None)
            if name is not None:
                values[name] = ratios[name]
    if goal.higher:
        met = all(v >= goal.limit for v in values.values())
    else:
        met = all(v <= goal.limit for v in values.values())
    return {
        "goal": goal.name,
        "text": goal.text,
        "limit": goal.limit,
        "values": values,
        "met": met if values else None,
        "source": source,
    }


def _sockmap_goal(
    accel: Mapping[str, Any] | None, paired: Mapping[str, float] | None
) -> dict[str, Any]:
    """Sockmap: latency at least 15% below the plain path, and no bulk transfer failing
    (agent.bench.report rule 4); the latency from the `paired` ratios when given."""
    entry: dict[str, Any] = {
        "goal": "sockmap",
        "text": (
            f"sockmap: small request/response latency <= {report.ACCEL_LATENCY_GOAL}x "
            "the plain path's, no bulk transfer failing"
        ),
        "limit": report.ACCEL_LATENCY_GOAL,
        "values": {},
        "met": None,
        "source": "run",
    }
    if accel is None:
        return entry
    p50, p99 = accel["p50_mean"], accel["p99_mean"]
    if paired is not None:
        p50, p99 = (_accel_mean(paired, metric) for metric in ("accel_p50", "accel_p99"))
        entry["source"] = "paired"
    entry["values"] = {"p50": p50, "p99": p99}
    latency = report.accel_latency_met(p50, p99)
    bulk = accel.get("bulk")
    if bulk is not None:
        entry["values"]["bulk_sane"] = bulk["sane"]
    if latency is not None:
        entry["met"] = latency and (bulk is None or bool(bulk["sane"]))
    return entry


def _sockmap_tcp_goal(
    accel: Mapping[str, Any] | None, paired: Mapping[str, float] | None
) -> dict[str, Any]:
    """Rule 7: sockmap's opaque TCP latency against the plain path's, apart from HTTP's;
    from the `paired` ratios when given."""
    entry: dict[str, Any] = {
        "goal": "sockmap-tcp",
        "text": (
            f"sockmap, opaque TCP (tcp-side-N, judged apart): latency <= "
            f"{report.ACCEL_LATENCY_GOAL}x the plain path's"
        ),
        "limit": report.ACCEL_LATENCY_GOAL,
        "values": {},
        "met": None,
        "source": "run",
    }
    if accel is None or not accel.get("latency_tcp"):
        return entry
    p50, p99 = accel["tcp_p50_mean"], accel["tcp_p99_mean"]
    if paired is not None:
        p50, p99 = (_accel_mean(paired, m, tcp=True) for m in ("accel_p50", "accel_p99"))
        entry["source"] = "paired"
    entry["values"] = {"p50": p50, "p99": p99}
    entry["met"] = report.accel_latency_met(p50, p99)
    return entry


def _accel_mean(ratios: Mapping[str, float], metric: str, *, tcp: bool = False) -> float | None:
    """The mean of sockmap's `metric` ratios over the loads its goal is judged on
    (agent.bench.report rule 4: the HTTP side-by-side ones where they ran), or with
    `tcp` over its opaque TCP loads (rule 7)."""
    prefix = f"{metric}:{report.ACCEL_SETUP}/{report.ACCEL_PEER}@"
    by_load = {k.removeprefix(prefix): v for k, v in ratios.items() if k.startswith(prefix)}
    if tcp:
        judged = report.accel_tcp_judged(list(by_load))
    else:
        judged, _ = report.accel_judged(list(by_load))
    return report.mean([by_load[load] for load in judged])


def _memory_goal(memory: Mapping[str, Any], judged: Sequence[str]) -> dict[str, Any]:
    """Node memory at 100 meshed pods, supervisor and workers' RSS."""
    keys = (f"{setup}@{MEMORY_PODS}" for setup in judged)
    values = {k: float(memory[k]["rss_mb"]) for k in keys if (memory.get(k) or {}).get("rss_mb")}
    return {
        "goal": "memory",
        "text": f"node memory <= {report.NODE_MEMORY_GOAL_MB:g} MB at {MEMORY_PODS} meshed pods",
        "limit": report.NODE_MEMORY_GOAL_MB,
        "values": values,
        "met": all(v <= report.NODE_MEMORY_GOAL_MB for v in values.values()) if values else None,
        "source": "run",
    }


def lines(goals: list[dict[str, Any]]) -> list[str]:
    """One line per goal, for the table output."""
    out = []
    for g in goals:
        verdict = {None: "not measured", True: "met", False: "NOT MET"}[g["met"]]
        numbers = ", ".join(f"{_short(k)} {v}" for k, v in g["values"].items())
        within = " (medians within rounds)" if g["source"] == "paired" and g["values"] else ""
        out.append(f"{g['text']}: {verdict}{within}" + (f": {numbers}" if numbers else ""))
    return out


def _short(name: str) -> str:
    """A ratio's name without its metric and peer (`<setup>@<load>`, the goal says both);
    other names as they are."""
    if ":" not in name or "/" not in name:
        return name
    setup, rest = name.split(":", 1)[1].split("/", 1)
    return f"{setup}@{rest.split('@', 1)[1]}" if "@" in rest else setup
