"""The worker pool with real worker processes, listeners inside a real network namespace.

Topology: a namespace made here (`ip netns add`, lo up) stands for a pod. An
echo server listens on its 127.0.0.1; the pool's workers accept on listeners
opened in it and relay (from sockets created in it) to the echo server, whose
address they get as state (`proxy_worker_plugin.py`). Clients connect from
inside the namespace too.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from agent import netlab
from agent.errors import PoolError
from agent.proxy import placement, sched
from agent.proxy.channel import Need, StateUpdate
from agent.proxy.listener import (
    ListenerError,
    ListenerKind,
    UpstreamSockets,
    open_listener,
    open_pod_listeners,
    upstream_socket,
)
from agent.proxy.pool import WorkerOptions, WorkerPool
from agent.redirect import netns

pytestmark = pytest.mark.privileged

PLUGIN = str(Path(__file__).with_name("proxy_worker_plugin.py"))
# glibc's starting thresholds (mallopt(3): 128 KiB each), fixed: without its dynamic raise,
# whose effect depends on the order of a stream's block sizes
GLIBC_STARTING_THRESHOLDS = "glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072"
OUT_PORT = 4140


@pytest.fixture
def pod_netns():
    name = f"ma-pool-{os.getpid()}-{time.monotonic_ns() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield str(netns.named_path(name))
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


class _Echo(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # answer EOF with EOF


@pytest.fixture
async def echo_port(pod_netns):
    sock = netns.socket_in(pod_netns)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    server = await asyncio.get_running_loop().create_server(_Echo, sock=sock)
    yield sock.getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest.fixture
async def make_pool():
    pools: list[WorkerPool] = []

    async def make(  # noqa: PLR0913 - the worker options the tests vary
        n: int,
        plugins: tuple[str, ...] = (PLUGIN,),
        *,
        cpus: tuple[int, ...] = (),
        pin: bool = False,
        steer: bool = True,
        slice_s: float | None = None,
        **kw,
    ) -> WorkerPool:
        options = WorkerOptions(
            plugins=plugins,
            stats_interval_s=0.1,
            grace_s=5.0,
            cpus=cpus,
            pin=pin,
            steer=steer,
            slice_s=slice_s,
        )
        pool = WorkerPool(n, options=options, **kw)
        pools.append(pool)
        await pool.start(ready_timeout=15)
        return pool

    yield make
    for pool in pools:
        await pool.close()


@pytest.fixture
def clients():
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


async def _serve(pool: WorkerPool, pod_netns: str, echo_port: int, port=OUT_PORT, lid="out"):
    pool.broadcast(StateUpdate(key="test-target", value=("127.0.0.1", echo_port)))
    sock = open_listener(pod_netns, "127.0.0.1", port)
    pool.add_listener(
        listener_id=lid, pod="shop/web-1", kind=ListenerKind.OUTBOUND, netns=pod_netns, socks=[sock]
    )


async def _serve_per_worker(pool: WorkerPool, pod_netns: str, echo_port: int) -> None:
    """As `_serve`, with one SO_REUSEPORT socket per worker slot (the supervisor's way)."""
    pool.broadcast(StateUpdate(key="test-target", value=("127.0.0.1", echo_port)))
    socks = [open_listener(pod_netns, "127.0.0.1", OUT_PORT, reuseport=True) for _ in range(pool.n)]
    pool.add_listener(
        listener_id="out",
        pod="shop/web-1",
        kind=ListenerKind.OUTBOUND,
        netns=pod_netns,
        socks=socks,
    )


async def _connect(pod_netns: str, clients: list, port: int = OUT_PORT) -> socket.socket:
    sock = await netns.run_in_async(pod_netns, socket.socket)
    clients.append(sock)
    sock.setblocking(False)
    async with asyncio.timeout(5):
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _echo(sock: socket.socket, data: bytes, within: float = 5.0) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, data)
    got = bytearray()
    async with asyncio.timeout(within):
        while len(got) < len(data):
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                break
            got += chunk
    return bytes(got)


