"""One bench run: build the lab, run every chosen load against every chosen setup.

Rules:
1. Setups run one after another under the same loads and durations; a setup
   or load that fails becomes a row with `error` and the run carries on.
2. CPU seconds per row are the proxy processes' during that load
   (`Target.proxy_pids`), read exactly from each process's CPU clock (the
   scheduler's runtime: `cpu_seconds`), not from /proc's user + system, which
   are tick samples (250 Hz here) and biased for a lightly loaded process by
   when it wakes; the load generator and servers run in their pods and are
   not counted. `rss_mb` is the proxy processes' RSS after it; `steal_pct` the
   share of the machine's CPU time the hypervisor took during it
   (agent.bench.calibrate rule 4); `idle_pct` the share no task used, and
   `idle_pct_cpus` each CPU's (agent.bench.calibrate rule 5).
3. `memory-P` starts `meshagent run` for P meshed pods (cli, srv and idle
   pods on node `a`, each with a process) for each meshagent capture mode in
   the run and reads RSS and PSS of the supervisor and of its workers, apart
   and summed, once it is ready.
4. Everything the run creates is removed at the end, also on failure or
   Ctrl-C (the lab's records; eBPF pin roots; the work directory).
5. Rows of an accelerated setup (`meshagent-ebpf-accel`) carry `accel`: how
   much each sk_msg counter (`agent.redirect.maps.accel_stats`) rose during
   that load, so a run shows whether messages were redirected at all.
6. With `placement` "split" (the default) every setup runs with its nodes on
   their own CPUs (`agent.bench.topology` rule 5, over `setups.nodes_of` nodes);
   "shared" leaves placement to the scheduler. `machine.placement` says which.
7. Variants (`--variant NAME:KEY=VALUE[,KEY=VALUE]`, `Variant`): in every
   round each meshagent setup runs once as it is (`BASE`) and once per variant,
   with the variant's environment variables set while it starts its node
   agents (they inherit the bench's environment). What the agents got is read
   back from their /proc/PID/environ: a variant whose agents lack it is an
   error row, not a measurement. Base goes first in odd rounds and last in
   even ones, so no side always runs warm or late. Base rows are the run's
   rows; each variant's go to the document's `variants` (agent.bench.report
   rule 9), paired with base's round by round.
8. The setups that explain rather than judge (not in `QUICK_SETUPS`) run, when
   the loads were not named (`--loads`), only the loads they explain
   (`EXPLAIN_LOADS`): the saturation loads, where the floors and HAProxy's
   L7 peers are compared (agent.bench.report rules 5 and 8) and where the
   upgrade modes differ. That keeps the full run near 25 minutes (`FULL_DURATION_S`); named loads
   run on every named setup.
9. Where this process would load the current native build (`agent.native`)
   and `MESHAGENT_NATIVE` does not switch it off, a meshagent setup whose
   proxy workers did not load it (their /proc/PID/maps) is an error row, not
   a measurement: a variant that runs another checkout without
   `PYTHONSAFEPATH=1` imports this tree's sources against the other build,
   finds it stale and runs interpreted at 0.5-0.8x the rate (bench/README.md,
   bench/RESULTS.md thirty-fifth pass). Whether the build is current is read once,
   as the run starts (`Options.native_current`): a compiled module edited during a
   long run makes the build stale, and the agents started after that run
   interpreted; read at each setup, the check went quiet exactly then (thirty-sixth
   pass). The switch is read at each setup: `--profile` turns the build off for
   the agents it profiles (agent.bench.profile rule 4).
10. Side by side (`http1-side-N`, meshagent setups): while the setup's node agents
   run, its baseline and its HAProxy peers (`direct` and `haproxy-http` on one node;
   `direct-xnode`, `haproxy-tls` and its L7 peer, `haproxy-tls-h1` or `-h2`
   (agent.bench.report rule 8), across nodes) are started to the server's
   `SIDE_PORT`, which the mesh skips (`peers.side_peers`, agent.bench.topology rule
   6); sockmap's peers are `direct` and its own node agent's plain path
   (`meshagent-ebpf`, to `PLAIN_PORT`, which acceleration skips:
   `peers.accel_side_peers`, topology rule 7). One load generator sends N
   requests/s to them in turn (three, or four across nodes), 1 s each, a shuffled
   order per cycle (agent.bench.loadgen rule 5), each for the load's duration. The
   row is the setup's, with `side`: the peers' numbers from the same slices
   (agent.bench.report rule 10), and what the node agents counted meanwhile
   (`agent_requests` outbound, `agent_inbound_requests`), which equals what was
   sent on the mesh's paths (`sent`: the setup's, and sockmap's plain path) when
   the other peers bypassed the mesh, and the servers' ports they proxied to
   (`agent_target_ports`: `HTTP_PORT`, sockmap's `PLAIN_PORT`, and `IPERF_PORT`
   from the setup's readiness check, never a peer's port, whose TLS a count of
   requests would not show). Its CPU is not counted: the node agents idle
   through the peers' slices. `tcp-side-N` runs the same turns on sockmap's setup
   only (`tcp_side_by_side`), between the same three paths' echo ports
   (`ECHO_SIDE_PORT`, `ECHO_PLAIN_PORT`, `ECHO_PORT`: agent.bench.topology rule 8),
   with 64-byte opaque TCP requests echoed (`loads.tcp_side`). Those ports are
   opaque, so the node agents count no HTTP request (`agent_requests` stays 0) and
   relay TCP: the echo ports are in `agent_target_ports` and not in
   `agent_http_target_ports` (the ports of their `request_total`). `saturate-side`
   runs http1-saturate's wrk in turns (agent.bench.loads rule 3) between the setup
   and the saturation goal's peer only (`haproxy-http`, across nodes `haproxy-tls`),
   on the setups the saturation goals judge but sockmap's (whose side peers are its
   own plain path): the goals' ratio on the same minutes of the machine. The peer is
   the setup measured alone, started on the twin pods (agent.bench.topology rule 9)
   and loaded from its own client pod: in the meshed pods an iptables capture's
   connection tracking slowed it. wrk counts the requests answered within its turn,
   so `sent` may fall short of what the node agents counted by the requests in flight
   when a turn ended (64 at most per turn).
11. `--quick` runs no `saturate-side` (its goals take `http1-saturate` then), and the
   other side-by-side loads only on one node, where the goals judge
   them (added p99, sockmap: agent.bench.goals rules 1 and 3); across nodes they
   judge none and took 15 s of its run. Its memory is the goal's, at 100 pods.
   Named loads (`--loads`) run on every setup as ever.
12. A saturating load (`loads.SATURATING`) runs once unmeasured for the warm-up
   (`Options.warmup_s`, when at least 1 s) before its CPU and time are taken: its
   row is the setup's steady state. The first second after the node agents start
   opens every connection the load needs, an mTLS handshake each across nodes in
   HTTP/1 mode (`-h1-xnode`), and put a p99 of 20-130 ms on whichever saturating
   load ran first (bench/RESULTS.md, fifty-third pass). The constant-rate loads
   warm up in the load generator (`--warmup`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import platform
import re
import secrets
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import psutil

from agent import config, native
from agent.bench import (
    calibrate,
    callgrind,
    goals,
    interp,
    loads,
    peers,
    profile,
    report,
    setups,
)
from agent.bench.topology import log_tail, per_node, placed, twin
from agent.errors import AgentError
from agent.proxy import sched

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from agent.bench.setups import Target, Topology

logger = logging.getLogger(__name__)

_CPUCLOCK_SCHED = 2  # Linux's process CPU clock ids: (~pid << 3) | CPUCLOCK_SCHED

SIDE_PREFIX: Final = report.SIDE_PREFIX  # rule 10
TCP_SIDE_PREFIX: Final = report.TCP_SIDE_PREFIX  # rule 10, opaque TCP on sockmap's setup
SATURATE_SIDE: Final = report.SATURATE_SIDE  # rule 10, http1-saturate in turns
ALL_LOADS = (
    "http1-rr",
    "http1-rate-500",
    "http1-rate-1000",
    "http1-rate-2000",
    SIDE_PREFIX + "1000",
    SIDE_PREFIX + "2000",
    TCP_SIDE_PREFIX + "1000",
    TCP_SIDE_PREFIX + "2000",
    "http1-saturate",
    SATURATE_SIDE,
    "h2-saturate",
    "tcp-throughput",
    "tcp-reverse",
    "conn-rate",
)
NAMED_LOADS = ("http1-post-saturate",)  # run only when `--loads` names them
PLACEMENTS = ("split", "shared")
MEMORY_PODS = (1, 10, 50, 100)
QUICK_MEMORY_PODS = (100,)  # rule 11: the goal's
# Seconds per load. The full run's 8 s keep it near 25 minutes, under the 30 the
# issue allows (10 s took 26.5); `--duration` and `--repeat` buy precision where it counts.
FULL_DURATION_S = 8.0
QUICK_DURATION_S = 1.0
_NOT_QUICK = (
    "http1-rate-500",
    "http1-rr",
    "tcp-reverse",
    SIDE_PREFIX + "2000",
    TCP_SIDE_PREFIX + "2000",
    SATURATE_SIDE,
)
QUICK_LOADS = tuple(x for x in ALL_LOADS if x not in _NOT_QUICK)
# The setups the goals are judged on (the peers, our two capture modes on one and two
# nodes, sockmap); the rest (the Python floors, HAProxy's TLS variants, our upgrade
# modes) are for finding out why, in full runs or by name with --setups.
QUICK_SETUPS = (
    "direct",
    "haproxy-tcp",
    "haproxy-http",
    "meshagent-iptables",
    "meshagent-ebpf",
    "meshagent-ebpf-accel",
    "direct-xnode",
    "haproxy-tls",
    "meshagent-iptables-xnode",
    "meshagent-ebpf-xnode",
)
JUDGED_SETUPS = tuple(s for s in QUICK_SETUPS if s.startswith("meshagent-"))  # goals rule 1
_SATURATION = ("http1-saturate", "h2-saturate")
EXPLAIN_LOADS: Final = {  # rule 8
    "python-floor": _SATURATION,
    "python-floor-tls": _SATURATION,
    "haproxy-tls-h1": _SATURATION,
    "haproxy-tls-h2": _SATURATION,
    "meshagent-ebpf-h2-xnode": _SATURATION,
    "meshagent-ebpf-h1-xnode": _SATURATION,
}


BASE: Final = "base"  # rule 7: the agents as they are, with the bench's environment
_VARIANT_NAME: Final = re.compile(r"[a-z0-9][a-z0-9-]*")
_ENV_KEY: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Variant:
    """The node agents started with `env` set (rule 7)."""

    name: str
    env: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        """`NAME:KEY=VALUE[,KEY=VALUE...]`.

        Raises:
            ValueError: not of that form; the message quotes what was given.
        """
        name, sep, assigns = text.partition(":")
        if not sep or not _VARIANT_NAME.fullmatch(name) or name == BASE:
            raise ValueError(
                "--variant wants NAME:KEY=VALUE[,KEY=VALUE...], NAME of a-z, 0-9 and '-' "
                f"other than {BASE!r}; got {text!r}"
            )
        env = []
        for item in assigns.split(","):
            key, eq, value = item.partition("=")
            if not eq or not _ENV_KEY.fullmatch(key):
                raise ValueError(f"--variant {name}: {item!r} is not KEY=VALUE")
            env.append((key, value))
        return cls(name, tuple(env))


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What one run measures and for how long."""

    setups: tuple[str, ...] = tuple(setups.SETUPS)
    loads: tuple[str, ...] = ALL_LOADS
    memory_pods: tuple[int, ...] = MEMORY_PODS
    duration_s: float = FULL_DURATION_S
    warmup_s: float = 2.0
    workdir: Path | None = None
    profile_dir: Path | None = None  # `--profile`: workers' cProfile per setup (bench.profile)
    interp_dir: Path | None = None  # `--interp`: interpreted calls per setup (bench.interp)
    icount_dir: Path | None = None  # `--icount`: workers under callgrind (bench.callgrind)
    repeat: int = 1  # `--repeat`: rounds of every setup's loads, medians reported (report rule 6)
    placement: str = "split"  # `--placement`: each node on its own CPUs, or shared (rule 6)
    variants: tuple[Variant, ...] = ()  # `--variant`: the agents A/B'd against base (rule 7)
    loads_named: bool = False  # `--loads` given: every setup runs them all (rule 8)
    quick: bool = False  # `--quick`: side by side on one node only (rule 11)
    native_current: bool | None = None  # rule 9: the build, read as the run starts

    @classmethod
    def make(  # noqa: PLR0913 - one keyword per CLI option
        cls,
        *,
        quick: bool,
        setups_: str | None = None,
        loads_: str | None = None,
        duration_s: float | None = None,
        warmup_s: float | None = None,
        profile_dir: Path | None = None,
        interp_dir: Path | None = None,
        icount_dir: Path | None = None,
        repeat: int = 1,
        placement: str = "split",
        variants: Sequence[str] = (),
    ) -> Options:
        """Options from the CLI's values.

        Raises:
            ValueError: an unknown setup, load or placement name, fewer than one round,
                loads too short to count (`callgrind.MIN_DURATION_S`), or a malformed or
                repeated `--variant`.
        """
        if repeat < 1:
            raise ValueError(f"--repeat must be at least 1, got {repeat}")
        parsed = tuple(Variant.parse(v) for v in variants)
        names = [v.name for v in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"--variant names must differ, got {', '.join(names)}")
        if placement not in PLACEMENTS:
            raise ValueError(
                f"--placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
            )
        if icount_dir is not None:
            duration_s = duration_s or callgrind.DURATION_S
            if duration_s < callgrind.MIN_DURATION_S:
                why = f"--icount needs loads of at least {callgrind.MIN_DURATION_S:g}s"
                raise ValueError(f"{why}, got --duration {duration_s:g}")
        wanted_setups = _pick(setups_, tuple(setups.SETUPS), "setup") if setups_ else None
        all_loads = (*ALL_LOADS, *NAMED_LOADS, *(f"memory-{p}" for p in MEMORY_PODS), "memory")
        base_loads = QUICK_LOADS if quick else ALL_LOADS
        memory: tuple[int, ...] = QUICK_MEMORY_PODS if quick else MEMORY_PODS
        chosen = (*base_loads, "memory")
        if loads_:
            chosen = _pick(loads_, all_loads, "load", prefix=True)
        run_loads = tuple(x for x in chosen if not x.startswith("memory"))
        if "memory" not in chosen:
            memory = tuple(int(x.split("-")[1]) for x in chosen if x.startswith("memory-"))
        return cls(
            setups=wanted_setups or (QUICK_SETUPS if quick else tuple(setups.SETUPS)),
            loads=run_loads,
            memory_pods=memory,
            duration_s=duration_s or (QUICK_DURATION_S if quick else FULL_DURATION_S),
            warmup_s=warmup_s if warmup_s is not None else (0.3 if quick else 2.0),
            profile_dir=profile_dir,
            interp_dir=interp_dir,
            icount_dir=icount_dir,
            repeat=repeat,
            placement=placement,
            variants=parsed,
            loads_named=bool(loads_),
            quick=quick,
        )

    def runs(self, setup: str, load: str) -> bool:
        """Whether `setup` runs `load` in this run (rule 8; the setup may still not
        apply it, e.g. HTTP/2 to an HTTP/1-only peer)."""
        if self.loads_named:
            return True
        if self.quick and report.side_load(load) and report.cross_node(setup):
            return False  # rule 11
        return load in EXPLAIN_LOADS.get(setup, (load,))


