"""The request path (HTTP/1, HTTP/2) compiled with mypyc, used only while it matches the
sources.

Per request the proxy's Python was most of the distance to HAProxy (perf: 12 us of
interpreter time per request against 2 us for a bare relay, the kernel's share being
the same). mypyc compiles these typed modules to C extensions, same source, same tests.

`python -m agent.native build` compiles `MODULES` into `BUILD_DIR` (`scripts/setup`
runs it); `python -m agent.native status` says which modules a process would load.
The `__init__` of `agent.proxy` and `agent.admin` calls `activate`, which puts the
build first on the package's `__path__`, so every process (CLI, supervisor, workers,
tests) imports the compiled modules, or all of them as plain Python.

Rules:
1. Never stale: the build's stamp is a digest of the compiled modules' sources and the
   Python version; a build whose stamp differs from the sources as they are now is not
   used (state "stale"), so an edited module runs as written until the next build.
2. All or none: the modules are one mypyc group (they share native classes), loaded
   together or not at all.
3. `MESHAGENT_NATIVE=0` turns it off (state "off"): for cProfile (`bench --profile`),
   which sees no compiled function, and for debugging. `MESHAGENT_NATIVE_DIR` puts the
   build elsewhere (an image's read-only layer, one per checkout).
4. A build that fails removes the previous build (plain Python from then on) and
   raises `NativeBuildError` with the compiler's last output; a build that is current
   is not redone. Builds of one directory take turns (a lock file beside it): two at
   once each removed the directory when they began and moved theirs in when they
   ended, so the second nested its build inside the first's and stamped the first's
   modules, made from older sources, as current (fifty-third pass).
5. A dataclass in a compiled module is a native class whose `__init__` is still the one
   `dataclasses` writes, run by the interpreter: 1.8 us for three keyword fields
   against 0.3 us for an `__init__` compiled with the class. Classes made per
   connection, request, stream, frame or body piece say `init=False` and write their
   `__init__`; a frozen dataclass's `__hash__` and `__eq__` are the interpreter's too,
   so such objects are no dict keys on those paths.
6. A module constant read per frame, stream or request is `Final`: compiled code
   reads a plain module global through the module's dict (another module's through
   its attribute), each time; a `Final` one it inlines (literals) or keeps in a C
   static. The h2 modules' constants made `Final` took 20% off a worker's CPU per
   h2 stream (bench/RESULTS.md, sixteenth pass).
7. An attribute whose value is compared by identity (`is`) or kept as a cache key is
   typed as an object (`Hashable`, `Any`), never as a fixed-length tuple: mypyc stores
   a `tuple[...]`-typed attribute unboxed and builds a new tuple object at every read,
   so `x.key is x.key` is False compiled and True interpreted. The inbound's policy key
   so typed missed its per-connection authorization memo on every request (one
   `WorkerState.get` a request, found by `meshagent bench --interp`: agent.bench.interp).
8. What the request path still runs interpreted is counted, not guessed:
   `meshagent bench --interp` counts every interpreted call of the workers per
   request; on the compiled path every setup's count is 0 (bench/RESULTS.md,
   nineteenth pass). A module the request path calls into is compiled with it,
   even when it is called per batch rather than per request: the io_uring send
   (agent.proxy.uring), interpreted, was 0.22 calls and a fifth of a saturated
   cross-node worker's instructions (thirty-fifth pass).
9. A type check takes a tuple, `isinstance(x, (A, B))`, never a union `A | B`: compiled
   code, like the interpreter, builds the `types.UnionType` at each call and checks it
   slowly, where a tuple of native classes is checked inline (6% of a cross-node
   request's instructions on the h2 path, `meshagent bench --icount`; bench/RESULTS.md,
   twenty-sixth pass).
10. What a C module returns is `Any`: `Struct.unpack_from` gives a tuple of objects, and
   every shift, mask, compare and slice on its fields is then a generic call. A fixed
   binary header is read by indexing `bytes` (one C read of a small int each) and
   written with `int.to_bytes`. h2recv's frame header so read took 5k instructions
   off each h2 request on each side (bench/RESULTS.md, twenty-seventh pass). Likewise
   a float compared per request is kept as a float: an int read as a C double goes
   through its `__float__` (the latency buckets, `admin.metrics.Histogram`).
11. What the request path reads of the worker is compiled too: its state copy
   (`WorkerState`, agent.proxy.wstate), whose `generation` every per-connection memo
   checks and whose `get` the routers call. The interpreted `Worker` holds it; reading
   an interpreted object's attribute is a generic lookup by name.
12. A call the request path makes per request goes to a value typed as a compiled
   class, never as a `typing.Protocol`: through a Protocol the call is a lookup by
   name, the callee's argument parsing and its arguments boxed (twelfth pass). Where
   tests or plugins implement the interface in Python, the compiled base class says
   `@mypyc_attr(allow_interpreted_subclasses=True)` (from here: mypy_extensions'
   decorator at build time, a no-op at run time); compiled subclasses are still called
   through the vtable (`record.BoundHttp`, `h1plan.Router`; fifty-fifth pass).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Iterator

    from mypy_extensions import mypyc_attr as mypyc_attr  # noqa: PLC0414 - re-exported (rule 12)
else:

    def mypyc_attr(*_args: object, **_kwargs: object) -> object:
        """Rule 12's decorator at run time: mypyc reads it at build time, and a compiled
        class never calls it; interpreted, the class is left as it is."""
        return lambda cls: cls


from agent.errors import AgentError

ENV = "MESHAGENT_NATIVE"
DIR_ENV = "MESHAGENT_NATIVE_DIR"  # where the build is (default: agent/_native/)
PACKAGE_DIR = Path(__file__).resolve().parent  # .../agent
BUILD_DIR = Path(os.environ.get(DIR_ENV) or PACKAGE_DIR / "_native")
STAMP = "stamp"
GROUP = "meshagent_native"
# The per-request path of the HTTP/1 and HTTP/2 proxies, the TLS record layer (tlsio),
# the per-connection set-up (detect, plane) and the workers' recorder, in one group
# (rule 2):
# (package under agent/, module).
MODULES = (
    ("proxy", "accept"),
    ("proxy", "accrual"),
    ("proxy", "balance"),
    ("proxy", "detect"),
    ("proxy", "h1client"),
    ("proxy", "h1toh2"),
    ("proxy", "h1fast"),
    ("proxy", "h1msg"),
    ("proxy", "h1plan"),
    ("proxy", "h1upstream"),
    ("proxy", "h2codec"),
    ("proxy", "h2conn"),
    ("proxy", "h2events"),
    ("proxy", "h2frame"),
    ("proxy", "h2hpack"),
    ("proxy", "h2msg"),
    ("proxy", "h2pool"),
    ("proxy", "h2recv"),
    ("proxy", "h2route"),
    ("proxy", "h2serve"),
    ("proxy", "h2state"),
    ("proxy", "h2stream"),
    ("proxy", "h2toh1"),
    ("proxy", "http1"),
    ("proxy", "http2"),
    ("proxy", "httpproxy"),
    ("proxy", "inbound"),
    ("proxy", "origproto"),
    ("proxy", "outbound"),
    ("proxy", "plane"),
    ("proxy", "profile"),
    ("proxy", "record"),
    ("proxy", "tlsio"),
    ("proxy", "upstream"),
    ("proxy", "uring"),
    ("proxy", "writes"),
    ("proxy", "wstate"),
    ("admin", "labelsets"),
    ("admin", "metrics"),
    ("admin", "observe"),
    ("admin", "tapping"),
)
PACKAGES = tuple(sorted({pkg for pkg, _ in MODULES}))

State = Literal["active", "stale", "absent", "off"]
STATE: State = "absent"  # this process's, set when agent.proxy or agent.admin is imported

_BUILD_SCRIPT = """
import sys
from mypyc.build import mypycify
from setuptools import setup
out, c_dir, temp, group, *paths = sys.argv[1:]
setup(
    name=group,
    py_modules=[],
    ext_modules=mypycify(paths, opt_level="3", target_dir=c_dir, group_name=group),
    script_args=["--quiet", "build_ext", "--build-lib", out, "--build-temp", temp],
)
"""


class NativeBuildError(AgentError):
    """mypyc or the C compiler failed."""


def sources(package_dir: Path = PACKAGE_DIR) -> list[Path]:
    """The compiled modules' source files."""
    return [package_dir / pkg / f"{name}.py" for pkg, name in MODULES]


