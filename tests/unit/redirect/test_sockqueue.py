"""agent.redirect.sockqueue's parts that need no pod: finding a socket's inode in a TCP table,
and its fd in a process's fd table."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from agent.redirect import sockqueue
from agent.redirect.maps_abi import ip_be

HEAD = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid"
    "  timeout inode\n"
)
TCP = HEAD + (
    "   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000"
    "     0        0 111 1 0000000000000000 100 0 0 10 0\n"
    "   1: 0100007F:102C 0100007F:9C40 01 00000000:00000000 00:00000000 00000000"
    "     0        0 222 1 0000000000000000 20 4 30 10 -1\n"
    "   2: 0100007F:9C40 0100007F:102C 01 00000000:00000000 00:00000000 00000000"
    "     0        0 333 1 0000000000000000 20 4 30 10 -1\n"
)
TCP6 = HEAD + (
    "   0: 0000000000000000FFFF00000A00000A:1F90 0000000000000000FFFF00000A00000A:A410 01"
    " 00000000:00000000 00:00000000 00000000     0        0 444 1 0000000000000000 20 4 0 10 -1\n"
)
LO = ip_be("127.0.0.1")
POD = ip_be("10.0.0.10")


def _inode(text: str, key: sockqueue.Key, *, v6: bool) -> int | None:
    return sockqueue.table_inode(sockqueue.tcp_table(text), key, v6=v6)


def test_a_socket_is_found_by_its_local_and_remote_address():
    assert _inode(TCP, (1, LO, LO, 40000, 4140), v6=False) == 333
    assert _inode(TCP, (1, LO, LO, 4140, 40000), v6=False) == 222
    assert _inode(TCP, (1, LO, LO, 4140, 40001), v6=False) is None


def test_a_v4_mapped_socket_is_found_in_tcp6():
    key = (1, POD, POD, 8080, 0xA410)
    assert _inode(TCP6, key, v6=True) == 444
    assert _inode(TCP, key, v6=False) is None


def test_inode_zero_is_not_a_socket_to_copy():
    text = TCP.replace(" 333 ", " 0 ")
    assert _inode(text, (1, LO, LO, 40000, 4140), v6=False) is None


def test_a_process_fd_table_maps_its_sockets_inodes_to_their_fds():
    with socket.socket() as a, socket.socket(socket.AF_UNIX) as b:
        fds = sockqueue.fd_table(os.getpid())
        for s in (a, b):
            assert fds[os.fstat(s.fileno()).st_ino] == s.fileno()
        with Path(os.devnull).open() as f:  # not a socket: not in the table
            assert f.fileno() not in sockqueue.fd_table(os.getpid()).values()
    assert sockqueue.fd_table(2**22 + 1) == {}  # no such process


def test_support_is_read_from_the_kernels_symbols(tmp_path):
    syms = tmp_path / "kallsyms"
    syms.write_text("ffffffff820ee2f0 t tcp_bpf_ioctl\nffffffff820ee300 t tcp_bpf_recvmsg\n")
    assert sockqueue.supported(syms)
    syms.write_text("ffffffff820ee300 t tcp_bpf_recvmsg\nffffffff820ee2f0 t tcp_bpf_ioctl_x\n")
    assert not sockqueue.supported(syms)
    assert not sockqueue.supported(tmp_path / "missing")


def test_queues_switched_off_answer_none_without_looking():
    q = sockqueue.Queues(list, list, enabled=False)
    assert q.look().queued((1, LO, LO, 40000, 4140), 7) is None


def test_a_pods_processes_include_those_of_its_child_cgroups(tmp_path):
    (tmp_path / "cgroup.procs").write_text("")
    for name, pids in (("ctr-a", "11\n12\n"), ("ctr-b/inner", "13\n")):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "cgroup.procs").write_text(pids)
    assert sorted(sockqueue._cgroup_pids(tmp_path)) == [11, 12, 13]
    assert sockqueue._cgroup_pids(tmp_path / "missing") == []