def _pick(text: str, known: tuple[str, ...], what: str, *, prefix: bool = False) -> tuple[str, ...]:
    """Names from a comma list; with `prefix`, `http1-rate` picks every `http1-rate-N`.

    Raises:
        ValueError: a name matches nothing in `known`.
    """
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        matches = [k for k in known if k == item or (prefix and k.startswith(item + "-"))]
        if not matches:
            raise ValueError(f"unknown {what} {item!r}; known: {', '.join(known)}")
        out += [m for m in matches if m not in out]
    return tuple(out)


def cpu_seconds(pid: int) -> float | None:
    """On-CPU seconds of process `pid`, every thread's, exited ones included (rule 2): its
    POSIX process CPU clock (the scheduler's runtime, in ns), None once it is gone."""
    try:
        return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)  # clock_getcpuclockid(pid)
    except OSError:
        return None


@dataclass(slots=True)
class _Cpu:
    """CPU seconds of a set of processes between `start` and `stop`."""

    before: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def read(pids: list[int]) -> dict[int, float]:
        out = {}
        for pid in pids:
            seconds = cpu_seconds(pid)
            if seconds is not None:
                out[pid] = seconds
        return out

    def start(self, pids: list[int]) -> None:
        self.before = self.read(pids)

    def stop(self) -> float:
        after = self.read(list(self.before))
        return sum(after[p] - self.before[p] for p in after)