async def _probe_dead(sock: socket.socket) -> bool:
    """One round trip: True if the peer closed or reset `sock`, False if it echoed."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(3.0):
            await loop.sock_sendall(sock, b"?")
            return await loop.sock_recv(sock, 1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


async def _dies_within(sock: socket.socket, within: float) -> bool:
    """True if `sock` is closed or reset by its peer within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if await _probe_dead(sock):
            return True
        await asyncio.sleep(0.05)
    return False


async def _stats_until(pool: WorkerPool, pred, within: float = 5.0) -> dict:
    async with asyncio.timeout(within):
        while True:
            stats = {w.worker_id: w.stats for w in pool.workers}
            if all(stats.values()) and pred(stats):
                return stats
            await asyncio.sleep(0.05)


async def test_a_worker_that_cannot_start_fails_the_start_at_once(tmp_path):
    """Pool rule 8: a plugin that raises as it loads stops `start` with the reason, well
    before `READY_S`, and leaves no worker running."""
    plugin = tmp_path / "broken.py"
    plugin.write_text('raise RuntimeError("broken plugin")\n')
    pool = WorkerPool(2, options=WorkerOptions(plugins=(str(plugin),), grace_s=1.0))
    started = time.monotonic()
    try:
        with pytest.raises(PoolError, match="exited with status 1 before it was ready, 2 times"):
            await pool.start(ready_timeout=30)
        assert time.monotonic() - started < 10
        # what stopped the start: the plugin's exits, one slot's twice at least
        failed = list(pool.exits)
        assert len(failed) >= 2
        assert all(record.status == 1 for record in failed)
    finally:
        await pool.close()
    assert pool.pids == []
    # a slot's worker still loading when the start failed is killed by `close`
    assert all(record.status == -signal.SIGKILL for record in list(pool.exits)[len(failed) :])


async def test_a_worker_that_dies_once_while_starting_is_replaced_and_the_start_goes_on(
    tmp_path,
):
    """Pool rule 8: one death while starting (here the first worker to load the plugin
    exits, as one the OOM killer took would) costs a replacement, not the agent."""
    marker = tmp_path / "died-once"
    plugin = tmp_path / "first_dies.py"
    plugin.write_text(
        "import os\n"
        # the first to create the marker dies; O_EXCL makes "first" one worker even
        # when both load the plugin at once
        "try:\n"
        f"    fd = os.open({str(marker)!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)\n"
        "except FileExistsError:\n"
        "    pass\n"
        "else:\n"
        "    os.write(fd, str(os.getpid()).encode())\n"
        "    os._exit(3)\n"
    )
    pool = WorkerPool(2, options=WorkerOptions(plugins=(str(plugin),), grace_s=1.0))
    try:
        await pool.start(ready_timeout=30)
        assert [record.status for record in pool.exits] == [3]
        assert pool.exits[0].pid == int(marker.read_text())
        assert len(pool.pids) == 2
        assert pool.exits[0].pid not in pool.pids
    finally:
        await pool.close()
    assert pool.pids == []


