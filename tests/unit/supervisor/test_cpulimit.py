"""agent.supervisor.cpulimit: the CPU limit of a cgroup, read as the kernel writes it."""

from __future__ import annotations

import pytest

from agent.supervisor import cpulimit


def test_cpu_max_reads_a_quota_or_none():
    assert cpulimit.parse_cpu_max("max 100000\n") == (None, 100000)
    assert cpulimit.parse_cpu_max("150000 100000\n") == (150000, 100000)
    with pytest.raises(ValueError, match="QUOTA PERIOD"):
        cpulimit.parse_cpu_max("150000")


def test_proc_cgroup_maps_each_controller_and_the_unified_path():
    text = "9:name=systemd:/\n2:cpu,cpuacct:/kubepods/pod1/c1\n1:cpuset:/\n0::/kubepods/pod1/c1\n"
    paths = cpulimit.parse_proc_cgroup(text)
    assert paths["cpu"] == paths["cpuacct"] == "/kubepods/pod1/c1"
    assert paths[""] == "/kubepods/pod1/c1"
    assert cpulimit.parse_proc_cgroup("0::/\n") == {"": "/"}


def test_the_tightest_quota_counts_rounded_up():
    assert cpulimit.limit_of([(None, 100000)]) is None
    assert cpulimit.limit_of([]) is None
    assert cpulimit.limit_of([(150000, 100000), (None, 100000)]) == 2
    assert cpulimit.limit_of([(400000, 100000), (100000, 100000)]) == 1  # a parent's bounds
    assert cpulimit.limit_of([(10000, 100000)]) == 1  # a tenth of a CPU still runs a worker


def test_a_v2_limit_is_read_up_the_hierarchy(tmp_path):
    """A cgroup v2 tree as files (this machine's cpu controller is v1): the container's
    own cgroup has no limit, its pod's has 2.5 CPUs."""
    pod = tmp_path / "kubepods" / "pod1"
    (pod / "c1").mkdir(parents=True)
    (tmp_path / "cgroup.procs").write_text("")
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("250000 100000\n")
    (pod / "c1" / "cpu.max").write_text("max 100000\n")
    paths = cpulimit.parse_proc_cgroup("0::/kubepods/pod1/c1\n")
    assert cpulimit.limit_in(paths, tmp_path) == 3
    assert cpulimit.limit_in(cpulimit.parse_proc_cgroup("0::/\n"), tmp_path) is None
