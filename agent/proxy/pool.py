"""The supervisor's pool of proxy worker processes.

Rules:
1. Workers are started with `subprocess.Popen` (`python -m agent.proxy.worker`),
   never `fork`: the supervisor runs gRPC threads, and a forked child would
   inherit their locks mid-flight. The worker's channel end goes through
   `pass_fds`; nothing else is inherited.
2. The pool owns the listener sockets it is given and keeps every current
   listener and state value, so that a new worker gets all of them (state
   first, then listeners) before anything else. A listener is one socket
   shared by every worker, or one socket per worker slot (a SO_REUSEPORT
   group, agent.proxy.listener rule 2): slot i's worker, and each
   replacement of it, accepts on the i-th. While a slot's worker is being
   replaced, the connections the kernel sends to its socket wait in that
   socket's backlog for the replacement.
3. A worker's exit is seen through its pidfd (`os.pidfd_open` on the loop);
   it is reaped by its own `Popen`, and replaced at once (after a short
   backoff only if it keeps dying young): well within 2 s.
4. Signals go through the pidfd (`signal.pidfd_send_signal`), so the pool can
   only ever signal its own children, never a recycled PID.
5. Not thread-safe: call it from the loop it was started on (from gRPC
   threads use `loop.call_soon_threadsafe`).
6. A development hook, like the worker's `MESHAGENT_PROFILE_DIR`: a command in
   `MESHAGENT_WORKER_WRAP` (split as a shell would, no shell run) goes before each
   worker's argv, e.g. `valgrind --tool=callgrind ...` (agent.bench.callgrind). A
   wrapped worker may start many times slower, so `start` then waits up to
   `WRAPPED_READY_S` for it.
7. Placement (agent.proxy.placement): with `WorkerOptions.cpus`, slot i takes the
   connections made on slot i's CPU: `steering` is the program the supervisor puts on
   each listener group. With `WorkerOptions.pin` too, slot i's worker, and each
   replacement of it, pins itself to that CPU (`--cpu`). With `steer` off, there is
   no program (the kernel's hash spreads connections) and only the pinning is left.
8. `start` fails (`PoolError`) as soon as a slot's worker has exited `START_TRIES` times
   before it was ready (a plugin that does not load, a bad build): a worker that cannot
   start would only die again, so the agent stops with the reason instead of waiting
   out `READY_S`. A worker that dies once while starting (the OOM killer, a stray
   signal) is replaced, as after `start` (rule 3), and the start goes on.
9. `WorkerOptions.slice_s` (`meshagent run --worker-slice`): each worker asks the
   kernel for that scheduler slice as it starts (`--slice`, agent.proxy.sched); None
   passes nothing and the workers keep the kernel's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from agent.errors import PoolError
from agent.proxy import channel as ch
from agent.proxy import placement
from agent.redirect.model import PROXY_MARK

H2_UPGRADE_MODES = ("auto", "on", "off")  # `--h2-upgrade` (agent.proxy.h1toh2 rule 7)
H2_LANES = 4  # h2 connections per meshed endpoint per worker, with several workers (h2pool rule 2)
WRAP_ENV = "MESHAGENT_WORKER_WRAP"  # rule 6
READY_S = 10.0  # `start`: a worker says Ready within this
START_TRIES = 2  # rule 8: a slot's worker may die this many times less one while starting
WRAPPED_READY_S = 600.0  # rule 6: callgrind starts a worker about 40 s slower


def wrap_from_env() -> tuple[str, ...]:
    """The command put before each worker's argv (rule 6); empty when none is set."""
    return tuple(shlex.split(os.environ.get(WRAP_ENV, "")))


def h2_lanes_for(workers: int) -> int:
    """Lanes per endpoint for each of a node's `workers` (agent.proxy.h2pool rule 2): one
    when the node runs a single worker, `H2_LANES` otherwise."""
    return 1 if workers <= 1 else H2_LANES


if TYPE_CHECKING:
    import socket

    from agent.proxy.listener import ListenerKind

logger = logging.getLogger(__name__)