def memory_of(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) in MB summed over `pids`."""
    rss = pss = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            info = psutil.Process(pid).memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
    return round(rss / 2**20, 1), round(pss / 2**20, 1)


def machine(calibration: dict[str, Any], placement: str = "split") -> dict[str, Any]:
    """What the run ran on, with its `calibration` (agent.bench.calibrate rule 3) and
    its `placement` (rule 6)."""
    haproxy = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, check=False)
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "haproxy": haproxy.stdout.split("\n", 1)[0],
        "native": native.state(),  # the compiled request path (agent.native) or the sources
        # the agents' batched sends (agent.proxy.writes rule 6), as they inherit it
        "io_uring": os.environ.get(config.env_name("--io-uring"), "on"),
        # the workers' scheduler slice (agent.proxy.sched), as they inherit it
        "worker_slice": os.environ.get(config.env_name("--worker-slice"), sched.DEFAULT),
        "calibration": calibration,
        "placement": placement,
    }


def _rates(m: loads.Measured) -> dict[str, Any]:
    """What a load measured of requests: rate, latency, counts (a row's, a side's)."""
    return {
        "rps": round(m.rps, 1) if m.requests else None,
        "p50_ms": m.p50_ms,
        "p99_ms": m.p99_ms,
        "p999_ms": m.p999_ms,
        "requests": m.requests,
        "errors": m.errors,
        **({"error_kinds": dict(m.error_kinds)} if m.error_kinds else {}),
    }


def _row(
    target: Target, load: str, m: loads.Measured, cpu_s: float, warmed: int = 0
) -> dict[str, Any]:
    rss, _ = memory_of(target.proxy_pids())
    row: dict[str, Any] = {
        "setup": target.setup,
        "load": load,
        **_rates(m),
        "added_p99_ms": None,
        "gbps": round(m.gbps, 3) if m.bytes else None,
        "rss_mb": rss if target.roots else None,
        "cpu_s": round(cpu_s, 3) if target.roots else None,
        "cpu_s_per_req": None,
        "cpu_s_per_gb": None,
        "hops": target.hops,
        "mtls": target.mtls,
    }
    if target.roots and m.requests:
        row["cpu_s_per_req"] = cpu_s / m.requests
    if target.roots and m.bytes:
        row["cpu_s_per_gb"] = round(cpu_s / (m.bytes / 1e9), 3)
    if warmed:
        row["warmup_requests"] = warmed  # rule 12: made before the row's time and CPU
    return row


def _applicable(target: Target, load: str) -> str | None:
    """Why `load` cannot run on `target`, or None."""
    if load in ("tcp-throughput", "tcp-reverse") and not target.iperf_port:
        return "not a TCP proxy (HTTP mode): see haproxy-tcp"
    if load == "h2-saturate" and not target.h2:
        return "HTTP/1.1 only"
    if load.startswith(SIDE_PREFIX) and not side_by_side(target.setup):
        return "side by side: meshagent setups only (rule 10)"
    if load.startswith(TCP_SIDE_PREFIX) and not tcp_side_by_side(target.setup):
        return "opaque TCP side by side: sockmap's setup only (rule 10)"
    if load == SATURATE_SIDE and not saturate_side_by_side(target.setup):
        return "saturation side by side: meshagent setups but sockmap's (rule 10)"
    return None


def side_by_side(setup: str) -> bool:
    """Whether `setup` runs the `http1-side-N` loads (rule 10)."""
    return setup.startswith("meshagent-")


def tcp_side_by_side(setup: str) -> bool:
    """Whether `setup` runs the `tcp-side-N` loads (rule 10): sockmap's, beside its own
    plain path."""
    return setup == report.ACCEL_SETUP


def saturate_side_by_side(setup: str) -> bool:
    """Whether `setup` runs `saturate-side` (rule 10)."""
    return side_by_side(setup) and setup != report.ACCEL_SETUP


@contextlib.contextmanager
def _side_peers(topo: Topology, target: Target) -> Iterator[list[Target]]:
    """Rule 10's peers for `target`: sockmap's beside its own plain path, the rest
    beside HAProxy."""
    if target.setup == report.ACCEL_SETUP:
        with peers.accel_side_peers(topo, target, report.ACCEL_PEER) as others:
            yield others
        return
    cross = report.cross_node(target.setup)
    l7 = report.l7_peer_of(target.setup).removeprefix("haproxy-tls-") if cross else None
    with peers.side_peers(topo, cross=l7) as others:
        yield others


@contextlib.contextmanager
def _peers_beside(topo: Topology, target: Target, load: str) -> Iterator[list[Target]]:
    """Rule 10's peers for `load` on `target`: `saturate-side`'s one, the saturation goal's
    peer as measured alone, on the twin pods (agent.bench.topology rule 9); the other
    side-by-side loads' (`_side_peers`)."""
    if load != SATURATE_SIDE:
        with _side_peers(topo, target) as others:
            yield others
        return
    peer = peers.haproxy_tls if report.cross_node(target.setup) else peers.haproxy_one_hop("http")
    with peer(twin(topo)) as started:
        yield [started]


