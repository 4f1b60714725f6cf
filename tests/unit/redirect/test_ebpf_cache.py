"""The cache of compiled eBPF programs: relocation, keys, entries and their files.

The kernel half (`load_entry`, `entry_from_bcc`) runs in
tests/integration/test_ebpf.py against real maps and programs.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from agent.redirect import ebpf_cache
from agent.redirect.ebpf_cache import CacheMiss, Entry, MapSpec, NotCacheable


def _insn(code: int, regs: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, regs, off, imm)


def _ld_map(dst: int, fd: int) -> bytes:
    """`r<dst> = map fd` as bcc writes it: ld_imm64, src_reg 1 (BPF_PSEUDO_MAP_FD)."""
    return _insn(0x18, (1 << 4) | dst, 0, fd) + _insn(0, 0, 0, 0)


MOV_R0_1 = _insn(0xB7, 0, 0, 1)
EXIT = _insn(0x95)
PROGRAM = MOV_R0_1 + _ld_map(1, 7) + MOV_R0_1 + _ld_map(2, 9) + EXIT  # map refs at 1 and 4
SPEC = MapSpec(type=1, key_size=8, value_size=16, max_entries=64, flags=0)


def _entry(**kw) -> Entry:
    values = {
        "key": "k" * 64,
        "program": "connect4",
        "prog_type": 18,
        "attach_type": 10,
        "license": "GPL",
        "insns": PROGRAM,
        "relocs": ((1, "ma_a"), (4, "ma_b")),
        "maps": {"ma_a": SPEC, "ma_b": SPEC},
    }
    return Entry(**{**values, **kw})


def test_map_refs_finds_each_pseudo_map_load_with_its_fd():
    assert ebpf_cache.map_refs(PROGRAM) == [(1, 7), (4, 9)]


def test_map_refs_skips_a_plain_64_bit_constant_and_its_second_half():
    constant = _insn(0x18, 3, 0, 0x18) + _insn(0, 0, 0, 0x18)  # both halves look like code 0x18
    assert ebpf_cache.map_refs(MOV_R0_1 + constant + _ld_map(1, 5) + EXIT) == [(3, 5)]


@pytest.mark.parametrize(
    ("insns", "says"),
    [
        (PROGRAM[:-3], "not a whole number"),
        (MOV_R0_1 + _insn(0x18, 1 << 4, 0, 7), "without its second half"),
        (_insn(0x18, (2 << 4) | 1, 0, 7) + _insn(0) + EXIT, "pseudo load 2"),
    ],
)
def test_map_refs_refuses_what_it_cannot_relocate(insns, says):
    with pytest.raises(NotCacheable, match=says):
        ebpf_cache.map_refs(insns)


def test_relocate_rewrites_only_the_fds_and_keeps_every_other_byte():
    out = ebpf_cache.relocate(PROGRAM, {1: 40, 4: 41})
    assert ebpf_cache.map_refs(out) == [(1, 40), (4, 41)]
    assert len(out) == len(PROGRAM)
    changed = [i for i, (a, b) in enumerate(zip(PROGRAM, out, strict=True)) if a != b]
    assert changed == [8 + 4, 32 + 4]  # the low byte of each imm


def test_relocate_refuses_an_index_that_names_no_map():
    with pytest.raises(NotCacheable, match="instruction 0"):
        ebpf_cache.relocate(PROGRAM, {0: 3})


def test_cache_key_changes_with_any_source_byte_file_name_or_fact():
    files = {"connect4.c": b"int x;", "include/meshagent.h": b"#define A 1"}
    facts = {"kernel": "6.1.0", "bcc": "0.26.0", "headers": "/usr/src/h"}
    key = ebpf_cache.cache_key(files, facts)
    assert key == ebpf_cache.cache_key(dict(reversed(files.items())), facts)
    assert key != ebpf_cache.cache_key({**files, "connect4.c": b"int y;"}, facts)
    assert key != ebpf_cache.cache_key({**files, "connect6.c": b""}, facts)
    assert key != ebpf_cache.cache_key(files, {**facts, "kernel": "6.1.1"})
    assert key != ebpf_cache.cache_key(files, {**facts, "bcc": "0.27.0"})


def test_source_key_reads_the_c_and_h_files_under_the_directory(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "a.c").write_text("int a;")
    (tmp_path / "include" / "h.h").write_text("#define H")
    before = ebpf_cache.source_key(tmp_path, None)
    (tmp_path / "notes.txt").write_text("ignored")
    assert ebpf_cache.source_key(tmp_path, None) == before
    (tmp_path / "include" / "h.h").write_text("#define H 2")
    assert ebpf_cache.source_key(tmp_path, None) != before


def test_entry_survives_its_json():
    entry = _entry()
    assert Entry.parse(entry.to_json(), "x.json") == entry


def _raw(**changes):
    """An entry's JSON with `changes`, digested again (so the field checks are reached)."""
    raw = json.loads(_entry().to_json())
    raw.update(changes)
    del raw["digest"]
    return json.dumps({**raw, "digest": ebpf_cache.entry_digest(raw)})


