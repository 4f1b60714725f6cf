"""Parsers of the load tools' output, on output recorded from the real tools; what a load
refuses before it runs."""

from __future__ import annotations

import json

import pytest

from agent.bench import loads
from agent.bench.hist import Histogram
from agent.bench.topology import Target

WRK = """Running 2s test @ http://10.200.1.3:8080/
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.04ms    1.15ms  24.59ms   93.19%
    Req/Sec    28.31k     3.60k   35.03k    70.00%
  Latency Distribution
     50%  680.00us
     75%    1.04ms
     90%    1.97ms
     99%    5.43ms
  112647 requests in 2.00s, 7.09MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
Requests/sec:  56317.00
Transfer/sec:      3.54MB
"""

H2LOAD = """starting benchmark...
finished in 2.00s, 14544.00 req/s, 312.63KB/s
requests: 29088 total, 29152 started, 29088 done, 29080 succeeded, 8 failed, 0 errored, 0 timeout
status codes: 29080 2xx, 0 3xx, 0 4xx, 0 5xx
"""


def test_wrk_requests_duration_percentiles_and_errors():
    m = loads.from_wrk(WRK)
    assert m.requests == 112647
    assert m.elapsed_s == 2.0
    assert m.p50_ms == pytest.approx(0.68)
    assert m.p99_ms == pytest.approx(5.43)
    assert m.errors == 4
    assert m.rps == pytest.approx(56323.5)


def test_h2load_succeeded_and_failed():
    m = loads.from_h2load(H2LOAD)
    assert (m.requests, m.errors, m.elapsed_s) == (29080, 8, 2.0)


def test_iperf3_bytes_and_gbps():
    text = json.dumps({"end": {"sum_received": {"bytes": 2_000_000_000, "seconds": 2.0}}})
    m = loads.from_iperf3(text)
    assert m.gbps == pytest.approx(8.0)


def test_loadgen_json_gives_percentiles_in_ms():
    h = Histogram()
    for v in range(1, 1001):
        h.record(v)
    text = json.dumps({"requests": 1000, "errors": 0, "elapsed_s": 1.0, "hist": h.to_dict()})
    m = loads.from_loadgen(text)
    assert m.rps == 1000
    assert m.p999_ms == pytest.approx(h.percentile(99.9) / 1000)


def test_unreadable_output_raises_value_error():
    with pytest.raises(ValueError, match="requests in"):
        loads.from_wrk("unable to connect")
    with pytest.raises(ValueError, match="iperf3"):
        loads.from_iperf3(json.dumps({"error": "unable to connect to server"}))


def test_side_json_gives_each_paths_measured_with_its_warm_up():
    h = Histogram()
    for v in (100, 200, 300):
        h.record(v)
    one = {"requests": 3, "errors": 0, "elapsed_s": 1.0, "hist": h.to_dict()}
    text = json.dumps({"paths": {"direct": {**one, "warmup_requests": 2}, "b": one}})
    got = loads.from_side(text)
    assert set(got) == {"direct", "b"}
    assert (got["direct"].requests, got["direct"].warmup_requests) == (3, 2)
    assert got["b"].p50_ms == pytest.approx(h.percentile(50) / 1000)


def test_tcp_side_refuses_a_path_without_an_echo_port_before_it_starts_anything():
    def target(setup: str, echo_port: int) -> Target:
        # no pod: the load must fail before it runs anything in one
        return Target(
            setup=setup, client=None, host="10.0.0.1", http_port=8080, echo_port=echo_port,
            iperf_port=0, hops=0, mtls=False,
        )  # fmt: skip

    targets = [target("direct", 7081), target("haproxy-http", 0)]
    with pytest.raises(loads.LoadError, match="load tcp-side-1000: no echo port on haproxy-http"):
        loads.tcp_side(targets, 1000, 1.0, 0.0)


def test_the_post_script_makes_wrk_send_bodies_of_the_size_asked():
    script = loads.post_script(1024)
    assert 'wrk.method = "POST"' in script
    assert 'string.rep("x", 1024)' in script
    assert loads.POST_BODY_BYTES == 1024


def test_saturation_turns_go_forward_then_backward_so_each_path_leads_as_often():
    assert loads.turns(2, 4) == [0, 1, 1, 0, 0, 1, 1, 0]
    assert loads.turns(3, 2) == [0, 1, 2, 2, 1, 0]
    order = loads.turns(3, 4)
    firsts = [order[i * 3] for i in range(4)]
    assert sorted(firsts) == [0, 0, 2, 2]
    assert order.count(1) == 4


def test_a_paths_turns_merge_into_summed_counts_and_median_percentiles():
    parts = [
        loads.Measured(requests=100, errors=1, elapsed_s=2.0, p50_ms=1.0, p99_ms=5.0),
        loads.Measured(requests=300, errors=0, elapsed_s=2.0, p50_ms=3.0, p99_ms=4.0),
        loads.Measured(requests=200, errors=2, elapsed_s=2.0, p50_ms=2.0, p99_ms=None),
    ]
    m = loads.merged(parts)
    assert (m.requests, m.errors, m.elapsed_s) == (600, 3, 6.0)
    assert m.rps == 100.0
    assert (m.p50_ms, m.p99_ms) == (2.0, 5.0)