YOUNG_S = 1.0  # a worker dying younger than this counts towards backoff
MAX_BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    """How workers are started (each maps to a worker flag)."""

    mark: int = PROXY_MARK
    grace_s: float = 30.0
    idle_timeout_s: float = 3600.0
    connect_timeout_s: float = 5.0
    stats_interval_s: float = 5.0
    h2_upgrade: str = "auto"  # one of H2_UPGRADE_MODES
    io_uring: bool = True  # agent.proxy.writes rule 6
    slice_s: float | None = None  # the workers' scheduler slice, None: the kernel's (rule 9)
    h2_lanes: int = H2_LANES  # `h2_lanes_for` the pool's worker count (the supervisor sets it)
    plugins: tuple[str, ...] = ("agent.proxy.dataplane",)  # the mesh data path
    log_level: str = "info"
    python: str = sys.executable
    wrap: tuple[str, ...] = field(default_factory=wrap_from_env)  # rule 6
    env: Mapping[str, str] | None = None
    cpus: tuple[int, ...] = ()  # slot i's CPU (agent.proxy.placement); () steers nothing
    pin: bool = False  # each worker runs on its slot's CPU only (rule 7)
    steer: bool = True  # with `cpus`: new connections go to the worker of their CPU (rule 7)
    pair_maps: str = ""  # eBPF acceleration's maps: the paired relay (agent.proxy.pairing)

    def argv(self, channel_fd: int, worker_id: int) -> list[str]:
        argv = [
            *self.wrap,
            self.python,
            "-m",
            "agent.proxy.worker",
            f"--channel-fd={channel_fd}",
            f"--worker-id={worker_id}",
            f"--mark={self.mark}",
            f"--grace={self.grace_s}",
            f"--idle-timeout={self.idle_timeout_s}",
            f"--connect-timeout={self.connect_timeout_s}",
            f"--stats-interval={self.stats_interval_s}",
            f"--log-level={self.log_level}",
        ]
        argv += ["--h2-upgrade", self.h2_upgrade, f"--h2-lanes={self.h2_lanes}"]
        argv += ["--io-uring", "on" if self.io_uring else "off"]
        if self.slice_s is not None:
            argv.append(f"--slice={round(self.slice_s * 1e6)}us")
        cpu = self.cpu_of(worker_id)
        if cpu is not None and self.pin:
            argv.append(f"--cpu={cpu}")
        argv.extend(f"--plugin={p}" for p in self.plugins)
        if self.pair_maps:
            argv.append(f"--pair-maps={self.pair_maps}")
        return argv

    def cpu_of(self, worker_id: int) -> int | None:
        """The CPU of slot `worker_id` (whose connections it takes, rule 7), or None."""
        return self.cpus[worker_id % len(self.cpus)] if self.cpus else None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """A live worker, as `WorkerPool.workers` reports it."""

    worker_id: int
    pid: int
    ready: bool
    age_s: float
    stats: ch.Stats | None
    cpu: int | None = None  # the CPU whose connections it takes (agent.proxy.placement)
    pinned: bool = False  # and it runs there only


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitRecord:
    """A worker process that exited: its slot, PID and status (negative: signal)."""

    worker_id: int
    pid: int
    status: int


class _Proc:
    """One worker process and the pool's handles on it."""

    def __init__(self, worker_id: int, proc: subprocess.Popen[bytes], pidfd: int) -> None:
        self.worker_id = worker_id
        self.proc = proc
        self.pidfd = pidfd
        self.started = time.monotonic()
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.channel: ch.Channel | None = None
        self.stats: ch.Stats | None = None

    def signal(self, sig: int) -> None:
        if not self.exited.done():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, sig)


NeedCallback = Callable[[int, ch.Need], None]
StatsCallback = Callable[[ch.Stats], None]
MetricsCallback = Callable[[ch.Metrics], None]
TapCallback = Callable[[ch.TapEvents], None]
ExitCallback = Callable[[int, int], None]  # (worker_id, pid) of a worker that exited