def _side_load(
    topo: Topology, target: Target, load: str, opts: Options
) -> tuple[loads.Measured, dict[str, Any]]:
    """Rule 10: the setup's `Measured`, and for its row its peers' numbers (`side`), the
    requests its node agents counted (`agent_requests`) and the load sent it (`sent`,
    with the warm-up's); `tcp-side-N` the same with echo (`loads.tcp_side`)."""
    with _peers_beside(topo, target, load) as others:
        before = _agents_counted(target, time.time())
        if load == SATURATE_SIDE:
            got = loads.saturate_side([*others, target], opts.duration_s, opts.warmup_s)
        else:
            tcp = load.startswith(TCP_SIDE_PREFIX)
            rate = int(load.removeprefix(TCP_SIDE_PREFIX if tcp else SIDE_PREFIX))
            run = loads.tcp_side if tcp else loads.http1_side
            got = run([*others, target], rate, opts.duration_s, opts.warmup_s)
        after = _agents_counted(target, time.time())
    mine = got[target.setup]
    side = {peer.setup: _side_rates(peer, got[peer.setup]) for peer in others}
    # the node agents count the mesh's paths' requests only: the setup's own and
    # sockmap's plain path; the other peers bypass them
    meshed = [got[p.setup] for p in [*others, target] if p.setup.startswith("meshagent-")]
    return mine, {
        "side": side,
        "agent_requests": after[0] - before[0],
        "agent_inbound_requests": after[1] - before[1],
        "sent": sum(m.requests + m.warmup_requests for m in meshed),
        # the servers' ports the node agents proxied to: SIDE_PORT (or HAProxy's TLS
        # listener) among them would say the mesh captured a peer; those they counted
        # HTTP requests to: an echo port among them would say it was not opaque
        "agent_target_ports": _agents_ports(target, "tcp_open_total"),
        "agent_http_target_ports": _agents_ports(target, "request_total"),
    }


