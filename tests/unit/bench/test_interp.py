"""`meshagent bench --interp`: the workers' counts, their file format and the summary."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from agent.bench import interp
from agent.proxy import worker as worker_mod

if TYPE_CHECKING:
    from pathlib import Path


def _per_request() -> int:
    return 1


def _once() -> int:
    return 2


def _counted_worker(directory: Path, worker_id: int, requests: int) -> None:
    """A worker's run under rule 8 whose 'requests' each call `_per_request` twice."""

    async def run(_sock: Any) -> int:
        _once()
        for _ in range(requests):
            _per_request()
            _per_request()
        return 0

    fake: Any = SimpleNamespace(worker_id=worker_id, run=run)
    a, b = socket.socketpair()
    try:
        assert worker_mod._run_counted(fake, a, str(directory)) == 0
    finally:
        a.close()
        b.close()


def test_workers_counts_merge_into_calls_per_request(tmp_path: Path) -> None:
    directory = tmp_path / "meshagent-ebpf-xnode"
    _counted_worker(directory, 0, 30)
    _counted_worker(directory, 1, 20)
    assert len(list(directory.glob("worker-*.tsv"))) == 2
    got = interp.summarize(directory, requests=50)
    assert got is not None
    out, summary = got
    assert out == tmp_path / "meshagent-ebpf-xnode.txt"
    hot = {name: per for _, name, per in summary.hot()}
    assert hot["_per_request"] == pytest.approx(2.0)  # 100 calls over 50 requests, merged
    assert "_once" not in hot  # 2 calls in 50 requests: below the floor, start-up work
    assert summary.per_request() >= 2.0
    text = out.read_text()
    assert text.startswith("interpreted calls of 2 worker(s) of meshagent-ebpf-xnode: 50 requests")
    [line] = [x for x in text.splitlines() if x.split()[2:3] == ["_per_request"]]
    assert line.split()[:2] == ["100", "2.000"]
    assert "test_interp.py:" in line


def test_the_profile_is_removed_when_the_run_ends(tmp_path: Path) -> None:
    import sys  # noqa: PLC0415 - the interpreter's own hook

    _counted_worker(tmp_path / "w", 0, 1)
    assert sys.getprofile() is None


def test_no_files_no_summary(tmp_path: Path) -> None:
    assert interp.summarize(tmp_path, requests=10) is None


def test_parse_names_the_file_and_line_of_a_bad_line() -> None:
    good = "12\t/x/y.py:3\tf\n"
    assert interp.parse([good, "", good]) == {("/x/y.py:3", "f"): 24}
    with pytest.raises(ValueError, match=r"^w\.tsv:2: not calls"):
        interp.parse([good, "many\t/x/y.py:3\tf"], source="w.tsv")
    with pytest.raises(ValueError, match=r"^w\.tsv:1: "):
        interp.parse(["12 /x/y.py:3 f"], source="w.tsv")


def test_counting_sets_the_variable_only_inside(tmp_path: Path) -> None:
    assert interp.ENV == worker_mod.INTERP_ENV
    before = os.environ.get(interp.ENV)
    with interp.counting(tmp_path / "s"):
        assert os.environ[interp.ENV] == str(tmp_path / "s")
        assert (tmp_path / "s").is_dir()
    assert os.environ.get(interp.ENV) == before
    with interp.counting(None):
        assert os.environ.get(interp.ENV) == before
