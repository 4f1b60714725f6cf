"""Compiled eBPF programs kept between processes, loaded again without clang.

bcc compiles each program of bpf/ every time an agent starts: about a second
of clang per program and ~150 MB in the compiling child. The instructions it
loads differ from one process to the next only in the map fds written into
ld_imm64 instructions. An entry keeps a program's instructions with those
places named by map, and the specs of every map its file declares, so a later
process (a restarted agent, a second agent on this machine, a test) loads the
same program against its own pinned maps.

Rules:
1. An entry is keyed (`cache_key`) by all that changes the compiled bytes: the
   files of bpf/, the kernel (release and build) and its headers, bcc's
   version, and `FORMAT`. An entry whose format, key or program differs from
   what is asked is a miss.
2. Only map references are relocated (ld_imm64 with src_reg
   BPF_PSEUDO_MAP_FD, `map_refs`); a program with any other pseudo load is
   not stored (`NotCacheable`).
3. Loading an entry (`load_entry`) first makes sure every map its file
   declares is pinned under the maps directory: a pin already there must match
   the spec (type, key and value size, max entries, flags), a missing one is
   created and pinned, as bcc's pinned tables would be. Any mismatch or failed
   call is a miss (`CacheMiss`): the caller compiles with bcc, as before.
4. Entries are written whole (temporary file, then rename) in directories
   made for root only (0700), with a digest of their fields; an entry that does
   not parse or whose digest does not match is a miss, and the next compile
   overwrites it.
5. MESHAGENT_BPF_CACHE names the directory (default /var/cache/meshagent/bpf);
   "off" turns the cache off (`cache_dir_from_env`).
6. Entries live in one directory per key. A hit or a store marks its key's
   directory as used (its mtime); after each store only the `KEEP_KEYS` used
   last stay (`prune`), so a node's cache holds a few versions' programs, not
   every version it ever ran. An agent of a removed version compiles again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.redirect import bpf_objects
from agent.redirect.bpf_objects import BpfError

ENV_CACHE = "MESHAGENT_BPF_CACHE"
DEFAULT_CACHE_DIR = Path("/var/cache/meshagent/bpf")
FORMAT = 1
KEEP_KEYS = 3  # rule 6

_INSN = 8  # bytes per instruction
_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
_PSEUDO_MAP_FD = 1


class NotCacheable(ValueError):  # noqa: N818 - a reason, raised to the caller that stores
    """A program whose instructions hold something other than map fds to relocate."""


class BadEntry(ValueError):  # noqa: N818 - what the entry is
    """An entry file that does not parse: the message names the file and the field."""


class CacheMiss(Exception):  # noqa: N818 - a verdict, not a failure
    """No usable entry: absent, unreadable, for other sources, or refused by the kernel."""


# --- the pure part --------------------------------------------------------------------


def map_refs(insns: bytes) -> list[tuple[int, int]]:
    """(instruction index, map fd) of every map reference in `insns` (rule 2).

    Raises:
        NotCacheable: a length that is not whole instructions, a truncated
            ld_imm64, or a pseudo load other than a map fd.
    """
    if len(insns) % _INSN:
        raise NotCacheable(f"{len(insns)} bytes is not a whole number of instructions")
    out = []
    i, count = 0, len(insns) // _INSN
    while i < count:
        code, regs = insns[i * _INSN], insns[i * _INSN + 1]
        if code != _LD_IMM64:
            i += 1
            continue
        if i + 1 >= count:
            raise NotCacheable(f"instruction {i}: ld_imm64 without its second half")
        src = regs >> 4
        if src == _PSEUDO_MAP_FD:
            out.append((i, struct.unpack_from("<i", insns, i * _INSN + 4)[0]))
        elif src != 0:
            raise NotCacheable(f"instruction {i}: pseudo load {src}, only map fds relocate")
        i += 2
    return out


def relocate(insns: bytes, fds: dict[int, int]) -> bytes:
    """`insns` with the map fd of each instruction index in `fds` replaced.

    Raises:
        NotCacheable: an index that is not a map reference (`map_refs`).
    """
    known = {i for i, _ in map_refs(insns)}
    out = bytearray(insns)
    for index, fd in fds.items():
        if index not in known:
            raise NotCacheable(f"instruction {index} is not a map reference")
        struct.pack_into("<i", out, index * _INSN + 4, fd)
    return bytes(out)


def cache_key(files: dict[str, bytes], facts: dict[str, str]) -> str:
    """The key of a set of sources (`files`, by relative path) compiled in the
    circumstances `facts` (kernel, headers, bcc version): a hex digest (rule 1)."""
    h = hashlib.sha256(f"meshagent-bpf-cache {FORMAT}\n".encode())
    for name in sorted(facts):
        h.update(f"fact {name}={facts[name]}\n".encode())
    for name in sorted(files):
        h.update(f"file {name} {len(files[name])}\n".encode())
        h.update(files[name])
    return h.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class MapSpec:
    """What bcc created a map with; a pinned map must match it to be shared."""

    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int

    @classmethod
    def parse(cls, raw: dict[str, Any], where: str) -> MapSpec:
        """Raises: BadEntry: a field missing or not a non-negative integer."""
        values = {}
        for name in ("type", "key_size", "value_size", "max_entries", "flags"):
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadEntry(f"{where}: {name} must be a non-negative integer, got {value!r}")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One compiled program: its instructions, where they name maps, and the maps."""

    key: str
    program: str
    prog_type: int
    attach_type: int
    license: str
    insns: bytes
    relocs: tuple[tuple[int, str], ...]  # (instruction index, map name)
    maps: dict[str, MapSpec]

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "key": self.key,
            "program": self.program,
            "prog_type": self.prog_type,
            "attach_type": self.attach_type,
            "license": self.license,
            "insns": self.insns.hex(),
            "relocs": [list(r) for r in self.relocs],
            "maps": {
                n: {
                    "type": s.type,
                    "key_size": s.key_size,
                    "value_size": s.value_size,
                    "max_entries": s.max_entries,
                    "flags": s.flags,
                }
                for n, s in sorted(self.maps.items())
            },
        }
        return json.dumps({**body, "digest": entry_digest(body)}, indent=1)

    @classmethod
    def parse(cls, text: str, where: str) -> Entry:
        """An entry from its JSON; every field is checked.

        Raises:
            BadEntry: not JSON, another format, or a field of the wrong type; the
                message names `where` and the field.
        """
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise BadEntry(f"{where}: not JSON: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise BadEntry(f"{where}: not a format {FORMAT} entry")
        digest = raw.pop("digest", None)
        if digest != entry_digest(raw):
            raise BadEntry(f"{where}: digest does not match its content (changed after written)")
        strings = {n: raw.get(n) for n in ("key", "program", "license", "insns")}
        for name, value in strings.items():
            if not isinstance(value, str) or not value:
                raise BadEntry(f"{where}: {name} must be a non-empty string")
        numbers = {n: raw.get(n) for n in ("prog_type", "attach_type")}
        for name, value in numbers.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise BadEntry(f"{where}: {name} must be an integer")
        try:
            insns = bytes.fromhex(str(strings["insns"]))
        except ValueError as exc:
            raise BadEntry(f"{where}: insns is not hex") from exc
        maps_raw = raw.get("maps")
        if not isinstance(maps_raw, dict):
            raise BadEntry(f"{where}: maps must be an object")
        specs = {str(n): MapSpec.parse(s, f"{where}: maps.{n}") for n, s in maps_raw.items()}
        relocs = cls._relocs(raw.get("relocs"), insns, specs, where)
        return cls(
            key=str(strings["key"]),
            program=str(strings["program"]),
            prog_type=int(numbers["prog_type"] or 0),
            attach_type=int(numbers["attach_type"] or 0),
            license=str(strings["license"]),
            insns=insns,
            relocs=relocs,
            maps=specs,
        )

    @staticmethod
    def _relocs(
        raw: Any, insns: bytes, specs: dict[str, MapSpec], where: str
    ) -> tuple[tuple[int, str], ...]:
        if not isinstance(raw, list):
            raise BadEntry(f"{where}: relocs must be a list")
        try:
            refs = {i for i, _ in map_refs(insns)}
        except NotCacheable as exc:
            raise BadEntry(f"{where}: insns: {exc}") from exc
        out = []
        for n, item in enumerate(raw):
            ok = isinstance(item, list) and len(item) == 2
            if not ok or not isinstance(item[0], int) or item[1] not in specs:
                raise BadEntry(f"{where}: relocs[{n}] must be [index, declared map]")
            if item[0] not in refs:
                raise BadEntry(f"{where}: relocs[{n}]: instruction {item[0]} names no map")
            out.append((int(item[0]), str(item[1])))
        if {i for i, _ in out} != refs:
            raise BadEntry(f"{where}: relocs do not cover every map reference")
        return tuple(out)


def entry_digest(body: dict[str, Any]) -> str:
    """SHA-256 of an entry's fields as canonical JSON: a changed byte is a miss (rule 4)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# --- files ----------------------------------------------------------------------------


def cache_dir_from_env(env: dict[str, str] | None = None) -> Path | None:
    """MESHAGENT_BPF_CACHE (rule 5): the directory, or None when "off"."""
    raw = (os.environ if env is None else env).get(ENV_CACHE, "").strip()
    if raw.lower() in ("off", "0", "no", "false"):
        return None
    return Path(raw) if raw else DEFAULT_CACHE_DIR


def _bcc_version() -> str:
    """bcc's version, read from its package without importing it (its LLVM stays out)."""
    spec = importlib.util.find_spec("bcc")
    if spec is None or spec.origin is None:
        return "none"
    version = Path(spec.origin).with_name("version.py")
    with contextlib.suppress(OSError):
        return version.read_text().strip()
    return "unknown"


def source_key(src_dir: Path, headers: Path | None) -> str:
    """The key of the programs under `src_dir` compiled here, now (rule 1)."""
    files = {
        str(p.relative_to(src_dir)): p.read_bytes()
        for p in sorted(src_dir.rglob("*"))
        if p.is_file() and p.suffix in (".c", ".h")
    }
    uname = os.uname()
    facts = {
        "kernel": f"{uname.release} {uname.version} {uname.machine}",
        "headers": str(headers.resolve()) if headers is not None else "none",
        "bcc": _bcc_version(),
    }
    return cache_key(files, facts)


_KEY_DIR_LEN = 32


def entry_path(cache_dir: Path, key: str, program: str) -> Path:
    return cache_dir / key[:_KEY_DIR_LEN] / f"{program}.json"


def lookup(cache_dir: Path, key: str, program: str) -> Entry:
    """The stored entry of `program` under `key`.

    Raises:
        CacheMiss: none, unreadable, or for another key or program (rules 1, 4).
    """
    path = entry_path(cache_dir, key, program)
    try:
        entry = Entry.parse(path.read_text(), str(path))
    except FileNotFoundError as exc:
        raise CacheMiss(f"no entry {path}") from exc
    except (OSError, BadEntry) as exc:
        raise CacheMiss(str(exc)) from exc
    if entry.key != key or entry.program != program:
        raise CacheMiss(f"{path}: an entry for another key or program")
    with contextlib.suppress(OSError):  # a read-only cache still serves hits
        os.utime(path.parent)  # rule 6: used now
    return entry


def cached(cache_dir: Path, key: str, programs: list[str]) -> list[str]:
    """Which of `programs` have a usable entry under `key` (for `meshagent check`)."""
    out = []
    for program in programs:
        with contextlib.suppress(CacheMiss):
            lookup(cache_dir, key, program)
            out.append(program)
    return out


def store(cache_dir: Path, entry: Entry) -> Path:
    """Write `entry` whole (rule 4); its path.

    Raises:
        OSError: the directory cannot be made or written.
    """
    path = entry_path(cache_dir, entry.key, entry.program)
    cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # an existing one is left as is
    path.parent.mkdir(exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{entry.program}-")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(entry.to_json())
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    prune(cache_dir)
    return path


def prune(cache_dir: Path, keep: int = KEEP_KEYS) -> list[Path]:
    """Remove all but the `keep` key directories used last (rule 6); the removed ones."""
    used: list[tuple[int, Path]] = []
    for path in cache_dir.iterdir():
        if len(path.name) == _KEY_DIR_LEN and path.name.isalnum() and path.is_dir():
            with contextlib.suppress(OSError):  # gone meanwhile: another agent pruned it
                used.append((path.stat().st_mtime_ns, path))
    used.sort(reverse=True)
    removed = [path for _, path in used[keep:]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --- the kernel -----------------------------------------------------------------------


def map_spec_of(fd: int) -> MapSpec:
    """The spec of the map `fd` (its `bpf_map_info`).

    Raises:
        BpfError: the info call failed.
    """
    kind, _id, key, value, entries, flags = struct.unpack_from("<6I", bpf_objects.obj_info(fd))
    return MapSpec(type=kind, key_size=key, value_size=value, max_entries=entries, flags=flags)


def entry_from_bcc(bpf: Any, *, key: str, program: str, prog_type: int, attach_type: int) -> Entry:
    """The entry of a program bcc compiled (`bpf`, a `bcc.BPF`), named `ma_<program>`.

    Raises:
        NotCacheable: its instructions name something other than its file's maps.
        BpfError: a map's info could not be read.
    """
    from bcc.libbcc import lib  # noqa: PLC0415 - only where bcc compiled already

    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    lib.bpf_table_fd_id.restype = ctypes.c_int
    lib.bpf_table_fd_id.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
    lib.bpf_num_tables.restype = ctypes.c_ulonglong
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    tables: dict[int, tuple[str, MapSpec]] = {}  # map id -> (name, spec)
    for i in range(lib.bpf_num_tables(bpf.module)):
        fd = lib.bpf_table_fd_id(bpf.module, i)
        name = lib.bpf_table_name(bpf.module, i).decode()
        tables[bpf_objects.obj_id(fd)] = (name, map_spec_of(fd))
    insns = bpf.dump_func(f"ma_{program}".encode())
    relocs = []
    for index, fd in map_refs(insns):
        found = tables.get(bpf_objects.obj_id(fd))
        if found is None:
            raise NotCacheable(f"instruction {index}: fd {fd} is not a map of {program}.c")
        relocs.append((index, found[0]))
    return Entry(
        key=key,
        program=program,
        prog_type=prog_type,
        attach_type=attach_type,
        license=lib.bpf_module_license(bpf.module).decode(),
        insns=insns,
        relocs=tuple(relocs),
        maps=dict(tables.values()),
    )


class LoadOpts(ctypes.Structure):
    """The head of libbpf's `struct bpf_prog_load_opts` (older layouts are accepted)."""

    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("attempts", ctypes.c_int),
        ("expected_attach_type", ctypes.c_int),
    )


def _ensure_map(maps_dir: Path, name: str, spec: MapSpec) -> int:
    """An fd for map `name` pinned under `maps_dir`, made and pinned if missing (rule 3).

    Raises:
        CacheMiss: a pinned map of another spec, or the kernel refused.
    """
    pin = maps_dir / name
    try:
        fd = bpf_objects.obj_get(pin)
    except BpfError:
        return _create_map(pin, spec)
    try:
        pinned = map_spec_of(fd)
    except BpfError as exc:
        os.close(fd)
        raise CacheMiss(str(exc)) from exc
    if pinned != spec:
        os.close(fd)
        raise CacheMiss(f"{pin}: pinned with {pinned}, the entry wants {spec}")
    return fd


def _create_map(pin: Path, spec: MapSpec) -> int:
    """A new map of `spec`, pinned at `pin`: its fd.

    Raises:
        CacheMiss: the kernel refused to make or pin it.
    """
    opts = _MapOpts(ctypes.sizeof(_MapOpts), map_flags=spec.flags)
    fd = bpf_objects.libbpf().bpf_map_create(
        spec.type,
        pin.name[:15].encode(),
        spec.key_size,
        spec.value_size,
        spec.max_entries,
        ctypes.byref(opts),
    )
    if fd < 0:
        raise CacheMiss(f"bpf_map_create {pin.name}: {os.strerror(-fd)}")
    try:
        bpf_objects.obj_pin(fd, pin)
    except BpfError as exc:
        os.close(fd)
        raise CacheMiss(str(exc)) from exc
    return int(fd)


class _MapOpts(ctypes.Structure):
    """libbpf's `struct bpf_map_create_opts` up to `map_flags`."""

    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("btf_fd", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
    )


def load_entry(entry: Entry, maps_dir: Path) -> int:
    """Load `entry`'s program against the maps pinned under `maps_dir`: its fd (rule 3).

    Raises:
        CacheMiss: a map could not be made or matched, or the kernel refused the program.
    """
    maps_dir.mkdir(parents=True, exist_ok=True)
    fds: dict[str, int] = {}
    try:
        for name, spec in sorted(entry.maps.items()):
            fds[name] = _ensure_map(maps_dir, name, spec)
        try:
            insns = relocate(entry.insns, {i: fds[name] for i, name in entry.relocs})
        except NotCacheable as exc:
            raise CacheMiss(str(exc)) from exc
        buf = ctypes.create_string_buffer(insns, len(insns))
        opts = LoadOpts(ctypes.sizeof(LoadOpts), 0, entry.attach_type)
        fd = bpf_objects.libbpf().bpf_prog_load(
            entry.prog_type,
            f"ma_{entry.program}"[:15].encode(),
            entry.license.encode(),
            buf,
            len(insns) // _INSN,
            ctypes.byref(opts),
        )
        if fd < 0:
            raise CacheMiss(f"bpf_prog_load ma_{entry.program}: {os.strerror(-fd)}")
        return int(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
