"""When a mypyc build of the request path may be used (agent.native): stamps, state, activation."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import time

import pytest

from agent import native


@pytest.fixture
def package(tmp_path):
    """A copy of the compiled modules' sources laid out as a package directory."""
    pkg = tmp_path / "agent"
    for (sub, _), src in zip(native.MODULES, native.sources(), strict=True):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, pkg / sub / src.name)
    return pkg


def _source(package, index: int):
    sub, name = native.MODULES[index]
    return package / sub / f"{name}.py"


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)


def test_the_digest_is_the_sources_digest_and_moves_with_any_one_of_them(package):
    assert native.digest(package) == native.digest()
    before = native.digest(package)
    last = _source(package, -1)
    last.write_text(last.read_text() + "\n# edited\n")
    assert native.digest(package) != before


def test_state_absent_without_a_build_stale_for_other_sources_active_when_matching(
    tmp_path, package, no_env
):
    build = tmp_path / "native"
    assert native.state(build, package) == "absent"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package) + "\n")
    assert native.state(build, package) == "active"
    first = _source(package, 0)
    first.write_text(first.read_text() + "\nX = 1\n")
    assert native.state(build, package) == "stale"


def test_the_environment_switch_turns_a_current_build_off(tmp_path, package, monkeypatch):
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package))
    monkeypatch.setenv(native.ENV, "0")
    assert native.state(build, package) == "off"
    monkeypatch.setenv(native.ENV, "1")
    assert native.state(build, package) == "active"


def test_activate_puts_a_current_build_first_and_leaves_a_stale_one_out(
    tmp_path, no_env, monkeypatch
):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(native, "STATE", native.STATE)
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text("not the digest\n")
    path = ["/src/agent/proxy"]
    assert native.activate(path, "proxy", build) == "stale"
    assert path == ["/src/agent/proxy"]
    assert str(build / "lib") not in sys.path

    (build / native.STAMP).write_text(native.digest() + "\n")
    assert native.activate(path, "proxy", build) == "active"
    assert path == [str(build / "proxy"), "/src/agent/proxy"]
    assert str(build / "lib") in sys.path
    assert native.STATE == "active"


def test_a_failed_build_raises_with_the_compilers_words_and_removes_the_old_build(
    tmp_path, package
):
    bad = package / "proxy" / "accrual.py"
    bad.write_text(bad.read_text() + "\ndef broken(:\n")
    build = tmp_path / "native"
    (build / "proxy").mkdir(parents=True)
    (build / native.STAMP).write_text("an older build\n")
    with pytest.raises(native.NativeBuildError, match=r"(?s)mypyc build failed.*accrual\.py"):
        native.build(build, package_dir=package)
    assert not build.exists()


def test_a_current_build_is_not_redone(tmp_path, package):
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package) + "\n")
    assert native.build(build, package_dir=package) is False


def test_a_build_waits_for_the_one_under_way(tmp_path, package):
    # Rule 4: builds of one directory take turns. Another process holds the lock for
    # 0.5 s; a build that finds the directory current still waits its turn first.
    build = tmp_path / "native"
    build.mkdir()
    (build / native.STAMP).write_text(native.digest(package) + "\n")
    lock = tmp_path / ".native.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, sys, time\n"
                f"f = open({str(lock)!r}, 'a')\n"
                "fcntl.flock(f, fcntl.LOCK_EX)\n"
                "print('held', flush=True)\n"
                "time.sleep(0.5)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        t0 = time.monotonic()
        assert native.build(build, package_dir=package) is False
        assert time.monotonic() - t0 >= 0.3  # it waited for the holder
        assert holder.wait(5) == 0
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def _fixed_tuple(annotation: ast.expr) -> bool:
    """`tuple[A, B]` (not `tuple[A, ...]`, not a union with it)."""
    if not (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)):
        return False
    if annotation.value.id not in ("tuple", "Tuple"):
        return False
    items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    return not any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in items)