def _side_rates(peer: Target, m: loads.Measured) -> dict[str, Any]:
    """A side peer's `_rates`; one that answered nothing carries the end of its
    processes' logs (`logs`): HAProxy says there why a connection ended abnormally."""
    rates = _rates(m)
    if not m.requests:
        said = "".join(log_tail(log) for log in peer.logs).removeprefix("; ")
        rates["logs"] = said or "(its logs are empty)"
    return rates


def _agents_ports(target: Target, family: str) -> list[int]:
    """The servers' ports in `family`'s series of `target`'s node agents (rule 10)."""
    return sorted(set().union(*(a.target_ports(family) for a in target.agents)))


def _agents_counted(target: Target, since: float) -> tuple[int, int]:
    """The requests `target`'s node agents counted, outbound and inbound, once every
    worker has reported a snapshot taken after `since` (Unix time): every request
    answered before then."""
    counts = [a.requests_settled(since) for a in target.agents]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def _one_load(target: Target, load: str, opts: Options) -> loads.Measured:
    d, w = opts.duration_s, opts.warmup_s
    if load.startswith("http1-rate-"):
        return loads.http1_rate(target, int(load.rsplit("-", 1)[1]), d, w)
    runners: dict[str, Callable[[], loads.Measured]] = {
        "http1-rr": lambda: loads.http1_rr(target, d, w),
        "http1-saturate": lambda: loads.http1_saturate(target, d),
        "http1-post-saturate": lambda: loads.http1_post_saturate(target, d),
        "h2-saturate": lambda: loads.h2_saturate(target, d),
        "tcp-throughput": lambda: loads.tcp_throughput(target, d),
        "tcp-reverse": lambda: loads.tcp_throughput(target, d, reverse=True),
        "conn-rate": lambda: loads.conn_rate(target, d, min(w, 0.5)),
    }
    return runners[load]()


