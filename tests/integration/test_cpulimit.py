"""A process in a cgroup with a CPU quota gets no more workers by default than the
quota is worth (agent.supervisor.cpulimit), read from the real kernel's cgroup files.
This machine's cpu controller is cgroup v1 (cfs_quota_us); v2's cpu.max is unit-tested."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

V1_CPU = Path("/sys/fs/cgroup/cpu")
PRINT = (
    "from agent.supervisor import cpulimit; "
    "print(cpulimit.cgroup_cpu_limit(), cpulimit.usable_cpus())"
)


pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(
        not (V1_CPU / "cpu.cfs_quota_us").exists(),
        reason="no cgroup v1 cpu controller here (cgroup v2's cpu.max is unit-tested)",
    ),
]


@pytest.fixture
def quota_cgroup():
    group = V1_CPU / f"meshagent-test-{secrets.token_hex(3)}"
    group.mkdir()
    try:
        yield group
    finally:
        group.rmdir()  # the child has exited: nothing is left in it


def _in(group: Path) -> tuple[str, int]:
    def enter() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    done = subprocess.run(
        [sys.executable, "-c", PRINT],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=enter,
        timeout=30,
    )
    limit, usable = done.stdout.split()
    return limit, int(usable)


def test_a_quota_of_one_cpu_means_one_worker(quota_cgroup):
    (quota_cgroup / "cpu.cfs_period_us").write_text("100000")
    (quota_cgroup / "cpu.cfs_quota_us").write_text("100000")
    assert _in(quota_cgroup) == ("1", 1)


def test_a_half_cpu_still_gets_a_worker_and_no_quota_leaves_the_affinity(quota_cgroup):
    (quota_cgroup / "cpu.cfs_period_us").write_text("100000")
    (quota_cgroup / "cpu.cfs_quota_us").write_text("50000")
    assert _in(quota_cgroup) == ("1", 1)
    (quota_cgroup / "cpu.cfs_quota_us").write_text("-1")
    assert _in(quota_cgroup) == ("None", len(os.sched_getaffinity(0)))
