"""How far a side-by-side quotient moves when nothing differs: the yardstick's own noise.

`python -m agent.bench.sidenoise [--runs N] [--duration S] [--rate R] [-o json]`
builds the bench's lab, starts the side-by-side peers (`peers.side_peers`: direct and
HAProxy to srv's `SIDE_PORT`) and runs N side-by-side loads (agent.bench.loadgen
rule 5) over four paths: `direct`, `haproxy-http`, and each again on its own
connections (`direct2`, `haproxy2`). Per run it prints HAProxy's added p99 over
direct on both copies and their quotient: what `added_p99:X/haproxy-http@http1-side-R`
would read if X were HAProxy itself. A goal judged on that quotient can be judged no
finer than these spread.

Rules:
1. Everything it creates is removed at the end, also on failure or Ctrl-C (the
   lab's records, the work directory).
2. `quotients` is pure: one run's `Measured` by path in, its numbers out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import statistics
import sys
from typing import TYPE_CHECKING, Any

from agent.bench import loads, peers, report, setups
from agent.bench.topology import placed

if TYPE_CHECKING:
    from collections.abc import Mapping

PATHS = ("direct", "haproxy-http", "direct2", "haproxy2")


def quotients(got: Mapping[str, loads.Measured]) -> dict[str, Any]:
    """One run: each path's p50 and p99 (ms), HAProxy's added p99 over direct for each
    copy, and the first copy's over the second's (None when the second added nothing)."""
    p99 = {name: got[name].p99_ms for name in PATHS}
    out: dict[str, Any] = {
        "p50_ms": {name: got[name].p50_ms for name in PATHS},
        "p99_ms": p99,
        "errors": sum(got[name].errors for name in PATHS),
    }
    first, second = (
        report.added_ms(p99[proxy], p99[base])
        for proxy, base in (("haproxy-http", "direct"), ("haproxy2", "direct2"))
    )
    out["added_p99_ms"] = [first, second]
    out["quotient"] = report.added_ratio(first, second)  # as the bench's ratios (rule 2)
    return out


def measure(*, runs: int, duration: float, rate: int, warmup: float) -> list[dict[str, Any]]:
    """`runs` side-by-side loads of the four paths in a fresh lab (rule 1).

    Raises:
        LabError, BenchError, LoadError: the lab, a peer or a load failed.
    """
    from agent.netlab import Lab  # noqa: PLC0415 - pyroute2 is heavy

    Lab.cleanup_stale()
    workdir = setups.new_workdir()
    out: list[dict[str, Any]] = []
    try:
        with Lab("mas" + secrets.token_hex(2)) as lab:
            topo = setups.build_topology(lab, workdir, twins=False)
            try:
                with placed(topo, 1), peers.side_peers(topo, cross=None) as (direct, proxy):
                    targets = [
                        direct,
                        proxy,
                        dataclasses.replace(direct, setup="direct2"),
                        dataclasses.replace(proxy, setup="haproxy2"),
                    ]
                    out.extend(
                        quotients(loads.http1_side(targets, rate, duration, warmup))
                        for _ in range(runs)
                    )
            finally:
                topo.mesh.stop()
    finally:
        setups.remove_workdir(workdir)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.bench.sidenoise")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per path and run")
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = p.parse_args(argv)
    if args.runs < 1 or args.duration <= 0:
        p.error(f"--runs and --duration must be positive, got {args.runs} and {args.duration}")
    got = measure(runs=args.runs, duration=args.duration, rate=args.rate, warmup=args.warmup)
    if args.output == "json":
        sys.stdout.write(json.dumps(got) + "\n")
        return 0
    for run in got:
        p99 = " ".join(f"{name} {run['p99_ms'][name]}" for name in PATHS)
        sys.stdout.write(f"p99 ms: {p99}; added {run['added_p99_ms']}: {run['quotient']}\n")
    qs = [run["quotient"] for run in got if run["quotient"] is not None]
    if qs:
        sys.stdout.write(
            f"haproxy over haproxy, added p99 at {args.rate}/s, {args.duration:g} s: "
            f"{min(qs)}-{max(qs)}, median {statistics.median(qs)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