def accel_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any]:
    """`{"accel": {counter: increase}}` over one load (rule 5), or nothing."""
    if before is None or after is None:
        return {}
    return {"accel": {k: after[k] - before.get(k, 0) for k in after}}


def _run_setup(  # noqa: PLR0913 - where the rows go and the variant's environment
    topo: Topology,
    name: str,
    opts: Options,
    rows: list[dict[str, Any]],
    notes: list[str],
    *,
    env: tuple[tuple[str, str], ...] = (),
) -> None:
    meshed = name.startswith("meshagent-")  # only meshagent setups have workers
    directory = opts.profile_dir / name if opts.profile_dir is not None and meshed else None
    counted = opts.interp_dir / name if opts.interp_dir is not None and meshed else None
    wrapped = opts.icount_dir / name if opts.icount_dir is not None and meshed else None
    with (
        profile.profiling(directory),
        interp.counting(counted),
        callgrind.counting(wrapped),
        profile.environment(dict(env)),
    ):
        _measure_setup(topo, name, opts, rows, icount_dir=wrapped, env=env)
    # The agents stopped: their workers wrote their files. Every round so far: the
    # directory holds the files of each round's workers.
    requests = sum(r.get("requests") or 0 for r in rows if r["setup"] == name)
    if wrapped is not None:
        why = "workers ran under callgrind; rates, latency and CPU compare with no other run"
        _note(notes, f"icount of {name}: ", f"{why} (dumps in {wrapped})")
    if directory is not None:
        summary = profile.summarize(directory, requests)
        _note(notes, f"profile of {name}: ", str(summary or "no worker stats written"))
    if counted is not None:
        got = interp.summarize(counted, requests)
        text = "no worker counts written"
        if got is not None:
            text = f"{got[1].per_request():.3f} per request ({got[0]})"
        _note(notes, f"interpreted calls of {name}: ", text)


def missing_env(pids: list[int], env: tuple[tuple[str, str], ...]) -> list[str]:
    """`KEY=VALUE`s of `env` that some process of `pids` does not have (rule 7)."""
    want = [f"{k}={v}".encode() for k, v in env]
    missing: list[str] = []
    for pid in pids:
        try:
            have = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue  # gone: its CPU is not counted either
        missing += [w.decode() for w in want if w not in have and w.decode() not in missing]
    return missing


def _native_expected(opts: Options) -> bool:
    """Rule 9: whether the agents started now should load the native build: it was current
    as the run started (`run` records it), and the switch does not turn it off now."""
    return bool(opts.native_current) and os.environ.get(native.ENV) != "0"


def interpreted_workers(pids: list[int]) -> list[int]:
    """The proxy workers among `pids` that have not loaded the native build (rule 9)."""
    library = f"{native.GROUP}__mypyc".encode()
    found: list[int] = []
    for pid in pids:
        try:
            if b"agent.proxy.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if library not in Path(f"/proc/{pid}/maps").read_bytes():
                found.append(pid)
        except OSError:
            continue  # gone: its CPU is not counted either
    return found


def interpreted_error(opts: Options, pids: list[int]) -> str:
    """Rule 9's error for a setup whose workers among `pids` run interpreted where the
    build was current as the run started and is not switched off ("" when none do, or
    they should not load it, or `run` has not read the build yet)."""
    slow = interpreted_workers(pids) if _native_expected(opts) else []
    if not slow:
        return ""
    return (
        f"the node agents' workers {slow} run interpreted, not the native build"
        " (a variant running another checkout needs PYTHONSAFEPATH=1; a compiled"
        " module edited since the run started makes the build stale)"
    )


def _note(notes: list[str], tag: str, text: str) -> None:
    """Replace the note that starts with `tag` (an earlier round's) with `tag + text`."""
    notes[:] = [n for n in notes if not n.startswith(tag)]
    notes.append(tag + text)


