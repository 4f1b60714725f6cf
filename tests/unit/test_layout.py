"""Unit tests mirror the agent package: tests/unit/<path>/test_<module>.py ↔ agent/<path>/<module>.

STYLE.md "Tests": a unit test file names the module (or package) it covers, so a
reader finds the tests of `agent/proxy/balance.py` in `tests/unit/proxy/test_balance.py`
and a renamed or deleted module leaves no orphaned test behind. ALLOWED lists the
few files that cover a behaviour spanning several modules, each with its reason.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"
UNIT = ROOT / "tests" / "unit"

# Unit tests of a cross-module behaviour; the key is the path under tests/unit/.
ALLOWED = {
    # agent/_proto is generated: these cover the package as a whole (freshness
    # against scripts/gen-protos, gRPC paths of every service, wire layout of
    # every message), not one generated module.
    "_proto/test_generated_fresh.py": "generated package matches scripts/gen-protos",
    "_proto/test_grpc_services.py": "every generated service over real gRPC",
    "_proto/test_wire.py": "every generated message against upstream field numbers",
    # deploy/daemonset.yaml is not a module: its test checks the manifest against
    # `meshagent run`'s options (agent.supervisor.settings), so it cannot drift from the CLI.
    "test_deploy.py": "deploy/daemonset.yaml against the run options",
    # This file checks the tests/unit tree itself.
    "test_layout.py": "checks the layout of tests/unit",
}


def _mirrors_agent(test: Path) -> bool:
    rel = test.relative_to(UNIT)
    target = AGENT / rel.parent / rel.name.removeprefix("test_").removesuffix(".py")
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def stray_tests() -> list[str]:
    """Paths (under tests/unit/) of test files that mirror no agent module or package."""
    return sorted(
        str(test.relative_to(UNIT))
        for test in UNIT.rglob("test_*.py")
        if str(test.relative_to(UNIT)) not in ALLOWED and not _mirrors_agent(test)
    )


def test_every_unit_test_file_mirrors_an_agent_module_or_package():
    stray = stray_tests()
    assert not stray, (
        "unit test files must be tests/unit/<path>/test_<module>.py for an existing "
        f"agent/<path>/<module>.py or package (or be listed in ALLOWED with a reason): {stray}"
    )


def test_allow_list_names_only_existing_files_that_need_it():
    stale = sorted(
        name
        for name in ALLOWED
        if name != "test_layout.py" and (not (UNIT / name).is_file() or _mirrors_agent(UNIT / name))
    )
    assert not stale, f"remove these from ALLOWED (gone, or they now mirror a module): {stale}"


def test_unit_tests_live_only_in_test_files():
    # A helper module under tests/unit would dodge the mirror check; conftest.py is pytest's own.
    others = sorted(
        str(p.relative_to(UNIT))
        for p in UNIT.rglob("*.py")
        if not p.name.startswith("test_") and p.name not in {"conftest.py", "__init__.py"}
    )
    assert not others, f"tests/unit holds only test_*.py files: {others}"