def digest(package_dir: Path = PACKAGE_DIR) -> str:
    """What a build must have been made from: the sources and the Python version (rule 1)."""
    h = hashlib.sha256(sys.version.encode())
    for path in sources(package_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _stamp(build_dir: Path) -> str | None:
    try:
        return (build_dir / STAMP).read_text().strip()
    except OSError:
        return None


def state(build_dir: Path = BUILD_DIR, package_dir: Path = PACKAGE_DIR) -> State:
    """Whether the build in `build_dir` may be used now."""
    if os.environ.get(ENV) == "0":
        return "off"
    stamp = _stamp(build_dir)
    if stamp is None:
        return "absent"
    return "active" if stamp == digest(package_dir) else "stale"


def activate(package_path: list[str], package: str, build_dir: Path = BUILD_DIR) -> State:
    """Load the build for `agent.<package>` (its `__path__`) when it is current; the state."""
    global STATE  # noqa: PLW0603 - the process's one answer, set once at import
    now = state(build_dir)
    if now == "active":
        lib = str(build_dir / "lib")
        if lib not in sys.path:
            sys.path.append(lib)  # the group's shared library, imported by each module
        package_path.insert(0, str(build_dir / package))
    STATE = now
    return now


@contextlib.contextmanager
def _turn(build_dir: Path) -> Iterator[None]:
    """Hold `build_dir`'s build lock (rule 4): one build of it at a time."""
    lock = build_dir.parent / f".{build_dir.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def build(
    build_dir: Path = BUILD_DIR, *, package_dir: Path = PACKAGE_DIR, force: bool = False
) -> bool:
    """Compile `MODULES` into `build_dir` unless current (rule 4); whether it compiled.

    Raises:
        NativeBuildError: mypyc or the C compiler failed; `build_dir` is then gone.
    """
    with _turn(build_dir):
        return _build(build_dir, package_dir, force=force)


