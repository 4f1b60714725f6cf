"""agent.bench.callgrind's pure parts: reading a dump, a row's counts, the wrap command."""

from __future__ import annotations

import shlex

import pytest

from agent.bench import callgrind, harness
from agent.bench.callgrind import MARKER, Dump, DumpError, parse, summarize

# The shape callgrind 3.19 writes with name compression: a name is given once, with its id,
# by whichever of fn= or cfn= meets it first, and then only by the id.
DUMP = f"""# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 4242
part: 1

positions: line
events: Ir
summary: 1320000

ob=(1) /lib/meshagent_native__mypyc.so
fl=(1) ???
fn=(10) CPyDef_httpproxy___HttpConn___data_received
0 500
cfn=(11) {MARKER}
calls=7 0
0 70
cfn=(12) CPyDef_h1msg___response_head_bytes
calls=7 0
0 900
fn=(13) CPyDef_h2serve___H2Serve___on_response
0 40
cfn=(11)
calls=13 0
0 130
fn=(11)
0 200
cfn=(12)
calls=1 0
0 3
totals: 1400000
"""


def test_a_dump_gives_its_summary_and_the_calls_of_each_callee_over_every_caller():
    dump = parse(DUMP)
    assert dump.ir == 1_320_000
    assert dump.calls[MARKER] == 20  # 7 from one caller, 13 from another, by id only
    assert dump.calls["CPyDef_h1msg___response_head_bytes"] == 8
    assert "CPyDef_h2serve___H2Serve___on_response" not in dump.calls  # never called


def test_a_dump_without_compression_is_read_by_name():
    text = f"summary: 10\nfn=main\ncfn={MARKER}\ncalls=3 5\n0 9\n"
    assert parse(text).calls == {MARKER: 3}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("events: Ir\nfn=(1) main\n", "x.cg: no 'summary:'"),
        ("summary: 5\nfn=(1) main\ncfn=(2)\ncalls=1 0\n", "x.cg:3: function (2) used before"),
        ("summary: 5\nfn=(1) main\ncfn=(2) f\ncalls=many 0\n", "x.cg:4: calls= without a count"),
    ],
)
def test_a_bad_dump_says_what_and_where(text, says):
    with pytest.raises(DumpError, match=says.replace("(", r"\(").replace(")", r"\)")):
        parse(text, "x.cg")


def test_per_request_counts_one_exchange_a_request_on_each_node_of_the_path():
    # Cross-node: one exchange a request on each node's worker.
    out = summarize(
        [
            ("a", 11, Dump(ir=660_000, calls={MARKER: 10})),
            ("b", 12, Dump(ir=700_000, calls={MARKER: 10})),
        ]
    )
    assert out["ir_per_request"] == 136_000
    assert [w["ir_per_exchange"] for w in out["workers"]] == [66_000, 70_000]
    assert out["workers"][0] == {
        "node": "a",
        "pid": 11,
        "ir": 660_000,
        "exchanges": 10,
        "ir_per_exchange": 66_000,
    }
    # Same-node: one exchange a request records both sides, on whichever of the node's
    # workers carried it.
    same = summarize(
        [
            ("a", 11, Dump(ir=600_000, calls={MARKER: 12})),
            ("a", 12, Dump(ir=400_000, calls={MARKER: 8})),
        ]
    )
    assert same["ir_per_request"] == 50_000


def test_a_worker_that_recorded_nothing_has_no_per_request_figure():
    out = summarize([("a", 11, Dump(ir=5_000, calls={"other": 3}))])
    assert out["ir_per_request"] is None
    assert out["workers"][0]["ir_per_exchange"] is None


def test_the_wrap_command_runs_callgrind_into_the_directory_quoted(tmp_path):
    directory = tmp_path / "a b"
    argv = shlex.split(callgrind.wrap_command(directory))
    assert argv == ["valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/cg.%p"]


def test_the_newest_dump_of_a_pid_is_its_highest_number(tmp_path):
    for name in ("cg.7", "cg.7.1", "cg.7.10", "cg.7.2", "cg.70.11", "cg.7.x"):
        (tmp_path / name).write_text("")
    assert callgrind.newest_dump(tmp_path, 7).name == "cg.7.10"
    with pytest.raises(callgrind.BenchError, match="no callgrind dump of worker 8"):
        callgrind.newest_dump(tmp_path, 8)


def test_icount_defaults_to_long_loads_and_refuses_short_ones(tmp_path):
    opts = harness.Options.make(quick=True, icount_dir=tmp_path)
    assert opts.duration_s == callgrind.DURATION_S
    assert harness.Options.make(quick=True, icount_dir=tmp_path, duration_s=25).duration_s == 25
    with pytest.raises(ValueError, match="--icount needs loads of at least 20s"):
        harness.Options.make(quick=True, icount_dir=tmp_path, duration_s=5)
    assert harness.Options.make(quick=True).duration_s == 1.0
