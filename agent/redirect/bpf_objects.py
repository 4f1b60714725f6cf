"""bpf(2) objects through libbpf: pins, ids, object info, and links.

The thin layer over libbpf.so.1 that the eBPF capture's shells share:
`agent.redirect.maps` opens pinned maps with it, `agent.redirect.ebpf_node`
and `ebpf_compile` pin programs and attach links, `ebpf_inspect` lists what is
loaded.

Rules:
1. libbpf (1.x) returns -errno; every failure here raises `BpfError` naming the
   call and the object (`check`).
2. libbpf is loaded once per process, on first use (`libbpf()`), with the
   argument types of every function called here declared up front.
3. A link is owned by its pin: `ensure_link` updates a pinned link in place
   when its target matches and replaces it otherwise; `remove_link` detaches
   and unpins. Every fd opened here is closed before returning.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.errors import AgentError

if TYPE_CHECKING:
    from collections.abc import Iterator

# <linux/bpf.h> link types, as bpf_link_info reports them
LINK_CGROUP = 3
LINK_NETNS = 5


class BpfError(AgentError):
    """A bpf(2) call through libbpf failed."""

    def __init__(self, call: str, what: str, err: int) -> None:
        self.call = call
        self.what = what
        self.errno = err
        super().__init__(f"{call} {what}: {os.strerror(err)}")


def _load_libbpf() -> Any:
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    c_int, c_void_p, c_char_p, c_uint = (
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_char_p,
        ctypes.c_uint,
    )
    sigs: dict[str, list[Any]] = {
        "bpf_obj_get": [c_char_p],
        "bpf_obj_pin": [c_int, c_char_p],
        "bpf_map_lookup_elem": [c_int, c_void_p, c_void_p],
        "bpf_map_update_elem": [c_int, c_void_p, c_void_p, ctypes.c_uint64],
        "bpf_map_delete_elem": [c_int, c_void_p],
        "bpf_map_get_next_key": [c_int, c_void_p, c_void_p],
        "bpf_link_create": [c_int, c_int, c_int, c_void_p],
        "bpf_link_update": [c_int, c_int, c_void_p],
        "bpf_link_detach": [c_int],
        "bpf_prog_attach": [c_int, c_int, c_int, c_uint],
        "bpf_prog_detach2": [c_int, c_int, c_int],
        "bpf_obj_get_info_by_fd": [c_int, c_void_p, ctypes.POINTER(ctypes.c_uint32)],
        "bpf_prog_load": [c_int, c_char_p, c_char_p, c_void_p, ctypes.c_size_t, c_void_p],
        "bpf_map_create": [c_int, c_char_p, c_uint, c_uint, c_uint, c_void_p],
    }
    for kind in ("prog", "map", "link"):
        sigs[f"bpf_{kind}_get_next_id"] = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]
        sigs[f"bpf_{kind}_get_fd_by_id"] = [ctypes.c_uint32]
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int
    return lib


_lib: Any = None


def libbpf() -> Any:
    """libbpf.so.1 with the signatures used here (loaded on first use).

    Raises:
        OSError: libbpf is not installed.
    """
    global _lib  # noqa: PLW0603 - one handle per process
    if _lib is None:
        _lib = _load_libbpf()
    return _lib


def check(ret: int, call: str, what: str) -> int:
    """`ret` if it is not an error, else raise `BpfError`."""
    if ret < 0:
        raise BpfError(call, what, -ret)
    return ret


def obj_get(path: str | Path) -> int:
    """A new fd for the pinned object at `path`.

    Raises:
        BpfError: nothing pinned there (ENOENT), or not permitted.
    """
    return check(libbpf().bpf_obj_get(str(path).encode()), "bpf_obj_get", str(path))


def obj_pin(fd: int, path: str | Path) -> None:
    """Pin `fd` at `path`, replacing what was pinned there.

    Raises:
        BpfError: the pin failed.
    """
    Path(path).unlink(missing_ok=True)
    check(libbpf().bpf_obj_pin(fd, str(path).encode()), "bpf_obj_pin", str(path))


def obj_info(fd: int) -> bytes:
    """The raw `bpf_*_info` the kernel returns for a prog, map or link fd.

    Raises:
        BpfError: the call failed.
    """
    buf = ctypes.create_string_buffer(256)
    size = ctypes.c_uint32(256)
    check(libbpf().bpf_obj_get_info_by_fd(fd, buf, ctypes.byref(size)), "bpf_obj_get_info", str(fd))
    return buf.raw[: size.value]


def object_ids(kind: str) -> list[int]:
    """Ids of every loaded object of `kind` ("prog", "map" or "link")."""
    get_next = getattr(libbpf(), f"bpf_{kind}_get_next_id")
    ids: list[int] = []
    cur = ctypes.c_uint32(0)
    while get_next(cur.value, ctypes.byref(cur)) == 0:
        ids.append(cur.value)
    return ids


def fd_by_id(kind: str, obj_id: int) -> int:
    """A new fd for the object `kind`/`obj_id`.

    Raises:
        BpfError: it is gone.
    """
    fn = getattr(libbpf(), f"bpf_{kind}_get_fd_by_id")
    return check(fn(obj_id), f"bpf_{kind}_get_fd_by_id", str(obj_id))


# --- links ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkInfo:
    """What a pinned link is: its id, program and target."""

    id: int
    prog_id: int
    kind: int
    target: int  # cgroup id, or netns inode
    attach_type: int

    @classmethod
    def of(cls, fd: int) -> LinkInfo:
        raw = obj_info(fd)
        kind, link_id, prog_id = struct.unpack_from("<III", raw, 0)
        if kind == LINK_CGROUP:
            target, attach = struct.unpack_from("<QI", raw, 16)
        else:
            target, attach = struct.unpack_from("<II", raw, 16)
        return cls(id=link_id, prog_id=prog_id, kind=kind, target=target, attach_type=attach)


def obj_id(fd: int) -> int:
    """The kernel's id of the prog, map or link `fd` (each info struct has it after its
    type)."""
    return int(struct.unpack_from("<I", obj_info(fd), 4)[0])


@contextlib.contextmanager
def _open_fd(path: str | Path, flags: int = os.O_RDONLY) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def pinned(path: Path) -> Iterator[int | None]:
    """An fd for what is pinned at `path`, or None."""
    try:
        fd = obj_get(path)
    except BpfError:
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def ensure_link(pin: Path, prog_fd: int, target: Path, attach_type: int) -> None:
    """A link from `prog_fd` to `target` (cgroup dir or netns file), pinned at `pin`.

    A pinned link already on that target is moved to `prog_fd`; one on another
    target is replaced.

    Raises:
        BpfError: the kernel refused.
    """
    want_target = target.stat().st_ino
    with pinned(pin) as fd:
        if fd is not None:
            info = LinkInfo.of(fd)
            if info.target == want_target and info.attach_type == attach_type:
                if info.prog_id != obj_id(prog_fd):
                    check(libbpf().bpf_link_update(fd, prog_fd, None), "bpf_link_update", str(pin))
                return
            remove_link(pin)
    with _open_fd(target) as target_fd:
        link = check(
            libbpf().bpf_link_create(prog_fd, target_fd, attach_type, None),
            "bpf_link_create",
            f"{pin.name} -> {target}",
        )
    try:
        obj_pin(link, pin)
    finally:
        os.close(link)


def remove_link(pin: Path) -> bool:
    """Detach the link pinned at `pin` and remove the pin; whether one was there."""
    with pinned(pin) as fd:
        if fd is None:
            return False
        libbpf().bpf_link_detach(fd)
    with contextlib.suppress(FileNotFoundError):
        pin.unlink()
    return True


def link_infos(directory: Path) -> dict[str, LinkInfo]:
    """Every link pinned in `directory`, by pin name."""
    out = {}
    if directory.is_dir():
        for pin in sorted(directory.iterdir()):
            with pinned(pin) as fd:
                if fd is not None:
                    out[pin.name] = LinkInfo.of(fd)
    return out