def _build(build_dir: Path, package_dir: Path, *, force: bool) -> bool:
    want = digest(package_dir)
    if not force and _stamp(build_dir) == want:
        return False
    shutil.rmtree(build_dir, ignore_errors=True)
    root = package_dir.parent
    with tempfile.TemporaryDirectory(prefix="meshagent-native-") as tmp:
        work = Path(tmp)
        out = work / "out"
        paths = [str(p.relative_to(root)) for p in sources(package_dir)]
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _BUILD_SCRIPT,
                str(out),
                str(work / "c"),
                str(work / "t"),
                GROUP,
                *paths,
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise NativeBuildError(f"mypyc build failed (exit {proc.returncode}):\n{tail}")
        staged = work / "native"
        (staged / "lib").mkdir(parents=True)
        for pkg in PACKAGES:
            (staged / pkg).mkdir()
            for so in (out / package_dir.name / pkg).glob("*.so"):
                so.rename(staged / pkg / so.name)
        for so in out.glob(f"{GROUP}__mypyc*.so"):
            so.rename(staged / "lib" / so.name)
        missing = [f"{pkg}.{m}" for pkg, m in MODULES if not list((staged / pkg).glob(f"{m}.*.so"))]
        if missing:
            raise NativeBuildError(f"mypyc build made no extension for {', '.join(missing)}")
        shutil.rmtree(build_dir, ignore_errors=True)  # whatever is there now: not into it
        shutil.move(staged, build_dir)
    (build_dir / STAMP).write_text(want + "\n")  # last: a build cut short has no stamp
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.native", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="compile the request path with mypyc (when stale)")
    b.add_argument("--force", action="store_true", help="rebuild even when current")
    sub.add_parser("status", help="active | stale | absent | off, and the build directory")
    args = parser.parse_args(argv)
    if args.verb == "status":
        sys.stdout.write(f"{state()} {BUILD_DIR}\n")
        return 0
    try:
        made = build(force=args.force)
    except NativeBuildError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    sys.stdout.write(f"{'built' if made else 'current'}: {len(MODULES)} modules in {BUILD_DIR}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
