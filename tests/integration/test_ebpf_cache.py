"""The cache of compiled eBPF programs against the kernel: maps made from an entry's
specs, a pinned map of another spec, a program the kernel refuses. No bcc: the
entries are written here, as small programs (bcc's own output is loaded from the
cache in tests/integration/test_ebpf.py)."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from agent.redirect import bpf_objects, ebpf_cache, maps
from agent.redirect.ebpf_cache import CacheMiss, Entry, MapSpec

pytestmark = pytest.mark.privileged

HASH = MapSpec(type=1, key_size=8, value_size=16, max_entries=32, flags=0)


def _insn(code: int, regs: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, regs, 0, imm)


# r1 = map ma_t (ld_imm64, BPF_PSEUDO_MAP_FD); r0 = 1; exit
ALLOW = _insn(0x18, 1 << 4 | 1, 0) + _insn(0) + _insn(0xB7, 0, 1) + _insn(0x95)
# exit with r0 never written: the verifier refuses it
REFUSED = _insn(0x18, 1 << 4 | 1, 0) + _insn(0) + _insn(0x95)


def _entry(insns: bytes, spec: MapSpec = HASH) -> Entry:
    return Entry(
        key="t" * 64,
        program="connect4",
        prog_type=18,  # CGROUP_SOCK_ADDR
        attach_type=10,  # INET4_CONNECT
        license="GPL",
        insns=insns,
        relocs=((0, "ma_t"),),
        maps={"ma_t": spec},
    )


@pytest.fixture
def maps_dir():
    root = Path(f"/sys/fs/bpf/meshagent-test-cache-{os.getpid()}")
    yield root / "maps"
    shutil.rmtree(root, ignore_errors=True)


def test_an_entry_makes_and_pins_its_missing_map_and_loads(maps_dir):
    fd = ebpf_cache.load_entry(_entry(ALLOW), maps_dir)
    try:
        info = bpf_objects.obj_info(fd)
        assert info[:4] == struct.pack("<I", 18)  # a loaded cgroup sock_addr program
        assert info[4:8] != b"\0\0\0\0"
    finally:
        os.close(fd)
    with maps.pinned(maps_dir / "ma_t") as map_fd:
        assert map_fd is not None
        assert ebpf_cache.map_spec_of(map_fd) == HASH


def test_a_second_load_reuses_the_pinned_map(maps_dir):
    os.close(ebpf_cache.load_entry(_entry(ALLOW), maps_dir))
    with maps.pinned(maps_dir / "ma_t") as fd:
        first = maps.obj_id(fd)
    os.close(ebpf_cache.load_entry(_entry(ALLOW), maps_dir))
    with maps.pinned(maps_dir / "ma_t") as fd:
        assert maps.obj_id(fd) == first


def test_a_pinned_map_of_another_spec_is_a_miss_and_stays(maps_dir):
    os.close(ebpf_cache.load_entry(_entry(ALLOW), maps_dir))
    bigger = MapSpec(type=1, key_size=8, value_size=32, max_entries=32, flags=0)
    with pytest.raises(CacheMiss, match="ma_t: pinned with"):
        ebpf_cache.load_entry(_entry(ALLOW, bigger), maps_dir)
    with maps.pinned(maps_dir / "ma_t") as fd:
        assert ebpf_cache.map_spec_of(fd) == HASH


def test_a_program_the_kernel_refuses_is_a_miss(maps_dir):
    with pytest.raises(CacheMiss, match="bpf_prog_load ma_connect4: Permission denied"):
        ebpf_cache.load_entry(_entry(REFUSED), maps_dir)