def _declarations(cls: ast.ClassDef) -> dict[str, tuple[ast.expr, int, bool]]:
    """Each attribute's first declaration: (annotation or value, line, annotated)."""
    out: dict[str, tuple[ast.expr, int, bool]] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, (node.annotation, node.lineno, True))
    assigns = [n for n in ast.walk(cls) if isinstance(n, ast.Assign | ast.AnnAssign)]
    for node in sorted(assigns, key=lambda n: (n.lineno, n.col_offset)):
        targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                if isinstance(node, ast.AnnAssign):
                    out.setdefault(t.attr, (node.annotation, node.lineno, True))
                else:
                    out.setdefault(t.attr, (node.value, node.lineno, False))
    return out


def test_no_compiled_class_keeps_a_tuple_typed_attribute():
    """agent.native rule 7: mypyc stores a fixed-length tuple attribute unboxed and makes a
    new tuple at every read, so identity memos over it never hit. Regression (nineteenth
    pass): the inbound's policy key, a tuple literal, missed its authorization memo on
    every request. An attribute first assigned a tuple literal, or annotated `tuple[...]`
    of fixed length, is declared as an object (`Hashable`, `Any`) or an optional tuple."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for src in native.sources():
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = (src.name, node)
    found = []
    for name, (file, cls) in classes.items():
        declared = _declarations(cls)
        bases = list(cls.bases)
        while bases:  # a base class's declaration is the attribute's type
            base = bases.pop()
            if isinstance(base, ast.Name) and base.id in classes:
                declared = {**declared, **_declarations(classes[base.id][1])}
                bases += classes[base.id][1].bases
        for attr, (expr, line, annotated) in declared.items():
            if _fixed_tuple(expr) if annotated else isinstance(expr, ast.Tuple):
                found.append(f"{file}:{line} {name}.{attr}")
    assert found == []


def test_no_compiled_module_builds_a_union_for_isinstance():
    """agent.native rule 9: `isinstance(x, A | B)` makes a `types.UnionType` at each call in
    compiled code as in interpreted code, and checks it slowly; a tuple is checked inline.
    Regression (twenty-sixth pass): six such checks on the h2 path were 6% of a
    cross-node request's instructions."""
    found = [
        f"{src.name}:{node.lineno}"
        for src in native.sources()
        for node in ast.walk(ast.parse(src.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("isinstance", "issubclass")
        and len(node.args) == 2
        and isinstance(node.args[1], ast.BinOp)
        and isinstance(node.args[1].op, ast.BitOr)
    ]
    assert found == []


def test_no_compiled_module_unpacks_a_struct():
    """agent.native rule 10: `Struct.unpack`/`unpack_from` return a tuple of objects, and
    the compiled code's arithmetic on them is then generic. Regression (twenty-seventh
    pass): h2recv's frame header so read was 5k instructions of each h2 request."""
    found = [
        f"{src.name}:{node.lineno}"
        for src in native.sources()
        for node in ast.walk(ast.parse(src.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("unpack", "unpack_from")
    ]
    assert found == []


# What the request path calls per request on values whose classes vary (rule 12): the
# interface, in its compiled module, and the compiled classes that implement it.
PER_REQUEST_INTERFACES = (
    (("record.py", "BoundHttp"), ("observe.py", "_BoundHttp")),
    (("record.py", "BoundAuthz"), ("observe.py", "_BoundAuthz")),
    (("h1plan.py", "Router"), ("outbound.py", "OutboundRouter")),
    (("h1plan.py", "Router"), ("inbound.py", "InboundRouter")),
)


def test_per_request_interfaces_are_compiled_base_classes_not_protocols():
    """agent.native rule 12: through a `typing.Protocol` each call was a lookup by name and
    the callee's argument parsing; through a compiled base class it is a vtable call.
    Regression (fifty-fifth pass): `BoundHttp.exchange`, `BoundAuthz.count` and
    `Router.plan_now` so called, with the state read through the worker, were 25% of a
    same-node request's instructions together with the lookups rule 6 binds."""
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    for src in native.sources():
        for node in ast.walk(ast.parse(src.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[(src.name, node.name)] = node
    for (file, name), (impl_file, impl) in PER_REQUEST_INTERFACES:
        base = classes[(file, name)]
        assert not any(ast.unparse(b).endswith("Protocol") for b in base.bases), name
        decorators = [ast.unparse(d) for d in base.decorator_list]
        assert "mypyc_attr(allow_interpreted_subclasses=True)" in decorators, name
        bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in classes[(impl_file, impl)].bases]
        assert name in bases, (impl, bases)
