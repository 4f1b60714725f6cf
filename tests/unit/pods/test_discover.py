"""`agent.pods.discover` pure parts: /proc/PID/cgroup text and the pod-UID convention."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from agent.pods.discover import (
    CgroupLine,
    _parse_addresses,
    cgroup2_mount,
    names_pod,
    parse_cgroup,
    pod_cgroup_path,
    scan_proc,
    uid_in_path,
)

UID = "6d0f4c1e-2b7a-4f44-9d3e-0a1b2c3d4e5f"

# Recorded from kubelet nodes (container ids shortened).
CGROUPFS_V1 = f"""\
12:pids:/kubepods/besteffort/pod{UID}/0123abcd
11:memory:/kubepods/besteffort/pod{UID}/0123abcd
1:name=systemd:/kubepods/besteffort/pod{UID}/0123abcd
0::/
"""
SYSTEMD_V2 = (
    "0::/kubepods.slice/kubepods-burstable.slice/"
    f"kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-0123abcd.scope\n"
)
NETLAB = f"9:name=systemd:/\n4:memory:/\n0::/meshagent/t1a2b3c-pod{UID}\n"
HOST = "0::/system.slice/ssh.service\n"


def test_parse_cgroup_reads_hierarchy_controllers_and_path() -> None:
    lines = parse_cgroup(CGROUPFS_V1)
    assert lines[0] == CgroupLine(
        hierarchy=12, controllers="pids", path=f"/kubepods/besteffort/pod{UID}/0123abcd"
    )
    assert lines[-1].unified
    assert not lines[0].unified


def test_parse_cgroup_skips_malformed_lines() -> None:
    assert parse_cgroup("garbage\nx:y:z\n0::/ok\n") == [
        CgroupLine(hierarchy=0, controllers="", path="/ok")
    ]


def test_cgroupfs_driver_path_names_the_pod() -> None:
    assert names_pod(parse_cgroup(CGROUPFS_V1), UID)
    assert pod_cgroup_path(parse_cgroup(CGROUPFS_V1), UID) is None  # the v2 line is "/"


def test_systemd_driver_path_with_underscores_names_the_pod() -> None:
    lines = parse_cgroup(SYSTEMD_V2)
    assert names_pod(lines, UID)
    assert pod_cgroup_path(lines, UID) == lines[0].path


def test_netlab_pod_cgroup_names_the_pod() -> None:
    assert pod_cgroup_path(parse_cgroup(NETLAB), UID) == f"/meshagent/t1a2b3c-pod{UID}"


def test_another_pod_or_a_host_process_does_not_match() -> None:
    other = "6d0f4c1e-2b7a-4f44-9d3e-0a1b2c3d4e50"
    assert not names_pod(parse_cgroup(CGROUPFS_V1), other)
    assert not names_pod(parse_cgroup(HOST), UID)


def test_uid_must_be_a_whole_component_part() -> None:
    assert not uid_in_path(f"/kubepods/xpod{UID}", UID)
    assert not uid_in_path(f"/kubepods/pod{UID}0", UID)
    assert uid_in_path(f"/kubepods/POD{UID.upper()}", UID)
    assert not uid_in_path("/kubepods/pod", "")


def test_scan_proc_finds_processes_per_uid(tmp_path: Path) -> None:
    for pid, text in ((10, CGROUPFS_V1), (11, HOST), (12, SYSTEMD_V2)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    (tmp_path / "self").mkdir()
    found = scan_proc([UID, "nope"], tmp_path)
    assert sorted(c.pid for c in found[UID]) == [10, 12]
    assert found["nope"] == []


def test_scan_proc_gives_each_of_many_pods_only_its_own_processes(tmp_path: Path) -> None:
    uids = [f"{n:08x}-2b7a-4f44-9d3e-0a1b2c3d4e5f" for n in range(60)]
    for n, uid in enumerate(uids):  # systemd spelling for the even ones, cgroupfs for the odd
        spelled = uid.replace("-", "_") if n % 2 == 0 else uid
        (tmp_path / str(100 + n)).mkdir()
        (tmp_path / str(100 + n) / "cgroup").write_text(f"0::/kubepods-pod{spelled}.slice/c\n")
    found = scan_proc(uids, tmp_path)
    assert {uid: [c.pid for c in found[uid]] for uid in uids} == {
        uid: [100 + n] for n, uid in enumerate(uids)
    }


def test_cgroup2_mount_from_proc_mounts() -> None:
    mounts = (
        "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
    )
    assert cgroup2_mount(mounts) == Path("/sys/fs/cgroup/unified")
    assert cgroup2_mount("tmpfs /tmp tmpfs rw 0 0\n") is None


def _nlmsg(kind: int, body: bytes) -> bytes:
    msg = struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body
    return msg + b"\0" * (-len(msg) % 4)


def _newaddr(family: int, *attrs: tuple[int, bytes]) -> bytes:
    body = struct.pack("=BBBBI", family, 24, 0, 0, 2)
    for kind, value in attrs:
        attr = struct.pack("=HH", 4 + len(value), kind) + value
        body += attr + b"\0" * (-len(attr) % 4)
    return _nlmsg(20, body)


def test_parse_addresses_reads_v4_and_v6_address_attributes_until_done() -> None:
    v4 = socket.inet_pton(socket.AF_INET, "10.1.2.3")
    v6 = socket.inet_pton(socket.AF_INET6, "fd00::7")
    label = (3, b"eth0\0")  # IFA_LABEL: not an address
    data = (
        _newaddr(socket.AF_INET, (1, v4), label, (2, v4))
        + _newaddr(socket.AF_INET6, (1, v6))
        + _nlmsg(3, struct.pack("=i", 0))
    )
    out: set[str] = set()
    assert _parse_addresses(data, out) is True
    assert out == {"10.1.2.3", "fd00::7"}


def test_parse_addresses_wants_more_without_done_and_raises_on_error() -> None:
    out: set[str] = set()
    v4 = socket.inet_pton(socket.AF_INET, "10.9.9.9")
    assert _parse_addresses(_newaddr(socket.AF_INET, (2, v4)), out) is False
    assert out == {"10.9.9.9"}
    with pytest.raises(OSError, match="RTM_GETADDR"):
        _parse_addresses(_nlmsg(2, struct.pack("=i", -1)), out)
