"""Choosing setups and loads from the CLI's values; reading CPU time (no lab needed)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from agent import native
from agent.bench import harness, setups
from agent.bench.harness import (
    ALL_LOADS,
    BASE,
    EXPLAIN_LOADS,
    NAMED_LOADS,
    QUICK_MEMORY_PODS,
    QUICK_SETUPS,
    Options,
    Variant,
    accel_delta,
    cpu_seconds,
    interpreted_error,
    interpreted_workers,
    missing_env,
    native_notes,
    side_by_side,
    tcp_side_by_side,
    variant_order,
)
from agent.bench.loads import Measured
from agent.bench.topology import Target


def test_quick_runs_the_goals_setups_and_short_loads_with_memory():
    opts = Options.make(quick=True)
    assert opts.setups == QUICK_SETUPS
    peers = {"direct", "haproxy-tcp", "haproxy-http", "direct-xnode", "haproxy-tls"}
    ours = {f"meshagent-{m}{x}" for m in ("iptables", "ebpf") for x in ("", "-xnode")}
    assert set(QUICK_SETUPS) == peers | ours | {"meshagent-ebpf-accel"}
    assert list(QUICK_SETUPS) == [s for s in setups.SETUPS if s in QUICK_SETUPS]  # run order
    assert "http1-rate-2000" in opts.loads
    assert opts.memory_pods == QUICK_MEMORY_PODS == (100,)
    assert opts.duration_s < 5


def test_quick_runs_side_by_side_on_one_node_only_unless_loads_are_named():
    quick = Options.make(quick=True)
    assert quick.runs("meshagent-iptables", "http1-side-1000")
    assert quick.runs("meshagent-ebpf-accel", "tcp-side-1000")
    assert not quick.runs("meshagent-ebpf-xnode", "http1-side-1000")
    assert quick.runs("meshagent-ebpf-xnode", "http1-saturate")
    assert Options.make(quick=False).runs("meshagent-ebpf-xnode", "http1-side-1000")
    named = Options.make(quick=True, loads_="http1-side-1000")
    assert named.runs("meshagent-iptables-xnode", "http1-side-1000")


def test_load_prefix_picks_every_rate_and_memory_n_picks_one_count():
    opts = Options.make(quick=False, loads_="http1-rate,memory-50")
    assert opts.loads == tuple(x for x in ALL_LOADS if x.startswith("http1-rate-"))
    assert opts.memory_pods == (50,)


def test_the_post_load_runs_only_when_named():
    assert "http1-post-saturate" in NAMED_LOADS
    for quick in (True, False):
        assert "http1-post-saturate" not in Options.make(quick=quick).loads
    named = Options.make(quick=False, loads_="http1-saturate,http1-post-saturate")
    assert named.loads == ("http1-saturate", "http1-post-saturate")
    assert named.runs("meshagent-ebpf-xnode", "http1-post-saturate")


def test_the_full_run_and_a_named_setup_run_beyond_quicks():
    assert Options.make(quick=False).setups == tuple(setups.SETUPS)
    assert Options.make(quick=True, setups_="python-floor-tls").setups == ("python-floor-tls",)


def test_explaining_setups_run_only_saturation_unless_loads_are_named():
    assert set(EXPLAIN_LOADS) == set(setups.SETUPS) - set(QUICK_SETUPS)
    full = Options.make(quick=False)
    assert full.runs("python-floor", "http1-saturate")
    assert full.runs("meshagent-ebpf-h1-xnode", "h2-saturate")
    assert not full.runs("python-floor", "http1-rate-1000")
    assert not full.runs("haproxy-tls-h2", "conn-rate")
    assert all(full.runs("meshagent-ebpf-xnode", load) for load in ALL_LOADS)  # judged: all
    named = Options.make(quick=False, loads_="http1-rate-1000,conn-rate")
    assert named.runs("python-floor", "http1-rate-1000")
    assert named.runs("haproxy-tls-h2", "conn-rate")


def test_setup_names_match_exactly():
    opts = Options.make(quick=True, setups_="direct,meshagent-iptables", duration_s=0.5)
    assert opts.setups == ("direct", "meshagent-iptables")
    assert opts.duration_s == 0.5


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown setup 'nginx'"):
        Options.make(quick=True, setups_="nginx")
    with pytest.raises(ValueError, match="unknown load"):
        Options.make(quick=True, loads_="udp")


def test_accel_setup_runs_by_default_and_http1_rr_only_in_the_full_run():
    quick, full = Options.make(quick=True), Options.make(quick=False)
    for opts in (quick, full):
        assert opts.setups.index("meshagent-ebpf-accel") == opts.setups.index("meshagent-ebpf") + 1
    assert "http1-rr" in full.loads
    assert "http1-rr" not in quick.loads
    assert Options.make(quick=True, loads_="http1-rr").loads == ("http1-rr",)


def test_side_by_side_runs_on_meshagent_setups_at_1000_in_quick_runs():
    assert [s for s in setups.SETUPS if side_by_side(s)] == [
        "meshagent-iptables",
        "meshagent-ebpf",
        "meshagent-ebpf-accel",
        "meshagent-iptables-xnode",
        "meshagent-ebpf-xnode",
        "meshagent-ebpf-h2-xnode",
        "meshagent-ebpf-h1-xnode",
    ]
    quick, full = Options.make(quick=True), Options.make(quick=False)
    ran = {s for s in full.setups if side_by_side(s) and full.runs(s, "http1-side-1000")}
    # the upgrade modes explain saturation only (rule 8): not in a full run's side loads
    assert ran == {
        "meshagent-iptables",
        "meshagent-ebpf",
        "meshagent-ebpf-accel",
        "meshagent-iptables-xnode",
        "meshagent-ebpf-xnode",
    }
    assert "http1-side-1000" in quick.loads
    assert "http1-side-2000" not in quick.loads
    assert {"http1-side-1000", "http1-side-2000"} <= set(full.loads)
    named = Options.make(quick=False, loads_="http1-side")
    assert named.loads == ("http1-side-1000", "http1-side-2000")


def test_opaque_tcp_side_by_side_runs_on_sockmap_only_at_the_http_side_rates():
    assert [s for s in setups.SETUPS if tcp_side_by_side(s)] == ["meshagent-ebpf-accel"]
    quick, full = Options.make(quick=True), Options.make(quick=False)
    assert "tcp-side-1000" in quick.loads
    assert "tcp-side-2000" not in quick.loads  # as http1-side-2000
    assert {"tcp-side-1000", "tcp-side-2000"} <= set(full.loads)
    assert full.runs("meshagent-ebpf-accel", "tcp-side-2000")
    named = Options.make(quick=False, loads_="tcp-side")
    assert named.loads == ("tcp-side-1000", "tcp-side-2000")
    both = Options.make(quick=True, loads_="tcp-side-1000,http1-side-1000")
    assert both.loads == ("tcp-side-1000", "http1-side-1000")


def testaccel_delta_is_each_counter_increase_and_nothing_without_counts():
    before = {"redirected_msgs": 10, "off_size": 1}
    after = {"redirected_msgs": 4010, "off_size": 3}
    assert accel_delta(before, after) == {"accel": {"redirected_msgs": 4000, "off_size": 2}}
    assert accel_delta(None, after) == {}
    assert accel_delta(before, None) == {}


def test_repeat_needs_at_least_one_round():
    assert Options.make(quick=True).repeat == 1
    assert Options.make(quick=True, repeat=3).repeat == 3
    with pytest.raises(ValueError, match="--repeat must be at least 1, got 0"):
        Options.make(quick=True, repeat=0)


def test_cpu_seconds_counts_a_busy_process_and_not_a_sleeping_one():
    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.4: pass\n"
    busy = subprocess.Popen([sys.executable, "-c", spin + "time.sleep(5)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.2)  # both started
        before = {p.pid: cpu_seconds(p.pid) for p in (busy, idle)}
        time.sleep(0.8)
        after = {p.pid: cpu_seconds(p.pid) for p in (busy, idle)}
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert after[busy.pid] - before[busy.pid] > 0.1  # it burned CPU for part of the window
    assert after[idle.pid] - before[idle.pid] < 0.05
    assert cpu_seconds(busy.pid) is None  # gone


def test_cpu_seconds_sums_every_thread_of_a_process():
    script = (
        "import threading,time\n"
        "def spin():\n"
        "    t=time.thread_time()\n"
        "    while time.thread_time()-t<0.3: pass\n"
        "ts=[threading.Thread(target=spin) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(time.process_time(), flush=True); time.sleep(5)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        own = float(proc.stdout.readline())  # the process's own count, threads included
        measured = cpu_seconds(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert measured is not None
    assert measured >= 0.6
    assert abs(measured - own) < 0.15


def test_placement_is_split_by_default_and_a_bad_one_is_refused():
    assert Options.make(quick=True).placement == "split"
    assert Options.make(quick=True, placement="shared").placement == "shared"
    with pytest.raises(ValueError, match="--placement must be one of split, shared, got 'half'"):
        Options.make(quick=True, placement="half")


@pytest.mark.parametrize(
    ("state", "says"),
    [("stale", "older than its sources"), ("absent", "never built"), ("off", "=0")],
)
def test_a_run_whose_agents_would_run_interpreted_says_so(state, says):
    opts = Options.make(quick=False, setups_="haproxy-http,meshagent-ebpf")
    (note,) = native_notes(opts, state)
    assert note.startswith("the node agents ran interpreted")
    assert says in note
    assert "python -m agent.native build" in note


def test_a_compiled_run_or_one_without_agents_says_nothing_of_it():
    assert native_notes(Options.make(quick=False, setups_="meshagent-ebpf"), "active") == []
    assert native_notes(Options.make(quick=False, setups_="direct,haproxy-http"), "stale") == []


def test_a_variant_is_a_name_and_environment_variables():
    opts = Options.make(quick=True, variants=["ring:MESHAGENT_IO_URING=on", "two:A=1,B_2=x=y"])
    assert opts.variants == (
        Variant("ring", (("MESHAGENT_IO_URING", "on"),)),
        Variant("two", (("A", "1"), ("B_2", "x=y"))),
    )
    assert Options.make(quick=True).variants == ()


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("MESHAGENT_IO_URING=off", "--variant wants NAME:KEY=VALUE"),
        ("base:A=1", "other than 'base'"),
        ("Big:A=1", "--variant wants NAME:KEY=VALUE"),
        ("off:MESHAGENT_IO_URING", r"--variant off: 'MESHAGENT_IO_URING' is not KEY=VALUE"),
        ("off:A=1,", r"--variant off: '' is not KEY=VALUE"),
        ("off:1A=1", r"--variant off: '1A=1' is not KEY=VALUE"),
    ],
)
def test_a_malformed_variant_is_refused_with_what_was_given(given, says):
    with pytest.raises(ValueError, match=says):
        Options.make(quick=True, variants=[given])


def test_variant_names_must_differ():
    with pytest.raises(ValueError, match="--variant names must differ, got a, a"):
        Options.make(quick=True, variants=["a:X=1", "a:X=2"])


def test_variants_alternate_with_base_and_only_for_setups_with_agents():
    a, b = Variant("a", (("X", "1"),)), Variant("b", (("X", "2"),))
    names = lambda order: [v.name for v in order]  # noqa: E731
    assert names(variant_order("meshagent-ebpf", (a, b), 1)) == [BASE, "a", "b"]
    assert names(variant_order("meshagent-ebpf", (a, b), 2)) == ["b", "a", BASE]
    assert names(variant_order("meshagent-ebpf-xnode", (a,), 3)) == [BASE, "a"]
    assert names(variant_order("haproxy-http", (a, b), 1)) == [BASE]
    assert names(variant_order("meshagent-ebpf", (), 2)) == [BASE]


def test_missing_env_reads_what_a_real_process_was_started_with():
    env = {"MESHAGENT_BENCH_PROBE": "on", "PATH": "/usr/bin:/bin"}
    script = "import time; print('up', flush=True); time.sleep(30)"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "up\n"  # past exec: its environment is in place
        assert missing_env([proc.pid], (("MESHAGENT_BENCH_PROBE", "on"),)) == []
        assert missing_env([proc.pid], (("MESHAGENT_BENCH_PROBE", "off"),)) == [
            "MESHAGENT_BENCH_PROBE=off"
        ]
        assert missing_env([proc.pid], (("OTHER", "1"),)) == ["OTHER=1"]
        assert missing_env([proc.pid], ()) == []
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_interpreted_workers_names_the_workers_that_did_not_load_the_native_build(monkeypatch):
    """Rule 9, on real processes: a worker (by its command line) that imported the
    request path with the build switched off is named; one that loaded it, and a
    process that is not a worker, are not."""
    assert native.state() == "active", "stale or missing build: run `bash scripts/setup`"
    script = "import agent.proxy.h1fast, time; print('up', flush=True); time.sleep(30)"
    base = {k: v for k, v in os.environ.items() if k != native.ENV}
    started = [
        ([sys.executable, "-c", script, "agent.proxy.worker"], base),
        ([sys.executable, "-c", script, "agent.proxy.worker"], {**base, native.ENV: "0"}),
        ([sys.executable, "-c", script, "not-a-worker"], {**base, native.ENV: "0"}),
    ]
    procs = [subprocess.Popen(a, env=e, stdout=subprocess.PIPE, text=True) for a, e in started]
    try:
        for proc in procs:
            assert proc.stdout.readline() == "up\n"  # the request path is imported
        compiled, plain, other = (p.pid for p in procs)
        assert interpreted_workers([compiled, plain, other]) == [plain]
        assert interpreted_workers([compiled]) == []
        # Judged by the build as the run started, not as each setup starts: a module
        # edited mid-run makes the build stale, and the agents started then run plain.
        monkeypatch.setattr(native, "state", lambda: "stale")
        monkeypatch.delenv(native.ENV, raising=False)
        started_current = Options(native_current=True)
        assert f"workers [{plain}] run interpreted" in interpreted_error(
            started_current, [compiled, plain]
        )
        assert interpreted_error(Options(native_current=False), [plain]) == ""
        assert interpreted_error(Options(), [plain]) == ""  # not read: `run` reads it
        # Switched off for the agents started now (`--profile` does): they run plain.
        monkeypatch.setenv(native.ENV, "0")
        assert interpreted_error(started_current, [plain]) == ""
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_the_cli_names_a_bad_variant_and_starts_nothing():
    argv = [sys.executable, "-m", "agent", "bench", "--variant", "x:1A=2"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "--variant='x:1A=2': --variant x: '1A=2' is not KEY=VALUE" in done.stderr


def test_saturation_in_turns_runs_in_full_runs_on_the_judged_setups_but_sockmaps():
    assert "saturate-side" in ALL_LOADS
    assert "saturate-side" not in Options.make(quick=True).loads
    assert "saturate-side" in Options.make(quick=False).loads
    # named, `http1-saturate` stays the sequential load alone
    assert Options.make(quick=False, loads_="http1-saturate").loads == ("http1-saturate",)
    assert harness.saturate_side_by_side("meshagent-iptables-xnode")
    assert not harness.saturate_side_by_side("meshagent-ebpf-accel")
    assert not harness.saturate_side_by_side("haproxy-http")


def test_a_side_peer_that_answered_nothing_carries_the_end_of_its_logs(tmp_path):
    """A peer whose turns got no answer (and, in a short turn, no error) says why in its
    side entry: HAProxy logs only the abnormal connections (haproxy rule 3)."""
    client, server = tmp_path / "c.log", tmp_path / "s.log"
    client.write_text("10.0.0.2:1 [x] http http/s1 1/-1/3009 0 SC 1/1/0/0/3 0/0\n")
    server.write_text("")  # said nothing: not quoted
    peer = Target(
        setup="haproxy-tls", client=None, host="127.0.0.1", http_port=18080, iperf_port=0,
        hops=2, mtls=True, logs=[client, server],
    )  # fmt: skip
    silent = harness._side_rates(peer, Measured(requests=0, elapsed_s=2.0))
    assert silent["requests"] == 0
    assert silent["rps"] is None
    assert silent["logs"] == f"its log ({client}): " + client.read_text().strip()
    answered = harness._side_rates(peer, Measured(requests=10, elapsed_s=2.0))
    assert "logs" not in answered
    assert answered["rps"] == 5.0
    quiet = dataclasses.replace(peer, logs=[server])
    assert harness._side_rates(quiet, Measured())["logs"] == "(its logs are empty)"
