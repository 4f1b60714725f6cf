"""ctypes mirrors in agent.redirect.maps_abi against the maps bcc compiles from bpf/.

The size test needs bcc and kernel headers (one compile of each program file
that declares maps, in one module fixture), so it is privileged; the
conversions are pure.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import socket
from pathlib import Path

import pytest

from agent.redirect import ebpf_node, maps_abi
from agent.redirect.ebpf import BPF_SRC
from agent.redirect.model import CaptureSpec, PortRange, PortSet


def _spec(**kw):
    return CaptureSpec(pod="ns/p", netns=Path("/run/netns/x"), pod_ip="10.1.2.3", **kw)


def test_ip_be_holds_the_address_bytes_in_network_order():
    value = maps_abi.ip_be("10.1.2.3")
    assert value.to_bytes(4, "little") == bytes([10, 1, 2, 3])
    assert maps_abi.ip_str(value) == "10.1.2.3"


def test_pod_config_merges_proxy_ports_into_inbound_skips():
    cfg = maps_abi.pod_config(_spec(skip_inbound_ports=PortSet((PortRange(7000, 7010),))))
    got = [(cfg.skip_in[i].first, cfg.skip_in[i].last) for i in range(cfg.n_skip_in)]
    assert got == [(4190, 4190), (4191, 4191), (7000, 7010)]
    assert cfg.n_skip_out == 0
    assert cfg.flags == maps_abi.F_OUTBOUND | maps_abi.F_INBOUND


def test_pod_config_keeps_ipv4_subnets_as_network_order_masks():
    nets = (ipaddress.ip_network("10.9.0.0/16"), ipaddress.ip_network("fd00::/8"))
    cfg = maps_abi.pod_config(_spec(skip_subnets=nets), accel=True, accel_max_msg=4096)
    assert cfg.n_subnets == 1
    assert maps_abi.ip_str(cfg.subnets[0].addr) == "10.9.0.0"
    assert maps_abi.ip_str(cfg.subnets[0].mask) == "255.255.0.0"
    assert cfg.flags & maps_abi.F_ACCEL
    assert cfg.accel_max_msg == 4096
    assert cfg.pod_ip == maps_abi.ip_be("10.1.2.3")


def test_pod_config_refuses_more_port_ranges_than_the_programs_check():
    many = PortSet(tuple(PortRange(p, p) for p in range(1000, 1000 + maps_abi.MAX_PORT_RANGES + 1)))
    with pytest.raises(ValueError, match="skip-outbound-ports"):
        maps_abi.pod_config(_spec(skip_outbound_ports=many))
    with pytest.raises(ValueError, match="skip-accel-ports"):
        maps_abi.pod_config(_spec(skip_accel_ports=many), accel=True)


def test_pod_config_carries_the_ports_acceleration_skips():
    skip = PortSet((PortRange(5201, 5201), PortRange(9000, 9010)))
    cfg = maps_abi.pod_config(_spec(skip_accel_ports=skip), accel=True)
    got = [(cfg.skip_accel[i].first, cfg.skip_accel[i].last) for i in range(cfg.n_skip_accel)]
    assert got == [(5201, 5201), (9000, 9010)]
    assert cfg.flags & maps_abi.F_ACCEL
    assert maps_abi.pod_config(_spec()).n_skip_accel == 0


def test_abi_mismatches_name_each_pinned_map_of_other_sizes_and_ignore_unknown_ones():
    right = {
        name: (ctypes.sizeof(key), ctypes.sizeof(leaf))
        for name, (key, leaf) in maps_abi.MAP_TYPES.items()
    }
    assert maps_abi.abi_mismatches({**right, "someone_elses": (1, 2)}) == []
    old = {**right, maps_abi.CFG_BY_NETNS: (8, 280)}
    want = ctypes.sizeof(maps_abi.PodConfigC)
    assert maps_abi.abi_mismatches(old) == [
        f"ma_cfg_netns: key/value 8/280 bytes, this version's 8/{want}"
    ]


def test_orig_dst_addr_decodes_network_order_port():
    dst = maps_abi.OrigDstC(ip=maps_abi.ip_be("192.0.2.7"), port_be=socket.htons(8080), family=2)
    assert maps_abi.orig_dst_addr(dst) == ("192.0.2.7", 8080)


# --- sizes against bcc ------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every map's (key size, leaf size) as bcc declares them, from real compiles."""
    bcc = pytest.importorskip("bcc")
    pins = Path("/sys/fs/bpf") / f"meshagent-sizes-{os.getpid()}"
    if os.geteuid() == 0:  # a fresh machine mounts it only when an agent or test first does
        ebpf_node.ensure_bpffs()
    if not Path("/sys/fs/bpf").is_dir() or not os.access("/sys/fs/bpf", os.W_OK):
        # CI (CI=true) has what scripts/setup installs: missing there is a failure, not a skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            "needs a writable bpffs at /sys/fs/bpf"
        )
    pins.mkdir()
    objects = []
    sizes: dict[str, tuple[int, int]] = {}
    try:
        for name in ("sockops", "sk_lookup", "sk_msg"):  # together they declare every map
            b = bcc.BPF(
                src_file=str(BPF_SRC / f"{name}.c").encode(),
                cflags=[f'-DMA_PIN_MAPS="{pins}"', f"-I{BPF_SRC}", "-w"],
            )
            objects.append(b)
            for table in maps_abi.MAP_TYPES:
                tname = table.encode()
                if bcc.lib.bpf_table_fd(b.module, tname) < 0:
                    continue
                key = bcc.BPF._decode_table_type(
                    json.loads(bcc.lib.bpf_table_key_desc(b.module, tname))
                )
                leaf = bcc.BPF._decode_table_type(
                    json.loads(bcc.lib.bpf_table_leaf_desc(b.module, tname))
                )
                sizes[table] = (ctypes.sizeof(key), ctypes.sizeof(leaf))
        yield sizes
    finally:
        for b in objects:
            b.close()
        for pin in pins.iterdir():
            pin.unlink()
        pins.rmdir()


@pytest.mark.privileged
@pytest.mark.parametrize("name", sorted(maps_abi.MAP_TYPES))
def test_ctypes_mirror_has_the_size_bcc_gives_the_map(compiled, name):
    key_type, leaf_type = maps_abi.MAP_TYPES[name]
    assert name in compiled, f"{name} is declared by no compiled program"
    assert (ctypes.sizeof(key_type), ctypes.sizeof(leaf_type)) == compiled[name]
