"""The opaque TCP side-by-side load (`tcp-side-N`: agent.bench.loads.tcp_side, loadgen
rule 6) over real sockets between two lab pods: the bench server's echo ports answer it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.bench import loads, topology

pytestmark = pytest.mark.privileged


def _echo_target(cli, host: str, port: int) -> topology.Target:
    """A path from `cli` straight to the echo port `port` (no proxy), named by it."""
    return topology.Target(
        setup=f"echo-{port}",
        client=cli,
        host=host,
        http_port=topology.HTTP_PORT,
        echo_port=port,
        iperf_port=0,
        hops=0,
        mtls=False,
    )


@pytest.mark.timeout(60)
def test_the_echo_load_takes_turns_on_every_echo_port_and_each_request_comes_back(lab):
    node = lab.node("n1")
    srv, cli = lab.pod(node, "srv"), lab.pod(node, "cli")
    argv = [sys.executable, "-m", "agent.bench.server", f"--port={topology.HTTP_PORT}"]
    argv += [f"--echo-port={port}" for port in topology.ECHO_PORTS]
    server = srv.spawn(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for port in topology.ECHO_PORTS:
        topology.wait_port(cli, srv.ip, port, proc=server)
    targets = [_echo_target(cli, srv.ip, port) for port in topology.ECHO_PORTS]
    # three paths of 0.3 s after a 0.1 s warm-up each: about a second of turns
    got = loads.tcp_side(targets, 500, 0.3, 0.1)
    assert set(got) == {t.setup for t in targets}
    for name, m in got.items():
        assert m.errors == 0, (name, m.error_kinds)
        assert m.requests == 150, name  # 500/s for 0.3 s, every one echoed in full
        assert m.warmup_requests == 50, name
        assert m.p50_ms is not None
        assert 0 < m.p50_ms <= m.p99_ms
    assert server.poll() is None  # the server took it all without failing
