"""`meshagent bench --profile`: the environment it sets and the summary it writes."""

from __future__ import annotations

import cProfile
import os
from typing import TYPE_CHECKING

from agent.bench import profile

if TYPE_CHECKING:
    from pathlib import Path


def _twice_per_request() -> int:
    return sum(range(10))


def _write_worker_stats(directory: Path, name: str, requests: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(requests):
        _twice_per_request()
        _twice_per_request()
    prof.disable()
    prof.dump_stats(directory / name)


def test_summary_merges_the_workers_and_counts_calls_per_request(tmp_path: Path) -> None:
    directory = tmp_path / "meshagent-ebpf"
    directory.mkdir()
    _write_worker_stats(directory, "worker-0-100.prof", 30)
    _write_worker_stats(directory, "worker-1-101.prof", 20)
    out = profile.summarize(directory, requests=50)
    assert out == tmp_path / "meshagent-ebpf.txt"
    text = out.read_text()
    assert text.startswith("cProfile of 2 worker(s) of meshagent-ebpf: 50 requests")
    [line] = [x for x in text.splitlines() if "_twice_per_request" in x]
    assert line.split()[0] == "2.00"  # 100 calls over 50 requests, both workers merged
    assert "test_profile.py" in line  # a file outside agent/ shows by its name


def test_no_worker_stats_no_summary(tmp_path: Path) -> None:
    assert profile.summarize(tmp_path, requests=10) is None
    assert not (tmp_path.with_suffix(".txt")).exists()


def test_the_environment_is_set_only_inside_and_restored(tmp_path: Path) -> None:
    saved = os.environ.pop(profile.ENV, None)
    try:
        with profile.profiling(tmp_path / "p"):
            assert os.environ[profile.ENV] == str(tmp_path / "p")
            assert (tmp_path / "p").is_dir()
        assert profile.ENV not in os.environ
        os.environ[profile.ENV] = "/elsewhere"
        with profile.profiling(tmp_path / "q"):
            assert os.environ[profile.ENV] == str(tmp_path / "q")
        assert os.environ[profile.ENV] == "/elsewhere"
        with profile.profiling(None):
            assert os.environ[profile.ENV] == "/elsewhere"
    finally:
        os.environ.pop(profile.ENV, None)
        if saved is not None:
            os.environ[profile.ENV] = saved


def test_the_worker_reads_the_same_variable() -> None:
    from agent.proxy import worker  # noqa: PLC0415 - the proxy stays out of the bench at import

    assert worker.PROFILE_ENV == profile.ENV
