"""Agent and node metrics: processes, node CPU/memory/load, and agent state gauges.

Read at scrape time from psutil and the kernel (`/proc`), so they cost nothing
between scrapes. The agent's own state (enrolled pods, listeners, redirect
rules, BPF map entries, control-plane streams, certificates, workers) is
pushed in by its owners through the small setters of `NodeMetrics`.

Workers import this module only for `measure_loop_lag`, so psutil is imported
where it is read (`_psutil`), never at module import: a worker process does
not load it (about 1.4 MB of RSS each).

Rules:
1. Process metrics carry `process` = supervisor | worker and, for workers,
   `worker` = the slot id. A replaced worker's `process_cpu_seconds_total`
   restarts from its new process's zero, as for any restarted process;
   `process_start_time_seconds` shows the restart, and `rate()` handles it.
2. A process that vanished between `set_workers` and the scrape is skipped.
3. Setters never raise on values they can store; label values are the
   bounded names their callers own (modes, map names, services, identities).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from agent.admin.families import FAMILIES, Family, Kind, register

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import psutil

    from agent.admin.metrics import Labels, Samples

logger = logging.getLogger(__name__)

C, G = Kind.COUNTER, Kind.GAUGE
_PROC = frozenset({"process", "worker"})


def _fam(name: str, kind: Kind, help_: str, labels: set[str] | frozenset[str]) -> Family:
    return register(Family(name=name, kind=kind, help=help_, labels=frozenset(labels)))


PROCESS_CPU = _fam("process_cpu_seconds_total", C, "Total user and system CPU time", _PROC)
PROCESS_RSS = _fam("process_resident_memory_bytes", G, "Resident memory size in bytes", _PROC)
PROCESS_FDS = _fam("process_open_fds", G, "Number of open file descriptors", _PROC)
PROCESS_START = _fam(
    "process_start_time_seconds", G, "Start time of the process since the epoch", _PROC
)
NODE_CPU = _fam("meshagent_node_cpu_seconds_total", C, "Node CPU time by mode", {"mode"})
NODE_CPUS = _fam("meshagent_node_cpus", G, "Logical CPUs of the node", set())
NODE_MEM_TOTAL = _fam("meshagent_node_memory_total_bytes", G, "Node memory", set())
NODE_MEM_AVAIL = _fam(
    "meshagent_node_memory_available_bytes", G, "Node memory available to programs", set()
)
NODE_LOAD = {
    n: _fam(f"meshagent_node_load{n}", G, f"Node load average over {n} minute(s)", set())
    for n in (1, 5, 15)
}
ENROLLED = _fam("meshagent_enrolled_pods", G, "Pods whose traffic this agent captures", {"mode"})
LISTENERS = _fam("meshagent_listeners", G, "In-pod listeners open, by kind", {"kind"})
REDIRECT_RULES = _fam("meshagent_redirect_rules", G, "Capture rules programmed, by mode", {"mode"})
BPF_ENTRIES = _fam("meshagent_bpf_map_entries", G, "Entries in the agent's BPF maps", {"map"})
STREAM_UP = _fam(
    "meshagent_control_plane_stream_up",
    G,
    "1 while the control-plane stream of a service is established",
    {"service"},
)
RECONNECTS = _fam(
    "meshagent_control_plane_reconnects_total",
    C,
    "Control-plane stream reconnects",
    {"service"},
)
CERT_EXPIRY = _fam(
    "identity_cert_expiration_timestamp_seconds",
    G,
    "Time when this proxy's current mTLS identity certificate will expire (in seconds since "
    "the UNIX epoch)",
    {"identity"},
)
CERT_REFRESH = _fam(
    "identity_cert_refresh_count", C, "The total number of times this proxy's mTLS identity "
    "certificate has been refreshed by the Identity service.", {"identity"}
)  # fmt: skip
CERT_FAILURES = _fam(
    "meshagent_identity_cert_failures_total",
    C,
    "Failed certificate renewals",
    {"identity"},
)
WORKERS = _fam("meshagent_workers", G, "Worker processes, desired and up", {"state"})
WORKER_RESTARTS = _fam(
    "meshagent_worker_restarts_total", C, "Worker processes replaced after exiting", set()
)
LOOP_LAG = FAMILIES["meshagent_event_loop_lag_seconds"]  # declared with the worker families


def _psutil() -> Any:
    """The psutil module, imported on first use (supervisor only; see the module docstring)."""
    import psutil  # noqa: PLC0415 - workers import this module and never need psutil

    return psutil


class NodeMetrics:
    """Supervisor-side metrics; `families` is an `Exposition` source."""

    def __init__(self, *, supervisor_pid: int | None = None) -> None:
        self._supervisor_pid = os.getpid() if supervisor_pid is None else supervisor_pid
        self._procs: dict[int, psutil.Process] = {}
        self._workers: dict[int, int] = {}
        self._gauges: dict[Family, dict[Labels, float]] = {}
        self._counters: dict[Family, dict[Labels, float]] = {}

    # --- setters for the agent's owners -------------------------------------

    def set_workers(self, pids: Mapping[int, int]) -> None:
        """The live workers: worker_id -> pid."""
        self._workers = dict(pids)

    def set_worker_counts(self, *, desired: int, up: int) -> None:
        self._set(WORKERS, (("state", "desired"),), desired)
        self._set(WORKERS, (("state", "up"),), up)

    def inc_worker_restarts(self, n: int = 1) -> None:
        self._inc(WORKER_RESTARTS, (), n)

    def set_enrolled_pods(self, mode: str, count: int) -> None:
        """Pods captured in `mode` (iptables | ebpf)."""
        self._set(ENROLLED, (("mode", mode),), count)

    def set_listeners(self, kind: str, count: int) -> None:
        """In-pod listeners of `kind` (inbound | outbound)."""
        self._set(LISTENERS, (("kind", kind),), count)

    def set_redirect_rules(self, mode: str, count: int) -> None:
        self._set(REDIRECT_RULES, (("mode", mode),), count)

    def set_bpf_map_entries(self, map_name: str, count: int) -> None:
        self._set(BPF_ENTRIES, (("map", map_name),), count)

    def set_stream_state(self, service: str, up: bool) -> None:
        """`service`: destination | identity | policy."""
        self._set(STREAM_UP, (("service", service),), 1 if up else 0)

    def inc_reconnects(self, service: str, n: int = 1) -> None:
        self._inc(RECONNECTS, (("service", service),), n)

    def set_cert_expiry(self, identity: str, not_after: float) -> None:
        """The current certificate of `identity` expires at `not_after` (epoch seconds)."""
        self._set(CERT_EXPIRY, (("identity", identity),), not_after)

    def inc_cert_refresh(self, identity: str) -> None:
        self._inc(CERT_REFRESH, (("identity", identity),), 1)

    def inc_cert_failure(self, identity: str) -> None:
        self._inc(CERT_FAILURES, (("identity", identity),), 1)

    def set_cert_totals(self, identity: str, *, renewals: int, failures: int) -> None:
        """Renewal and failure totals of `identity`, as its owner counts them."""
        self._counters.setdefault(CERT_REFRESH, {})[(("identity", identity),)] = renewals
        self._counters.setdefault(CERT_FAILURES, {})[(("identity", identity),)] = failures

    def set_reconnects(self, service: str, total: int) -> None:
        """Reconnects of `service`'s streams so far, as the client counts them."""
        self._counters.setdefault(RECONNECTS, {})[(("service", service),)] = total

    def forget_identity(self, identity: str) -> None:
        """The node holds no key for `identity` any more: drop its series."""
        key = (("identity", identity),)
        for table in (self._gauges, self._counters):
            for fam in (CERT_EXPIRY, CERT_REFRESH, CERT_FAILURES):
                table.get(fam, {}).pop(key, None)

    def set_loop_lag(self, seconds: float) -> None:
        """The supervisor's own event-loop lag."""
        self._set(LOOP_LAG, (("process", "supervisor"),), seconds)

    def _set(self, fam: Family, labels: Labels, value: float) -> None:
        self._gauges.setdefault(fam, {})[labels] = value

    def _inc(self, fam: Family, labels: Labels, n: float) -> None:
        table = self._counters.setdefault(fam, {})
        table[labels] = table.get(labels, 0) + n

    # --- collection ---------------------------------------------------------

    def families(self) -> list[tuple[Family, Samples]]:
        """Everything, read now."""
        out: list[tuple[Family, Samples]] = []
        out.extend(self._process_families())
        out.extend(self._node_families())
        out.extend((fam, dict(samples)) for fam, samples in self._gauges.items())
        out.extend((fam, dict(samples)) for fam, samples in self._counters.items())
        return out

    def _process(self, pid: int) -> psutil.Process | None:
        psutil = _psutil()
        proc = self._procs.get(pid)
        if proc is None or not proc.is_running():  # is_running also catches PID reuse
            try:
                proc = psutil.Process(pid)
            except psutil.Error:
                self._procs.pop(pid, None)
                return None
            self._procs[pid] = proc
        return proc

    def _process_families(self) -> list[tuple[Family, Samples]]:
        cpu: Samples = {}
        rss: Samples = {}
        fds: Samples = {}
        start: Samples = {}
        targets: list[tuple[Labels, int]] = [((("process", "supervisor"),), self._supervisor_pid)]
        targets += [
            ((("process", "worker"), ("worker", str(wid))), pid)
            for wid, pid in sorted(self._workers.items())
        ]
        psutil = _psutil()
        for labels, pid in targets:
            proc = self._process(pid)
            if proc is None:
                continue
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu[labels] = times.user + times.system
                    rss[labels] = proc.memory_info().rss
                    fds[labels] = proc.num_fds()
                    start[labels] = proc.create_time()
            except psutil.Error:
                continue  # rule 2
        live = set(self._workers.values()) | {self._supervisor_pid}
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]
        return [(PROCESS_CPU, cpu), (PROCESS_RSS, rss), (PROCESS_FDS, fds), (PROCESS_START, start)]

    def _node_families(self) -> list[tuple[Family, Samples]]:
        psutil = _psutil()
        times = psutil.cpu_times()
        modes = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
        cpu: Samples = {(("mode", m),): float(getattr(times, m, 0.0)) for m in modes}
        mem = psutil.virtual_memory()
        loads = os.getloadavg()
        out: list[tuple[Family, Samples]] = [
            (NODE_CPU, cpu),
            (NODE_CPUS, {(): float(psutil.cpu_count() or 1)}),
            (NODE_MEM_TOTAL, {(): float(mem.total)}),
            (NODE_MEM_AVAIL, {(): float(mem.available)}),
        ]
        out.extend((NODE_LOAD[n], {(): load}) for n, load in zip((1, 5, 15), loads, strict=True))
        return out


async def measure_loop_lag(
    report: Callable[[float], None],
    *,
    interval_s: float = 0.1,
    window_s: float = 1.0,
    busy: Callable[[], bool] | None = None,
) -> None:
    """Forever: sleep `interval_s`, measure how late the loop woke us, and call
    `report(max lag in seconds)` once per `window_s`. While `busy()` says False (a worker
    with no connection) it sleeps a whole window instead: an idle process is not woken
    ten times a second to learn that nothing kept it. Start with `agent.aio.spawn`;
    stops when cancelled.
    """
    loop = asyncio.get_running_loop()
    worst = 0.0
    window_start = loop.time()
    while True:
        nap = interval_s if busy is None or busy() else window_s
        before = time.monotonic()
        await asyncio.sleep(nap)
        lag = max(time.monotonic() - before - nap, 0.0)
        worst = max(worst, lag)
        if loop.time() - window_start >= window_s:
            report(worst)
            worst = 0.0
            window_start = loop.time()
