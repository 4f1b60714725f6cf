"""The sandbox's traffic plan and live terminal view.

`traffic(state)` (pure) picks who calls whom: every pod calls every HTTP
Service port in its own namespace not backed by its own workload, and unmeshed
pods also call the meshed namespaces' Services (through kube-proxy). `run`
starts one driver (`agent.sandbox.load`) per calling pod and redraws a table
every 2 s: per client pod and route (client side: rps, success rate,
p50/p95/p99), and per pod from the agents' /metrics (TCP connections, mTLS,
client identities, policy denials), until the duration ends or Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.render import table

if TYPE_CHECKING:
    from collections.abc import Callable

STATS_DIR = Path("/run/meshagent/sandbox/stats")
REFRESH = 2.0


def services(data: dict[str, Any]) -> list[tuple[str, str, int, bool]]:
    """(namespace, service, port, opaque) from the generated manifests."""
    import yaml  # noqa: PLC0415

    found = []
    gen = Path(data.get("generated", ""))
    for path in sorted(gen.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") != "Service":
                continue
            meta = doc.get("metadata") or {}
            opaque = "config.linkerd.io/opaque-ports" in (meta.get("annotations") or {})
            found += [
                (meta.get("namespace") or "default", meta["name"], int(p["port"]), opaque)
                for p in (doc.get("spec") or {}).get("ports", [])
            ]
    return found


def traffic(
    pods: list[dict[str, Any]], services: list[tuple[str, str, int, bool]]
) -> dict[str, list[str]]:
    """Pod key -> URLs it calls (see the module docstring)."""
    out: dict[str, list[str]] = {}
    meshed_ns = {p["namespace"] for p in pods if p["meshed"]}
    for pod in pods:
        workload = pod["name"].rsplit("-", 2)[0]
        urls = [
            f"http://{name}.{ns}.svc.cluster.local:{port}/"
            for ns, name, port, opaque in services
            if not opaque
            and name != workload
            and (ns == pod["namespace"] or (not pod["meshed"] and ns in meshed_ns))
        ]
        if urls:
            out[f"{pod['namespace']}/{pod['name']}"] = urls
    return out


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{values[min(len(values) - 1, int(q * len(values)))]:.1f}"


def client_rows(stats: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for pod, targets in sorted(stats.items()):
        for t in targets:
            n = t["requests"]
            lat = t["latencies_ms"]
            rows.append({
                "client": pod,
                "route": t["url"].removeprefix("http://"),
                "rps": f"{n / t['window']:.1f}",
                "success": f"{100 * t['success'] / n:.0f}%" if n else "-",
                "p50_ms": _pct(lat, 0.5),
                "p95_ms": _pct(lat, 0.95),
                "p99_ms": _pct(lat, 0.99),
                "statuses": ",".join(f"{k}:{v}" for k, v in sorted(t["statuses"].items())),
            })  # fmt: skip
    return rows


def _metrics(url: str) -> str | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=1) as resp:  # noqa: S310 - ours
            return str(resp.read().decode())
    except (OSError, ValueError):
        return None


def _new_row(pod: str, node: str) -> dict[str, Any]:
    return {"pod": pod, "node": node, "requests": 0, "tcp_open": 0,
            "tls": set(), "clients": set(), "denied": 0}  # fmt: skip


def _add_sample(row: dict[str, Any], name: str, labels: dict[str, str], value: float) -> None:
    if name == "request_total":
        row["requests"] += int(value)
        if labels.get("tls"):
            row["tls"].add(labels["tls"])
        if labels.get("client_id"):
            row["clients"].add(labels["client_id"].split(".")[0])
    elif name == "tcp_open_connections":
        row["tcp_open"] += int(value)
    elif name.startswith(("inbound_http_authz_deny", "inbound_tcp_authz_deny")):
        row["denied"] += int(value)


def agent_rows(agents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pod, from the agents' /metrics (empty when none answers)."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    per: dict[str, dict[str, Any]] = {}
    for agent in agents:
        text = _metrics(agent["admin_url"])
        if text is None:
            continue
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                pod = f"{s.labels.get('namespace', '')}/{s.labels.get('pod', '')}"
                if pod != "/":
                    row = per.setdefault(pod, _new_row(pod, agent["node"]))
                    _add_sample(row, s.name, s.labels, s.value)
    return [
        {**r, "tls": ",".join(sorted(r["tls"])), "clients": ",".join(sorted(r["clients"]))}
        for _, r in sorted(per.items())
    ]


def _read_stats() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in STATS_DIR.glob("*.json"):
        try:
            out[path.stem.replace("__", "/")] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def run(
    data: dict[str, Any],
    *,
    duration: float | None,
    spawn: Callable[[list[str], dict[str, Any]], None],
    agents: list[dict[str, Any]] | None = None,
) -> None:
    """Start the drivers and redraw until `duration` (or forever: Ctrl-C)."""
    STATS_DIR.mkdir(parents=True, exist_ok=True)
    pods = {f"{p['namespace']}/{p['name']}": p for p in data.get("pods", [])}
    for key, urls in traffic(list(pods.values()), services(data)).items():
        stats = STATS_DIR / (key.replace("/", "__") + ".json")
        spawn([sys.executable, "-m", "agent.sandbox.load", "--stats", str(stats), *urls], pods[key])
    if agents is None:
        agents = [
            {"node": n["name"], "admin_url": n["admin_url"]}
            for n in data.get("nodes", [])
            if n.get("admin_url")
        ]
    end = time.monotonic() + duration if duration else None
    while end is None or time.monotonic() < end:
        time.sleep(REFRESH)
        clear = "\x1b[2J\x1b[H" if sys.stdout.isatty() else ""
        out = [clear, time.strftime("%H:%M:%S"), "meshagent sandbox (Ctrl-C to stop)", ""]
        out.append(table(client_rows(_read_stats())))
        rows = agent_rows(agents)
        if rows:
            out += ["", table(rows)]
        sys.stdout.write("\n".join(out) + "\n")
        sys.stdout.flush()
