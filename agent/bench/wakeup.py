"""What a wake-up costs on this machine: a one-byte round trip between two processes
on one CPU, and across two.

`python -m agent.bench.wakeup [--rounds N] [-o json]` prints the medians and p99s of
four cases: both processes on the first CPU or on two CPUs, back to back (closed
loop) or with `GAP_S` between round trips (each wake then finds its CPU idle). It
says how much of a proxy's added latency is where its workers run
(agent.proxy.placement rule 4): on the bench's 2-vCPU VM, 4.5 us on one CPU against
66 us across two back to back, 7.6 against 107 us 2 ms apart: waking an idle vCPU
goes through the host.

Rules:
1. The echo side is a child process (`os.fork` before any thread starts here), the
   pair a socketpair; each side pins itself with `sched_setaffinity`.
2. Needs two CPUs for the cross-CPU cases; with one, those are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

GAP_S = 0.002
ROUNDS = 5000
GAP_ROUNDS = 500


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    p50_us: float
    p99_us: float
    rounds: int


def round_trips(here: int, there: int, rounds: int, gap_s: float = 0.0) -> list[float]:
    """`rounds` one-byte round trips (us) between this process on CPU `here` and a child
    echoing on CPU `there`. Leaves this process on `here`; the caller restores it."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo side: exits when the pair closes
        mine.close()
        try:
            os.sched_setaffinity(0, {there})
            while data := theirs.recv(64):
                theirs.send(data)
        finally:
            os._exit(0)
    theirs.close()
    took: list[float] = []
    try:
        os.sched_setaffinity(0, {here})
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            mine.send(b"x")
            mine.recv(64)
            took.append((time.perf_counter_ns() - t0) / 1000)
            if gap_s:
                time.sleep(gap_s)
    finally:
        mine.close()
        os.waitpid(pid, 0)
    return took


def _case(name: str, took: list[float]) -> Case:
    ordered = sorted(took)
    return Case(
        name=name,
        p50_us=round(statistics.median(ordered), 1),
        p99_us=round(ordered[int(len(ordered) * 0.99)], 1),
        rounds=len(ordered),
    )


def measure(rounds: int = ROUNDS, gap_rounds: int = GAP_ROUNDS) -> list[Case]:
    """The four cases (rule 2: two without a second CPU)."""
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    pairs = [("one CPU", cpus[0], cpus[0])]
    if len(cpus) > 1:
        pairs.append(("two CPUs", cpus[0], cpus[1]))
    out = []
    try:
        for name, here, there in pairs:
            out.append(_case(f"{name}, back to back", round_trips(here, there, rounds)))
            took = round_trips(here, there, gap_rounds, GAP_S)
            out.append(_case(f"{name}, {GAP_S * 1000:g} ms apart", took))
    finally:
        os.sched_setaffinity(0, allowed)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.bench.wakeup", description=__doc__)
    p.add_argument("--rounds", type=int, default=ROUNDS, help="back-to-back round trips")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    args = p.parse_args(argv)
    if args.rounds < 100:
        p.error(f"--rounds: at least 100, got {args.rounds}")
    cases = measure(args.rounds, max(100, args.rounds // 10))
    if args.output == "json":
        sys.stdout.write(json.dumps([asdict(c) for c in cases]) + "\n")
    else:
        for c in cases:
            sys.stdout.write(f"{c.name:<28} p50 {c.p50_us:>8.1f} us   p99 {c.p99_us:>8.1f} us\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