def test_an_entry_changed_after_it_was_written_is_refused():
    raw = json.loads(_entry().to_json())
    raw["insns"] = raw["insns"][:-2] + ("00" if raw["insns"][-2:] != "00" else "01")
    with pytest.raises(ValueError, match=r"x\.json: digest does not match"):
        Entry.parse(json.dumps(raw), "x.json")
    del raw["digest"]
    with pytest.raises(ValueError, match="digest does not match"):
        Entry.parse(json.dumps(raw), "x.json")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "x.json: not JSON"),
        (_raw(format=0), "not a format 1 entry"),
        (_raw(program=""), "program must be a non-empty string"),
        (_raw(prog_type="18"), "prog_type must be an integer"),
        (_raw(insns="zz"), "insns is not hex"),
        (_raw(maps=[]), "maps must be an object"),
        (_raw(maps={"ma_a": {"type": "hash"}}), r"maps\.ma_a: type must be a non-negative"),
        (_raw(relocs=[[1, "ma_a"]]), "do not cover every map reference"),
        (_raw(relocs=[[0, "ma_a"], [4, "ma_b"]]), "instruction 0 names no map"),
        (_raw(relocs=[[1, "ma_zz"], [4, "ma_b"]]), r"relocs\[0\] must be \[index, declared map\]"),
        (_raw(insns=(PROGRAM + b"\x00").hex()), "not a whole number"),
    ],
)
def test_entry_parse_names_the_file_and_the_bad_field(text, says):
    with pytest.raises(ValueError, match=says):
        Entry.parse(text, "x.json")


def test_store_then_lookup_in_a_directory_only_root_reads(tmp_path):
    cache = tmp_path / "cache"
    path = ebpf_cache.store(cache, _entry())
    assert path == ebpf_cache.entry_path(cache, "k" * 64, "connect4")
    assert ebpf_cache.lookup(cache, "k" * 64, "connect4") == _entry()
    assert cache.stat().st_mode & 0o777 == 0o700
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["connect4.json"]  # no temporary left


@pytest.mark.parametrize("why", ["absent", "corrupt", "other key", "other program"])
def test_lookup_misses_rather_than_fails(tmp_path, why):
    key = "k" * 64
    if why == "corrupt":
        path = ebpf_cache.entry_path(tmp_path, key, "connect4")
        path.parent.mkdir(parents=True)
        path.write_text('{"format": 1, "key": ')
    elif why == "other key":  # same first 32 characters, so the same directory
        ebpf_cache.store(tmp_path, _entry(key="k" * 32 + "j" * 32))
    elif why == "other program":
        stored = ebpf_cache.store(tmp_path, _entry(program="connect6"))
        stored.rename(stored.with_name("connect4.json"))
    with pytest.raises(CacheMiss):
        ebpf_cache.lookup(tmp_path, key, "connect4")


def _key(n: int) -> str:
    return str(n) * 64  # a directory per key: they differ in the first 32 characters


def _age(cache: Path, key: str, seconds_ago: int) -> None:
    when = 1_700_000_000 - seconds_ago
    os.utime(ebpf_cache.entry_path(cache, key, "connect4").parent, (when, when))


def test_a_store_keeps_only_the_key_directories_used_last(tmp_path):
    for n in (1, 2, 3):
        ebpf_cache.store(tmp_path, _entry(key=_key(n)))
        _age(tmp_path, _key(n), 100 - n)  # 3 used last, then 2, then 1
    ebpf_cache.lookup(tmp_path, _key(1), "connect4")  # a hit: 1 is used now
    (tmp_path / "notes").mkdir()  # not a key directory: never removed
    ebpf_cache.store(tmp_path, _entry(key=_key(4)))  # 4 used now; 2 is the oldest
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == sorted([_key(1)[:32], _key(3)[:32], _key(4)[:32], "notes"])
    with pytest.raises(CacheMiss):
        ebpf_cache.lookup(tmp_path, _key(2), "connect4")
    _age(tmp_path, _key(4), 0)
    _age(tmp_path, _key(1), 1)
    assert ebpf_cache.prune(tmp_path, keep=1) == [tmp_path / _key(1)[:32], tmp_path / _key(3)[:32]]
    assert ebpf_cache.lookup(tmp_path, _key(4), "connect4") == _entry(key=_key(4))


def test_cached_names_the_programs_with_a_usable_entry(tmp_path):
    key = "k" * 64
    ebpf_cache.store(tmp_path, _entry())
    broken = ebpf_cache.entry_path(tmp_path, key, "sockops")
    broken.write_text("{}")
    assert ebpf_cache.cached(tmp_path, key, ["connect4", "sockops", "sk_msg"]) == ["connect4"]
    assert ebpf_cache.cached(tmp_path, "j" * 64, ["connect4"]) == []


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (None, ebpf_cache.DEFAULT_CACHE_DIR),
        ("", ebpf_cache.DEFAULT_CACHE_DIR),
        ("/tmp/c", Path("/tmp/c")),
        ("off", None),
        ("0", None),
    ],
)
def test_cache_dir_from_env(value, want):
    env = {} if value is None else {ebpf_cache.ENV_CACHE: value}
    assert ebpf_cache.cache_dir_from_env(env) == want
