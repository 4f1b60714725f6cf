"""agent/_proto/ must be exactly what scripts/gen-protos produces from protos/*.proto.

Regenerates into a temporary directory and compares file by file, so an edited
.proto without regeneration, a hand edit of generated code, or a leftover module
fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GEN = ROOT / "scripts" / "gen-protos"
COMMITTED = ROOT / "agent" / "_proto"
GENERATED_SUFFIXES = (".py", ".pyi")


def _generated_files(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def _run_gen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GEN), *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    proc = _run_gen("--out", str(tmp_path))
    assert proc.returncode == 0, f"scripts/gen-protos failed:\n{proc.stderr}"
    fresh = _generated_files(tmp_path)
    committed = _generated_files(COMMITTED)
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    differ = sorted(n for n in set(fresh) & set(committed) if fresh[n] != committed[n])
    stale = {"missing": missing, "extra": extra, "differ": differ}
    assert stale == {"missing": [], "extra": [], "differ": []}, (
        f"agent/_proto is stale; run `scripts/gen-protos` and commit the result: {stale}"
    )


def test_check_mode_names_a_stale_file(tmp_path):
    out = tmp_path / "_proto"
    shutil.copytree(COMMITTED, out, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "net_pb2.py").write_text("# edited by hand\n")
    (out / "leftover_pb2.py").write_text("# no longer generated\n")
    proc = _run_gen("--check", "--out", str(out))
    assert proc.returncode == 1
    assert f"stale: {out / 'net_pb2.py'}" in proc.stderr
    assert f"stale: {out / 'leftover_pb2.py'}" in proc.stderr
    assert "destination_pb2.py" not in proc.stderr
