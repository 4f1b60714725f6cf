"""How many CPUs this process may use: its affinity, and its cgroup's CPU limit.

A container's CPU limit (Kubernetes `resources.limits.cpu`) is a CFS quota on its
cgroup, not an affinity: a DaemonSet limited to 2 CPUs on a 64-CPU node sees 64 CPUs
in `sched_getaffinity`, and one worker per CPU would start 64 workers (about 33 MB of
RSS each) to share 2 CPUs' time. `meshagent run`'s default `--workers` is therefore
the smaller of the two (`usable_cpus`).

Rules:
1. The limit is the smallest quota / period along the process's cgroup path, its own
   cgroup and each ancestor's (a parent's limit bounds its children's), rounded up:
   1.5 CPUs of time is worth 2 workers. No quota anywhere is no limit.
2. cgroup v2 reads `cpu.max` ("max 100000" or "150000 100000") under the unified
   mount; cgroup v1 reads `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`
   under the hierarchy that has the `cpu` controller. A hybrid host (v1 cpu, v2
   unified without it) answers from v1. What cannot be read is no limit: the
   affinity stands.
3. Parsing (`parse_cpu_max`, `parse_proc_cgroup`, `limit_of`) is pure; `limit_in` reads
   the files under a root it is given.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

CGROUP_ROOT = Path("/sys/fs/cgroup")
Quota = tuple[int | None, int]  # (quota in us, None for none; period in us)


def parse_cpu_max(text: str) -> Quota:
    """cgroup v2 `cpu.max`: `max 100000` -> (None, 100000); `150000 100000` -> (150000,
    100000).

    Raises:
        ValueError: not of that form.
    """
    fields = text.split()
    if len(fields) != 2:  # quota and period
        raise ValueError(f"cpu.max is not 'QUOTA PERIOD': {text!r}")
    quota = None if fields[0] == "max" else int(fields[0])
    return quota, int(fields[1])


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/PID/cgroup -> {controller: path}; the v2 (unified) path under ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:  # id:controllers:path
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            out.setdefault(controller, path)
    return out


def limit_of(quotas: Iterable[Quota]) -> int | None:
    """Rule 1: the CPUs the tightest quota is worth, rounded up; None: no quota."""
    worth = [q / p for q, p in quotas if q is not None and q > 0 and p > 0]
    return max(1, math.ceil(min(worth))) if worth else None


def _ancestry(base: Path, path: str) -> list[Path]:
    """`base/path` and each of its ancestors down to `base`."""
    here = base / path.strip("/")
    out = [here]
    while here != base:
        here = here.parent
        out.append(here)
    return out


def _quotas_v1(base: Path, path: str) -> list[Quota]:
    out: list[Quota] = []
    for d in _ancestry(base, path):
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        out.append((None if quota < 0 else quota, period))
    return out


def _quotas_v2(base: Path, path: str) -> list[Quota]:
    out: list[Quota] = []
    for d in _ancestry(base, path):
        try:
            out.append(parse_cpu_max((d / "cpu.max").read_text()))
        except (OSError, ValueError):
            continue
    return out


def limit_in(paths: dict[str, str], root: Path = CGROUP_ROOT) -> int | None:
    """Rule 2: the CPU limit of the cgroups `paths` (`parse_proc_cgroup`) name, read
    under `root`; None when there is none."""
    if "cpu" in paths:  # v1, or a hybrid host whose cpu controller is v1
        v1 = next((root / d for d in ("cpu", "cpu,cpuacct") if (root / d).is_dir()), None)
        return limit_of(_quotas_v1(v1, paths["cpu"])) if v1 is not None else None
    if "" in paths:
        unified = root / "unified" if (root / "unified" / "cgroup.procs").exists() else root
        return limit_of(_quotas_v2(unified, paths[""]))
    return None


def cgroup_cpu_limit() -> int | None:
    """This process's cgroup CPU limit, None when it has none (or it cannot be read)."""
    try:
        paths = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    return limit_in(paths)


def usable_cpus() -> int:
    """CPUs this process may run on, bounded by its cgroup's CPU limit."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit is not None else cpus