def _measure_setup(  # noqa: PLR0913 - the run's facts, then what it runs under
    topo: Topology,
    name: str,
    opts: Options,
    rows: list[dict[str, Any]],
    *,
    icount_dir: Path | None = None,
    env: tuple[tuple[str, str], ...] = (),
) -> None:
    place = opts.placement == "split"
    try:
        with (
            placed(topo, setups.nodes_of(name)) if place else contextlib.nullcontext(),
            setups.SETUPS[name](topo) as target,
        ):
            missing = missing_env(target.proxy_pids(), env)
            if missing:
                why = f"the variant's environment did not reach the node agents: {missing}"
                rows.append({"setup": name, "load": "*", "error": why})
                return
            why = interpreted_error(opts, target.proxy_pids())
            if why:
                rows.append({"setup": name, "load": "*", "error": why})
                return
            for load in opts.loads:
                if not opts.runs(name, load) or _applicable(target, load):
                    continue
                warmed = _warm_up_load(target, load, opts, rows)
                if warmed is None:
                    continue
                cpu = _Cpu()
                cpu.start(target.proxy_pids())
                accel_before = target.accel_counts()
                ticks = calibrate.cpu_times()
                idle = calibrate.idle_times()
                try:
                    m, counts, extra = _measure(topo, target, load, opts, icount_dir)
                except AgentError as exc:
                    rows.append({"setup": name, "load": load, "error": str(exc)[:300]})
                    continue
                rows.append(_row(target, load, m, cpu.stop(), warmed))
                if extra:  # rule 10: the agent idled through the peers' slices
                    rows[-1].update(extra, cpu_s=None, cpu_s_per_req=None)
                if counts:
                    rows[-1]["ir_per_request"] = counts["ir_per_request"]
                    rows[-1]["icount"] = counts["workers"]
                rows[-1]["steal_pct"] = calibrate.steal_pct(ticks, calibrate.cpu_times())
                rows[-1].update(_idle_fields(calibrate.idle_pct(idle, calibrate.idle_times())))
                rows[-1].update(accel_delta(accel_before, target.accel_counts()))
                logger.info("measured", extra={"setup": name, "load": load, "rps": rows[-1]["rps"]})
    except AgentError as exc:
        rows.append({"setup": name, "load": "*", "error": str(exc)[:300]})


def _warm_up_load(
    target: Target, load: str, opts: Options, rows: list[dict[str, Any]]
) -> int | None:
    """Run a saturating `load` once, unmeasured, before it is measured (rule 12): the
    requests it made (0: no warm-up run); None, with an error row, when it failed."""
    if load not in loads.SATURATING or opts.warmup_s < 1:
        return 0
    warm = dataclasses.replace(opts, duration_s=opts.warmup_s)
    try:
        return _one_load(target, load, warm).requests
    except AgentError as exc:
        rows.append({"setup": target.setup, "load": load, "error": str(exc)[:300]})
        return None


def _measure(
    topo: Topology, target: Target, load: str, opts: Options, icount_dir: Path | None
) -> tuple[loads.Measured, dict[str, Any], dict[str, Any]]:
    """One load on `target`: what it measured, the workers' instruction counts (under
    `--icount`) and the side-by-side fields of its row (rule 10), the last two `{}`
    when not taken."""
    if report.side_load(load):
        m, extra = _side_load(topo, target, load, opts)
        return m, {}, extra
    if icount_dir is None:
        return _one_load(target, load, opts), {}, {}
    m, counts = callgrind.during(
        lambda: _one_load(target, load, opts), opts.duration_s, target.agents, icount_dir
    )
    return m, counts, {}


def _idle_fields(pct: list[float] | None) -> dict[str, Any]:
    """A row's `idle_pct` (the machine) and `idle_pct_cpus` (each CPU) (rule 2)."""
    if not pct:
        return {"idle_pct": None, "idle_pct_cpus": None}
    return {"idle_pct": pct[0], "idle_pct_cpus": pct[1:]}