async def test_both_workers_accept_and_relay_to_the_echo_server(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve(pool, pod_netns, echo_port)

    async def one(i: int) -> None:
        sock = await _connect(pod_netns, clients)
        assert await _echo(sock, b"ping %d" % i) == b"ping %d" % i
        sock.close()

    for batch in range(10):
        await asyncio.gather(*(one(batch * 20 + i) for i in range(20)))
    stats = await _stats_until(pool, lambda s: sum(x.accepted_total for x in s.values()) == 200)
    per_worker = {wid: s.accepted_total for wid, s in stats.items()}
    assert all(n > 0 for n in per_worker.values()), per_worker
    assert sum(s.failed_total for s in stats.values()) == 0


async def test_per_worker_listeners_spread_a_burst_of_connections_over_the_workers(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve_per_worker(pool, pod_netns, echo_port)
    # 64 connections opened at once and kept, as a load generator does: each worker gets
    # its share (one of two sockets per connection; fewer than 16 of 64 has p ~ 3e-5).
    socks = await asyncio.gather(*(_connect(pod_netns, clients) for _ in range(64)))
    for i, sock in enumerate(socks):
        assert await _echo(sock, b"burst %d" % i) == b"burst %d" % i
    stats = await _stats_until(pool, lambda s: sum(x.open_connections for x in s.values()) == 64)
    per_worker = {wid: s.open_connections for wid, s in stats.items()}
    assert all(n >= 16 for n in per_worker.values()), per_worker
    assert all(s.listeners == 1 for s in stats.values())
    assert pool.serving
    for sock in socks:
        sock.close()
    await _stats_until(pool, lambda s: sum(x.open_connections for x in s.values()) == 0)
    assert not pool.serving  # the supervisor's loop-lag probe naps a whole window again


async def test_a_replaced_worker_takes_over_its_slots_socket_and_nothing_queued_is_lost(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve_per_worker(pool, pod_netns, echo_port)
    await _stats_until(pool, lambda s: all(x.listeners == 1 for x in s.values()))
    victim = next(w for w in pool.workers if w.worker_id == 0)
    os.kill(victim.pid, signal.SIGKILL)  # a PID this test's pool started
    # Connect at once, while slot 0 has no worker: those the kernel gives slot 0's socket
    # wait in its backlog and are served by the replacement.
    socks = await asyncio.gather(*(_connect(pod_netns, clients) for _ in range(24)))
    for i, sock in enumerate(socks):
        assert await _echo(sock, b"queued %d" % i, within=5.0) == b"queued %d" % i
    stats = await _stats_until(
        pool, lambda s: sum(x.open_connections for x in s.values()) == 24, within=5.0
    )
    replacement = next(w for w in pool.workers if w.worker_id == 0)
    assert replacement.pid != victim.pid
    assert stats[0].listeners == 1
    assert stats[0].accepted_total > 0  # slot 0's socket is the replacement's


def _two_cpus() -> tuple[int, int]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("steering by CPU needs two CPUs")
    return cpus[0], cpus[1]


def _connect_blocking(pod_netns: str, port: int) -> socket.socket:
    sock = netns.socket_in(pod_netns)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


@pytest.mark.parametrize("pin", [False, True], ids=["steer", "pin"])
async def test_placed_workers_take_the_connections_made_on_their_cpus(
    make_pool, pod_netns, echo_port, clients, pin
):
    """agent.proxy.placement: slot i takes what is made on CPU i, the group steered by
    CPU; with `pin` it also runs there only, and so does a replacement."""
    cpus = _two_cpus()
    pool = await make_pool(2, cpus=cpus, pin=pin)
    assert {w.worker_id: (w.cpu, w.pinned) for w in pool.workers} == {
        0: (cpus[0], pin),
        1: (cpus[1], pin),
    }
    anywhere = netlab.allowed_cpus(os.getpid())
    assert {w.worker_id: netlab.allowed_cpus(w.pid) for w in pool.workers} == {
        0: str(cpus[0]) if pin else anywhere,
        1: str(cpus[1]) if pin else anywhere,
    }
    assert pool.steering is not None
    pool.broadcast(StateUpdate(key="test-target", value=("127.0.0.1", echo_port)))
    listeners = open_pod_listeners(pod_netns, copies=2, steering=pool.steering)
    inbound = listeners.inbound
    pool.add_listener(
        listener_id="out", pod="shop/web-1", kind=ListenerKind.OUTBOUND, netns=pod_netns,
        socks=list(listeners.outbound),
    )  # fmt: skip
    for sock in inbound:
        sock.close()
    await _stats_until(pool, lambda s: all(x.listeners == 1 for x in s.values()))
    # 12 from the first CPU, then 8 from the second: each lot to the worker there only
    # (by hash, 12 of 12 on one worker has p ~ 5e-4).
    for slot, n in ((0, 12), (1, 8)):
        for _ in range(n):
            sock = await asyncio.to_thread(
                netlab.on_cpu, cpus[slot], _connect_blocking, pod_netns, 4140
            )
            clients.append(sock)
            sock.setblocking(False)
            assert await _echo(sock, b"on %d" % slot) == b"on %d" % slot
    stats = await _stats_until(pool, lambda s: sum(x.accepted_total for x in s.values()) == 20)
    assert {wid: s.accepted_total for wid, s in stats.items()} == {0: 12, 1: 8}
    victim = next(w for w in pool.workers if w.worker_id == 1)
    os.kill(victim.pid, signal.SIGKILL)  # a PID this test's pool started
    async with asyncio.timeout(5):
        while True:
            new = [w for w in pool.workers if w.worker_id == 1 and w.pid != victim.pid]
            if new and new[0].ready:
                break
            await asyncio.sleep(0.05)
    assert netlab.allowed_cpus(new[0].pid) == (str(cpus[1]) if pin else anywhere)


async def test_a_pool_with_more_workers_than_cpus_is_not_steered(make_pool):
    cpus = _two_cpus()
    pool = await make_pool(3, cpus=cpus, pin=True)
    assert [w.cpu for w in sorted(pool.workers, key=lambda w: w.worker_id)] == [*cpus, cpus[0]]
    assert pool.steering is None  # two slots on the first CPU: the kernel's hash spreads


async def test_bound_workers_run_on_their_cpus_and_leave_connections_to_the_hash(make_pool):
    """`--cpu-placement bind`: pinned as with `pin`, no steering program."""
    cpus = _two_cpus()
    pool = await make_pool(2, cpus=cpus, pin=True, steer=False)
    workers = sorted(pool.workers, key=lambda w: w.worker_id)
    assert [netlab.allowed_cpus(w.pid) for w in workers] == [str(c) for c in cpus]
    assert pool.steering is None


@pytest.mark.skipif(
    sched.slice_of(os.getpid()) is None, reason="the kernel reports no slice (Linux < 6.12)"
)
async def test_workers_run_on_the_slice_they_are_given_and_on_the_kernels_without(make_pool):
    """agent.proxy.pool rule 9, read back from /proc/PID/sched."""
    pool = await make_pool(2, slice_s=0.0002)
    assert [sched.slice_of(w.pid) for w in pool.workers] == [200_000, 200_000]
    plain = await make_pool(1)
    assert sched.slice_of(plain.workers[0].pid) == sched.slice_of(os.getpid()) != 200_000


def test_a_steered_group_falls_back_to_the_hash_on_a_cpu_without_a_slot(pod_netns):
    """The kernel side of agent.proxy.placement rule 2, on real sockets."""
    cpus = _two_cpus()
    program = placement.steering_program({cpus[0]: 1})  # only the first CPU has a slot
    listeners = open_pod_listeners(pod_netns, copies=2, steering=program)
    socks: list[socket.socket] = []
    try:
        group = listeners.outbound
        for sock in group:
            sock.setblocking(True)
            sock.settimeout(5)

        def taken_by(cpu: int) -> int:
            socks.append(netlab.on_cpu(cpu, _connect_blocking, pod_netns, 4140))
            ready = select.select(group, [], [], 5)[0]
            assert len(ready) == 1, ready
            conn, _ = ready[0].accept()
            conn.close()
            return group.index(ready[0])

        assert {taken_by(cpus[0]) for _ in range(10)} == {1}  # steered to slot 1
        assert len(socks) == 10
        spread = {taken_by(cpus[1]) for _ in range(24)}  # no slot: by hash, both (p ~ 1e-7)
        assert spread == {0, 1}
    finally:
        for sock in socks:
            sock.close()
        listeners.close()


async def test_a_listener_needs_one_socket_or_one_per_worker(make_pool, pod_netns):
    pool = await make_pool(2)
    socks = [open_listener(pod_netns, "127.0.0.1", OUT_PORT, reuseport=True) for _ in range(3)]
    try:
        with pytest.raises(ValueError, match="3 sockets for 2 workers"):
            pool.add_listener(
                listener_id="out", pod="shop/web-1", kind=ListenerKind.OUTBOUND,
                netns=pod_netns, socks=socks,
            )  # fmt: skip
        assert pool.listener_ids == []
    finally:
        for sock in socks:
            sock.close()


async def test_killed_worker_is_replaced_quickly_and_only_its_connections_are_lost(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve(pool, pod_netns, echo_port)
    socks = [await _connect(pod_netns, clients) for _ in range(30)]
    for i, sock in enumerate(socks):
        assert await _echo(sock, b"hello %d" % i) == b"hello %d" % i
    stats = await _stats_until(pool, lambda s: sum(x.open_connections for x in s.values()) == 30)
    victim = next(w for w in pool.workers if stats[w.worker_id].open_connections > 0)
    doomed = stats[victim.worker_id].open_connections

    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)  # a PID this test's pool started
    async with asyncio.timeout(2.0):
        while not any(  # noqa: ASYNC110 - polling another process
            w.worker_id == victim.worker_id and w.pid != victim.pid and w.ready
            for w in pool.workers
        ):
            await asyncio.sleep(0.01)
    assert time.monotonic() - t0 < 2.0
    assert pool.restarts == 1
    assert pool.exits[-1].pid == victim.pid
    assert pool.exits[-1].status == -signal.SIGKILL

    dead = [await _probe_dead(sock) for sock in socks]
    assert sum(dead) == doomed
    for i, sock in enumerate(socks):
        if not dead[i]:
            assert await _echo(sock, b"still %d" % i) == b"still %d" % i

    # The replacement got the listener and the state: it serves new connections.
    await _stats_until(pool, lambda s: s[victim.worker_id].listeners == 1)
    for i in range(20):
        sock = await _connect(pod_netns, clients)
        assert await _echo(sock, b"new %d" % i) == b"new %d" % i


async def test_removed_listener_stops_accepting_and_drains_its_connections(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve(pool, pod_netns, echo_port)
    await _serve(pool, pod_netns, echo_port, port=4141, lid="old")
    old_conn = await _connect(pod_netns, clients, port=4141)
    assert await _echo(old_conn, b"before") == b"before"

    assert pool.remove_listener("old", drain_s=1.0)
    assert pool.listener_ids == ["out"]
    # Within its drain time the old connection still works...
    assert await _echo(old_conn, b"draining") == b"draining"
    # ...new connections to the old port are refused once every worker closed it...
    async with asyncio.timeout(3):
        while True:
            try:
                await _connect(pod_netns, clients, port=4141)
            except ConnectionRefusedError:
                break
            await asyncio.sleep(0.05)
    # ...and after the drain time the old connection is cut.
    assert await _dies_within(old_conn, within=3.0)
    sock = await _connect(pod_netns, clients)
    assert await _echo(sock, b"other listener") == b"other listener"


async def _slow_transfer(sock: socket.socket, chunks: int, pause: float) -> bytes:
    got = b""
    for i in range(chunks):
        got += await _echo(sock, b"chunk %02d;" % i)
        await asyncio.sleep(pause)
    sock.shutdown(socket.SHUT_WR)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        assert await loop.sock_recv(sock, 1) == b""  # the relay passed our EOF and closed
    return got


async def test_drain_lets_a_slow_transfer_finish_then_workers_exit_zero(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(2)
    await _serve(pool, pod_netns, echo_port)
    sock = await _connect(pod_netns, clients)
    transfer = asyncio.ensure_future(_slow_transfer(sock, chunks=10, pause=0.1))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    statuses = await pool.drain(grace=5.0)
    elapsed = time.monotonic() - t0
    got = await transfer
    assert got == b"".join(b"chunk %02d;" % i for i in range(10))
    assert sorted(statuses.values()) == [0, 0]
    assert 0.5 < elapsed < 5.0  # waited for the transfer, not for the whole grace
    assert pool.pids == []


async def test_sigterm_drains_one_worker_which_exits_zero_and_is_replaced(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(1)
    await _serve(pool, pod_netns, echo_port)
    sock = await _connect(pod_netns, clients)
    assert await _echo(sock, b"hi") == b"hi"
    (pid,) = pool.pids
    transfer = asyncio.ensure_future(_slow_transfer(sock, chunks=6, pause=0.1))
    await asyncio.sleep(0.1)
    os.kill(pid, signal.SIGTERM)  # a PID this test's pool started
    got = await transfer
    assert got == b"".join(b"chunk %02d;" % i for i in range(6))
    async with asyncio.timeout(5):
        while not (pool.exits and pool.exits[-1].pid == pid):  # noqa: ASYNC110 - another process
            await asyncio.sleep(0.02)
    assert pool.exits[-1].status == 0
    await pool.wait_ready(timeout=5)
    assert pool.pids != [pid]


async def test_handler_exception_ends_only_its_own_connection(
    make_pool, pod_netns, echo_port, clients
):
    pool = await make_pool(1)  # one worker: every connection is on the same process
    await _serve(pool, pod_netns, echo_port)
    await _serve(pool, pod_netns, echo_port, port=4142, lid="boom")
    (pid,) = pool.pids
    good = await _connect(pod_netns, clients)
    assert await _echo(good, b"one") == b"one"
    for _ in range(5):
        bad = await _connect(pod_netns, clients, port=4142)
        assert await _dies_within(bad, within=3.0)
    assert await _echo(good, b"two") == b"two"
    assert pool.pids == [pid]
    stats = await _stats_until(pool, lambda s: s[0].failed_total == 5)
    assert stats[0].accepted_total == 6


async def test_worker_need_reaches_the_supervisor_and_state_answers_it(
    make_pool, pod_netns, echo_port, clients
):
    needs: list[tuple[int, Need]] = []
    pool: WorkerPool | None = None

    def on_need(worker_id: int, need: Need) -> None:
        needs.append((worker_id, need))
        assert pool is not None
        pool.broadcast(StateUpdate(key=need.key, value="open"))

    pool = await make_pool(1, on_need=on_need)
    await _serve(pool, pod_netns, echo_port, port=4144, lid="need")
    sock = await _connect(pod_netns, clients, port=4144)
    assert await _echo(sock, b"after need") == b"after need"
    assert needs == [(0, Need(kind="test", key="need-gate"))]


SO_NETNS_COOKIE = 71  # linux/asm-generic/socket.h; Python has no constant for it


def _cookie(sock: socket.socket) -> int:
    return int.from_bytes(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8), "little")


def _listening(pod_netns: str) -> str:
    """`ss -ltnH` inside the pod's namespace."""
    argv = ["ip", "netns", "exec", Path(pod_netns).name, "ss", "-ltnH"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_pod_listeners_are_bound_inside_the_pod_namespace(pod_netns):
    listeners = open_pod_listeners(pod_netns, outbound_port=4140, inbound_port=4143)
    probe = netns.socket_in(pod_netns)
    host = socket.socket()
    try:
        (outbound,), (inbound,) = listeners.outbound, listeners.inbound
        assert _cookie(outbound) == _cookie(probe) != _cookie(host)
        assert _cookie(inbound) == _cookie(probe)
        assert outbound.getsockname() == ("127.0.0.1", 4140)
        assert inbound.getsockname() == ("0.0.0.0", 4143)
        assert outbound.getblocking() is False
        assert outbound.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        assert outbound.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0  # alone
        out = _listening(pod_netns)
        backlogs = {line.split()[3]: int(line.split()[2]) for line in out.splitlines()}
        assert backlogs == {"127.0.0.1:4140": 1024, "0.0.0.0:4143": 1024}
    finally:
        listeners.close()
        probe.close()
        host.close()


def test_pod_listeners_for_n_workers_are_a_reuseport_group_of_n_per_side(pod_netns):
    listeners = open_pod_listeners(pod_netns, outbound_port=4140, inbound_port=4143, copies=3)
    try:
        assert len(listeners.outbound) == len(listeners.inbound) == 3
        for sock in (*listeners.outbound, *listeners.inbound):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        assert {s.getsockname() for s in listeners.outbound} == {("127.0.0.1", 4140)}
        assert {s.getsockname() for s in listeners.inbound} == {("0.0.0.0", 4143)}
        out = _listening(pod_netns)
        bound = sorted(line.split()[3] for line in out.splitlines())
        assert bound == ["0.0.0.0:4143"] * 3 + ["127.0.0.1:4140"] * 3
    finally:
        listeners.close()
    with pytest.raises(ValueError, match="at least one socket"):
        open_pod_listeners(pod_netns, copies=0)


def test_a_reuseport_group_is_not_opened_on_a_port_another_reuseport_socket_holds(pod_netns):
    other = netns.socket_in(pod_netns)  # someone else's SO_REUSEPORT listener on 4140
    try:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 4140))
        other.listen(8)
        with pytest.raises(ListenerError, match=f"netns {pod_netns}: listen 127.0.0.1:4140"):
            open_pod_listeners(pod_netns, outbound_port=4140, inbound_port=4143, copies=2)
        assert "4143" not in _listening(pod_netns)  # nothing was left open
    finally:
        other.close()
    listeners = open_pod_listeners(pod_netns, outbound_port=4140, inbound_port=4143, copies=2)
    listeners.close()  # once it is gone, the group opens


def test_listener_port_in_use_raises_listener_error_naming_the_namespace(pod_netns):
    first = open_listener(pod_netns, "127.0.0.1", 4150)
    try:
        with pytest.raises(ListenerError, match=f"netns {pod_netns}: listen 127.0.0.1:4150"):
            open_listener(pod_netns, "127.0.0.1", 4150)
    finally:
        first.close()


async def test_upstream_sockets_are_marked_and_in_the_pod_namespace(pod_netns):
    probe = netns.socket_in(pod_netns)
    upstreams = UpstreamSockets(0x539)
    one = upstream_socket(pod_netns, 0x539)
    try:
        socks = [await upstreams.get(pod_netns) for _ in range(UpstreamSockets.BATCH * 2 + 1)]
        for sock in [one, *socks]:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == 0x539
            assert _cookie(sock) == _cookie(probe)
            assert sock.getblocking() is False
            sock.close()
    finally:
        upstreams.close()
        probe.close()


async def test_worker_whose_supervisor_channel_closes_drains_and_exits_zero(make_pool):
    pool = await make_pool(1)
    (proc,) = pool._procs.values()
    pool._closing = True  # no replacement: we only watch the orphan's way out
    assert proc.channel is not None
    proc.channel.close()  # as if the supervisor were gone
    async with asyncio.timeout(5):
        status = await proc.exited
    assert status == 0


async def test_default_handler_relays_a_redirected_connection_to_its_original_destination(
    make_pool, pod_netns, clients
):
    """The real outbound path: iptables REDIRECT, SO_ORIGINAL_DST, a marked upstream socket."""

    def in_pod(*argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", Path(pod_netns).name, *argv], check=True)

    in_pod("ip", "addr", "add", "10.9.9.9/32", "dev", "lo")
    # Capture the app's connections to 10.9.9.9:80, but not the proxy's own (marked) ones.
    in_pod(
        "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "10.9.9.9",
        "--dport", "80", "-m", "mark", "!", "--mark", "0x539",
        "-j", "REDIRECT", "--to-ports", str(OUT_PORT),
    )  # fmt: skip
    service = netns.socket_in(pod_netns)
    service.bind(("10.9.9.9", 80))
    service.listen(16)
    service.setblocking(False)
    server = await asyncio.get_running_loop().create_server(_Echo, sock=service)
    try:
        pool = await make_pool(1, plugins=())  # no plugin: the default handler and resolver
        sock = open_listener(pod_netns, "127.0.0.1", OUT_PORT)
        pool.add_listener(
            listener_id="out", pod="shop/web-1", kind=ListenerKind.OUTBOUND,
            netns=pod_netns, socks=[sock],
        )  # fmt: skip
        app = await netns.run_in_async(pod_netns, socket.socket)
        clients.append(app)
        app.setblocking(False)
        await asyncio.get_running_loop().sock_connect(app, ("10.9.9.9", 80))
        assert await _echo(app, b"via the proxy") == b"via the proxy"
        # A direct connection to the listener resolves to itself and is refused.
        direct = await _connect(pod_netns, clients)
        assert await _dies_within(direct, within=3.0)
        stats = await _stats_until(
            pool, lambda s: s[0].accepted_total == 2 and s[0].failed_total == 1
        )
        assert stats[0].open_connections == 1  # the app's relay, still open
    finally:
        server.close()
        await server.wait_closed()


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:  # noqa: PTH123 - a /proc read
        return int(f.read().rsplit(")", 1)[1].split()[7])


async def _both_ways(sock: socket.socket, total: int) -> None:
    """Send `total` bytes through the echo relay while reading them back."""
    loop = asyncio.get_running_loop()
    chunk = bytes(1 << 20)

    async def send() -> None:
        for _ in range(total >> 20):
            await loop.sock_sendall(sock, chunk)

    async def receive() -> None:
        got = 0
        async with asyncio.timeout(30):
            while got < total:
                data = await loop.sock_recv(sock, 1 << 20)
                assert data, "the relay ended early"
                got += len(data)

    await asyncio.gather(send(), receive())


async def _relay_faults_per_mib(make_pool, pod_netns: str, echo_port: int, clients: list) -> float:
    """The page faults per MiB of a worker relaying a bulk stream both ways."""
    pool = await make_pool(1)
    await _serve(pool, pod_netns, echo_port)
    sock = await _connect(pod_netns, clients)
    await _both_ways(sock, 8 << 20)  # warm: the heap grows to what a stream needs
    pid = pool.workers[0].pid
    before = _minor_faults(pid)
    await _both_ways(sock, 128 << 20)
    return (_minor_faults(pid) - before) / 128


async def test_a_workers_bulk_relay_reuses_its_heap_instead_of_faulting_pages_in(
    make_pool, pod_netns, echo_port, clients
):
    """Worker rule 10, read back from the kernel's count of the worker's page faults."""
    per_mib = await _relay_faults_per_mib(make_pool, pod_netns, echo_port, clients)
    assert per_mib < 4, per_mib


async def test_with_glibcs_own_thresholds_the_same_relay_faults_pages_in(
    make_pool, pod_netns, echo_port, clients, monkeypatch
):
    """With malloc tunables in `GLIBC_TUNABLES` the worker leaves malloc alone
    (agent.proxy.heap rule 3): what the test above is compared with, and proof that it
    can fail. The tunables fix glibc's starting thresholds; left to raise them itself,
    glibc faulted 2 to 52 pages per MiB between runs, as the blocks came; fixed, about 510
    (tuned: 0.5)."""
    monkeypatch.setenv("GLIBC_TUNABLES", GLIBC_STARTING_THRESHOLDS)
    per_mib = await _relay_faults_per_mib(make_pool, pod_netns, echo_port, clients)
    assert per_mib > 10, per_mib