class WorkerPool:
    """N worker processes fed listeners and state; see the module rules."""

    def __init__(  # noqa: PLR0913 - one callback per kind of worker news
        self,
        n: int,
        *,
        options: WorkerOptions | None = None,
        on_need: NeedCallback | None = None,
        on_stats: StatsCallback | None = None,
        on_metrics: MetricsCallback | None = None,
        on_tap: TapCallback | None = None,
        on_exit: ExitCallback | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"a pool needs at least one worker, got {n}")
        self.n = n
        self.options = options or WorkerOptions()
        self._on_need = on_need
        self._on_stats = on_stats
        self._on_metrics = on_metrics
        self._on_tap = on_tap
        self._on_exit = on_exit
        self._procs: dict[int, _Proc] = {}  # by worker_id (slot); one process per slot
        # id -> (the message, its sockets: one shared, or one per worker slot)
        self._listeners: dict[str, tuple[ch.AddListener, tuple[socket.socket, ...]]] = {}
        self._state: dict[Hashable, Any] = {}
        self._young_deaths: dict[int, int] = {}
        self._respawns: dict[int, asyncio.TimerHandle] = {}
        self._closing = False
        self.restarts = 0  # workers replaced after an unplanned exit
        self.exits: deque[ExitRecord] = deque(maxlen=64)  # the latest exits, oldest first

    @property
    def steering(self) -> bytes | None:
        """The program that gives a listener group's new connections to the worker on
        their CPU, or None when the workers are not one per CPU (agent.proxy.placement
        rules 2 and 3) or steering is off (`bind`). Slot i's socket is the i-th of each
        group (rule 2)."""
        if not self.options.cpus or not self.options.steer or self.n < 2:
            return None
        cpus = self.options.cpus
        table = placement.steering_table([cpus[i % len(cpus)] for i in range(self.n)])
        return placement.steering_program(table) if table else None

    # --- lifecycle ------------------------------------------------------------------

    async def start(self, ready_timeout: float | None = None) -> None:
        """Start the N workers and wait until each has said `Ready` (rule 8).

        Raises:
            PoolError: a slot's worker exited `START_TRIES` times before it was ready,
                or some worker was not ready within `ready_timeout` (default `READY_S`,
                or `WRAPPED_READY_S` for wrapped workers: rule 6).
            OSError: a worker process could not be started.
        """
        for worker_id in range(self.n):
            self._spawn(worker_id)
        if ready_timeout is None:
            ready_timeout = WRAPPED_READY_S if self.options.wrap else READY_S
        try:
            await self.wait_ready(ready_timeout, fail_on_exit=True)
        except TimeoutError:
            raise PoolError(f"proxy workers not ready within {ready_timeout:g} s") from None

    async def wait_ready(self, timeout: float = 10.0, *, fail_on_exit: bool = False) -> None:  # noqa: ASYNC109 - a deadline parameter reads better here
        """Until every slot has a live, ready worker.

        Raises:
            TimeoutError: not within `timeout`.
            PoolError: with `fail_on_exit`, a slot's worker exited `START_TRIES` times
                meanwhile (rule 8).
        """
        seen = len(self.exits)
        async with asyncio.timeout(timeout):
            while True:
                if fail_on_exit and (
                    dead := self._failed_start(itertools.islice(self.exits, seen, None))
                ):
                    raise PoolError(
                        f"proxy worker {dead.worker_id} exited with status {dead.status} "
                        f"before it was ready, {START_TRIES} times (its error is logged above)"
                    )
                procs = list(self._procs.values())
                if len(procs) == self.n and all(p.ready.done() for p in procs):
                    return
                waits = [p.ready for p in procs if not p.ready.done()]
                if waits:
                    await asyncio.wait(waits)
                else:  # a slot is between a death and its respawn
                    await asyncio.sleep(0.02)

    @staticmethod
    def _failed_start(exits: Iterable[ExitRecord]) -> ExitRecord | None:
        """The last exit of a slot that has died `START_TRIES` times among `exits` (rule 8)."""
        deaths: dict[int, int] = {}
        for record in exits:
            deaths[record.worker_id] = deaths.get(record.worker_id, 0) + 1
            if deaths[record.worker_id] >= START_TRIES:
                return record
        return None

    async def drain(self, grace: float) -> dict[int, int]:
        """Drain every worker (`Drain(grace)`), wait for them to exit, kill stragglers.

        Returns each worker PID's exit status (negative: killed by that signal).
        """
        self._closing = True
        self._cancel_respawns()
        procs = list(self._procs.values())
        for p in procs:
            if p.channel is not None and not p.channel.send(ch.Drain(deadline_s=grace)):
                p.signal(signal.SIGTERM)
        await self._wait_exits(procs, grace + 2.0)
        self._close_listeners()
        return {p.proc.pid: p.exited.result() for p in procs}

    async def close(self) -> None:
        """Kill (SIGKILL) this pool's workers, reap them, close every fd it holds."""
        self._closing = True
        self._cancel_respawns()
        procs = list(self._procs.values())
        for p in procs:
            p.signal(signal.SIGKILL)
        await self._wait_exits(procs, 5.0)
        self._close_listeners()

    async def _wait_exits(self, procs: list[_Proc], within_s: float) -> None:
        waits = [p.exited for p in procs if not p.exited.done()]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=within_s)
            if pending:
                for p in procs:
                    p.signal(signal.SIGKILL)
                await asyncio.wait(pending, timeout=5.0)
        for p in procs:  # last resort: blocking reap, the process is gone or going
            if not p.exited.done():
                self._exited(p)

    def _cancel_respawns(self) -> None:
        for handle in self._respawns.values():
            handle.cancel()
        self._respawns.clear()

    def _close_listeners(self) -> None:
        for _, socks in self._listeners.values():
            for sock in socks:
                sock.close()
        self._listeners.clear()

    # --- the supervisor's calls -------------------------------------------------

    def add_listener(
        self,
        *,
        listener_id: str,
        pod: str,
        kind: ListenerKind,
        netns: str,
        socks: Sequence[socket.socket],
    ) -> None:
        """Have every worker (present and future) accept on `socks`: one socket for all,
        or one per worker slot (rule 2). The pool now owns them.

        Raises:
            ValueError: `listener_id` is already in the pool, or there are neither one
                nor `n` sockets (the sockets are not taken).
        """
        if listener_id in self._listeners:
            raise ValueError(f"listener {listener_id} is already in the pool")
        if len(socks) not in (1, self.n):
            raise ValueError(
                f"listener {listener_id}: {len(socks)} sockets for {self.n} workers"
                " (one for all, or one per worker)"
            )
        msg = ch.AddListener(
            listener_id=listener_id, pod=pod, kind=kind, netns=netns, fd=socks[0].fileno()
        )
        self._listeners[listener_id] = (msg, tuple(socks))
        for p in self._procs.values():
            if p.channel is not None:
                p.channel.send(self._listener_for(p.worker_id, msg, socks))

    @staticmethod
    def _listener_for(
        worker_id: int, msg: ch.AddListener, socks: Sequence[socket.socket]
    ) -> ch.AddListener:
        """`msg` with the socket of slot `worker_id` (rule 2)."""
        if len(socks) == 1:
            return msg
        return replace(msg, fd=socks[worker_id].fileno())

    def remove_listener(self, listener_id: str, drain_s: float = 0.0) -> bool:
        """Stop accepting on a listener everywhere; its connections get `drain_s`.

        The pool closes its own copy now; the socket is gone once every
        worker has closed theirs. False if the pool did not have it.
        """
        entry = self._listeners.pop(listener_id, None)
        if entry is None:
            return False
        self._send_all(ch.RemoveListener(listener_id=listener_id, drain_s=drain_s))
        for sock in entry[1]:
            sock.close()
        return True

    def broadcast(self, msg: ch.StateUpdate | ch.StateDelete) -> None:
        """Apply a state change in every worker, present and future.

        Raises:
            pickle.PicklingError, TypeError: the value cannot be pickled.
        """
        if isinstance(msg, ch.StateDelete):
            self._state.pop(msg.key, None)
        else:
            self._state[msg.key] = msg.value
        self._send_all(msg)

    @property
    def listener_ids(self) -> list[str]:
        return list(self._listeners)

    @property
    def pids(self) -> list[int]:
        """PIDs of the live workers."""
        return [p.proc.pid for p in self._procs.values() if not p.exited.done()]

    @property
    def serving(self) -> bool:
        """Whether a live worker's last `Stats` (every `stats_interval_s`) counted an
        open connection: a coarse busy signal for the supervisor's own timers."""
        return any(
            p.stats is not None and p.stats.open_connections > 0
            for p in self._procs.values()
            if not p.exited.done()
        )

    @property
    def workers(self) -> list[WorkerInfo]:
        now = time.monotonic()
        return [
            WorkerInfo(
                worker_id=p.worker_id,
                pid=p.proc.pid,
                ready=p.ready.done(),
                age_s=now - p.started,
                stats=p.stats,
                cpu=self.options.cpu_of(p.worker_id),
                pinned=self.options.pin and bool(self.options.cpus),
            )
            for p in self._procs.values()
        ]

    def _send_all(self, msg: ch.Message) -> None:
        for p in self._procs.values():
            if p.channel is not None:
                p.channel.send(msg)

    # --- processes ----------------------------------------------------------------------

    def _spawn(self, worker_id: int) -> None:
        self._respawns.pop(worker_id, None)
        if self._closing:
            return
        mine, theirs = ch.pair()
        try:
            proc = subprocess.Popen(
                self.options.argv(theirs.fileno(), worker_id),
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=dict(self.options.env) if self.options.env is not None else None,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        p = _Proc(worker_id, proc, os.pidfd_open(proc.pid))
        loop = asyncio.get_running_loop()
        loop.add_reader(p.pidfd, self._exited, p)
        p.channel = ch.Channel(
            mine,
            on_message=lambda msg: self._on_message(p, msg),
            on_closed=lambda: None,  # the pidfd tells when the process is gone
            name=f"pool-worker-{worker_id}",
        )
        p.channel.start()
        self._procs[worker_id] = p
        for key, value in self._state.items():
            p.channel.send(ch.StateUpdate(key=key, value=value))
        for msg, socks in self._listeners.values():
            p.channel.send(self._listener_for(worker_id, msg, socks))
        logger.info("worker started", extra={"worker": worker_id, "pid": proc.pid})

    def _exited(self, p: _Proc) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(p.pidfd)
        status = p.proc.wait()  # the pidfd is readable: it has exited, this reaps at once
        os.close(p.pidfd)
        if p.channel is not None:
            p.channel.read_pending()  # its last messages (final metrics) before they are lost
            p.channel.close()
        if self._procs.get(p.worker_id) is p:
            del self._procs[p.worker_id]
        if not p.ready.done():
            p.ready.cancel()
        p.exited.set_result(status)
        self.exits.append(ExitRecord(worker_id=p.worker_id, pid=p.proc.pid, status=status))
        if self._on_exit is not None:
            try:
                self._on_exit(p.worker_id, p.proc.pid)
            except Exception:
                logger.exception("BUG: exit callback failed", extra={"worker": p.worker_id})
        if self._closing:
            logger.info("worker exited", extra={"worker": p.worker_id, "status": status})
            return
        logger.warning(
            "worker died, replacing it",
            extra={"worker": p.worker_id, "pid": p.proc.pid, "status": status},
        )
        self.restarts += 1
        self._respawns[p.worker_id] = loop.call_later(self._backoff(p), self._respawn, p.worker_id)

    def _respawn(self, worker_id: int) -> None:
        try:
            self._spawn(worker_id)
        except OSError:
            logger.exception("worker could not be started", extra={"worker": worker_id})
            loop = asyncio.get_running_loop()
            self._respawns[worker_id] = loop.call_later(MAX_BACKOFF_S, self._respawn, worker_id)

    def _backoff(self, p: _Proc) -> float:
        if time.monotonic() - p.started >= YOUNG_S:
            self._young_deaths.pop(p.worker_id, None)
            return 0.0
        k = self._young_deaths.get(p.worker_id, 0) + 1
        self._young_deaths[p.worker_id] = k
        return min(0.1 * 2.0 ** (k - 1), MAX_BACKOFF_S)

    def _on_message(self, p: _Proc, msg: ch.Message) -> None:  # noqa: C901 - a branch per kind
        if isinstance(msg, ch.Ready):
            if not p.ready.done():
                p.ready.set_result(None)
            logger.info("worker ready", extra={"worker": p.worker_id, "pid": p.proc.pid})
        elif isinstance(msg, ch.Need):
            if self._on_need is not None:
                self._on_need(p.worker_id, msg)
        elif isinstance(msg, ch.Stats):
            p.stats = msg
            if self._on_stats is not None:
                self._on_stats(msg)
        elif isinstance(msg, ch.Metrics):
            if self._on_metrics is not None:
                self._on_metrics(msg)
        elif isinstance(msg, ch.TapEvents):
            if self._on_tap is not None:
                self._on_tap(msg)
        else:
            logger.error("BUG: pool got a pool message", extra={"kind": type(msg).__name__})