def _idle_pods(topo: Topology, need: int) -> list[str]:
    """Roles of `need` meshable pods on node `a`: cli, srv, then idle pods made now
    (each with a sleeping process, so the agent discovers it)."""
    from agent.bench.mesh import BenchPod, make_pod  # noqa: PLC0415

    roles = ["cli", "srv"]
    new = []
    for k in range(len(roles), need):
        role = f"idle{k}"
        lp = make_pod(topo.lab, topo.a, role)
        lp.spawn(["sleep", "86400"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        new.append(BenchPod(role=role, node=topo.a.name, ip=lp.ip))
        roles.append(role)
    if new:
        topo.mesh.add(new)
        time.sleep(1.0)  # the control plane polls its folder
    return roles[:need]


def _memory(topo: Topology, opts: Options, rows: list[dict[str, Any]]) -> None:
    modes = [
        m for m in ("iptables", "ebpf") if any(s.startswith(f"meshagent-{m}") for s in opts.setups)
    ]
    if not modes or not opts.memory_pods:
        return
    roles = _idle_pods(topo, max(opts.memory_pods))
    for mode in modes:
        for count in opts.memory_pods:
            load = f"memory-{count}"
            try:
                agent = setups.start_node_agent(
                    topo, roles[:count], mode, node=topo.a.name, name=f"{mode}-mem"
                )
            except AgentError as exc:
                rows.append({"setup": f"meshagent-{mode}", "load": load, "error": str(exc)[:300]})
                continue
            try:
                time.sleep(1.0)
                workers = agent.worker_pids()
                sup_rss, sup_pss = memory_of([agent.pid])
                w_rss, w_pss = memory_of(workers)
            finally:
                agent.stop()
            rows.append(
                {
                    "setup": f"meshagent-{mode}",
                    "load": load,
                    "rss_mb": round(sup_rss + w_rss, 1),
                    "pss_mb": round(sup_pss + w_pss, 1),
                    "supervisor_rss_mb": sup_rss,
                    "supervisor_pss_mb": sup_pss,
                    "workers_rss_mb": w_rss,
                    "workers_pss_mb": w_pss,
                    "processes": 1 + len(workers),
                }
            )


def _warm_up(topo: Topology) -> None:
    """One discarded second of load: the first measured run must not pay for cold caches."""
    with setups.direct(topo) as target, contextlib.suppress(AgentError):
        loads.http1_rate(target, 1000, 1.0, 0.0)


def run(opts: Options, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the bench; the JSON document (`agent.bench.report.document`).

    Raises:
        LabError, BenchError: the topology could not be built.
    """
    from agent.netlab import Lab  # noqa: PLC0415 - pyroute2 is heavy

    say = progress or (lambda _msg: None)
    if opts.native_current is None:
        opts = dataclasses.replace(opts, native_current=native.state() == "active")
    interpreted = native_notes(opts, native.state())
    for note in interpreted:
        say("warning: " + note)
    Lab.cleanup_stale()
    workdir = setups.new_workdir(opts.workdir)
    rows: list[dict[str, Any]] = []
    by_variant: dict[str, list[dict[str, Any]]] = {v.name: [] for v in opts.variants}
    notes: list[str] = []
    started = time.monotonic()
    calibration = {"start": calibrate.measure()}
    try:
        with Lab("mab" + secrets.token_hex(2)) as lab:
            say("building the lab: nodes a, b; pods cli, srv (a), srv2 (b)")
            topo = setups.build_topology(lab, workdir, twins=SATURATE_SIDE in opts.loads)
            try:
                _warm_up(topo)
                for rnd in range(1, opts.repeat + 1):
                    for name in opts.setups:
                        for variant in variant_order(name, opts.variants, rnd):
                            say(
                                f"setup {name}"
                                + (f" [{variant.name}]" if opts.variants else "")
                                + (f" (round {rnd})" if opts.repeat > 1 else "")
                            )
                            got = rows if variant.name == BASE else by_variant[variant.name]
                            _run_setup(topo, name, opts, got, notes, env=variant.env)
                if opts.memory_pods:
                    say(f"memory with {', '.join(map(str, opts.memory_pods))} meshed pods")
                    _memory(topo, opts, rows)
            finally:
                topo.mesh.stop()
    finally:
        setups.remove_workdir(workdir)
    calibration["end"] = calibrate.measure()
    took = f"run took {time.monotonic() - started:.0f}s; {opts.duration_s}s per load"
    if opts.repeat > 1:
        took += f"; {opts.repeat} rounds, medians reported"
    notes.append(took)
    notes.append(calibrate.describe(calibration["start"], calibration["end"]))
    notes += _not_yet_notes(opts)
    notes += interpreted
    doc_machine = machine(calibration, opts.placement)
    doc = report.document(doc_machine, report.combine(rows), notes, measured=rows)
    doc["goals"] = goals.judge(doc, JUDGED_SETUPS)
    doc["goals_caveat"] = goals.caveat(opts.duration_s)
    if opts.variants:
        envs = {v.name: dict(v.env) for v in opts.variants}
        doc["variants"] = report.variants(rows, by_variant, envs)
    return doc


def variant_order(name: str, variants: tuple[Variant, ...], rnd: int) -> list[Variant]:
    """Who runs setup `name` in round `rnd`, in order (rule 7): base alone unless the
    setup starts node agents and there are variants."""
    base = Variant(BASE, ())
    if not variants or not name.startswith("meshagent-"):
        return [base]
    order = [base, *variants]
    return order if rnd % 2 else order[::-1]


_NATIVE_SAYS: Final = {
    "stale": "is older than its sources (a compiled module was edited since it was built)",
    "absent": "was never built",
    "off": f"is switched off ({native.ENV}=0)",
}


def native_notes(opts: Options, state: native.State) -> list[str]:
    """A warning when the node agents would run interpreted: a meshagent setup's
    numbers are then not comparable with a compiled run's (`machine.native`)."""
    if state == "active" or not _runs_agents(opts):
        return []
    note = (
        f"the node agents ran interpreted: the compiled request path (agent.native) "
        f"{_NATIVE_SAYS[state]}; meshagent rows are not comparable with a compiled run's "
        f"(`python -m agent.native build` makes it current)"
    )
    return [note]


def _runs_agents(opts: Options) -> bool:
    """Whether any setup of the run starts node agents."""
    return any(s.startswith("meshagent-") for s in opts.setups)


def _not_yet_notes(opts: Options) -> list[str]:
    if not _runs_agents(opts):
        return []
    return [
        (
            "meshagent setups run the real node agent (`meshagent run`, HTTP-aware proxy, "
            "policy, metrics) against a `meshagent controlplane` on 127.0.0.1; same-node: "
            "outbound -> inbound without TLS; -xnode: outbound -> mTLS -> inbound on the "
            f"other node; workers per node (and HAProxy threads, floor processes): "
            f"{per_node(1)} on one node, {per_node(2)} on two (the machine's CPUs per node); "
            "agent workers placed by the kernel, connections spread over them by hash "
            "(`--cpu-placement off`, the default)"
        ),
    ]
