"""A proxy worker process: accepts on every pod's listeners and runs the data path.

`python -m agent.proxy.worker --channel-fd N --worker-id K` (started by
`agent.proxy.pool.WorkerPool`, never by hand).

Rules:
1. Everything arrives over the channel (agent.proxy.channel): listeners as
   fds, state as `StateUpdate`s. A worker makes no control-plane calls; it
   asks for missing state with `Need` (`WorkerState.want`).
2. Each accepted connection is paused, wrapped in a `Conn` and given to
   `HANDLERS[kind]` in its own task; a handler's exception ends that connection
   only. That path is `agent.proxy.accept`, compiled: a new connection pays for
   every interpreted call (bench/RESULTS.md, fortieth and fifty-fourth passes).
   The worker keeps every connection (`Worker.conns`, its listener's) until its
   task ends.
3. `RemoveListener`: stop accepting on it now; its connections get `drain_s`,
   then are reset. `Drain` or SIGTERM: stop accepting everywhere, wait for
   connections up to the deadline, reset the rest, exit 0. SIGINT is ignored
   (the supervisor decides); a closed channel (supervisor gone) drains too.
4. Extension points, set by modules loaded with `--plugin` (a module name or a
   `.py` path): `HANDLERS` (this module's is `agent.proxy.accept.HANDLERS`) and
   `agent.proxy.accept.resolve_target`. Both are read per connection.
   `START_HOOKS(worker)` run once the channel is up (a returned task is
   cancelled at exit); `DRAIN_HOOKS(worker)` run when draining ends, just
   before the final report (final metrics go out there).
5. Observability: each connection's task carries `agent.proxy.record.CONN`
   (the `Conn`), so the recorder knows the pod; the recorder hears
   `conn_end(conn, error)` when a connection's handler is done.
6. Profiling (`meshagent bench --profile`): with `MESHAGENT_PROFILE_DIR` set
   in its environment the worker runs under cProfile and writes its stats
   there as `worker-<id>-<pid>.prof` when it exits; cProfile is imported
   only then.
7. A finished connection leaves no reference cycle: what it held (handlers,
   routers, parsers, recorder handles) is freed by reference counting when it
   ends, not by a later run of the garbage collector, whose time would grow
   with the connection rate. So the collector's young generation waits for
   `GC_YOUNG_THRESHOLD` more live objects (net of those freed), not Python's
   700, which in-flight h2 streams alone reach every few dozen streams: with
   nothing left for it to free, each run was pure cost.
8. Counting interpreted calls (`meshagent bench --interp`): with
   `MESHAGENT_INTERP_DIR` set the worker counts every call of a Python
   function that the interpreter runs (`sys.setprofile` "call" events; the
   mypyc build's functions make none) and writes the counts there as
   `worker-<id>-<pid>.tsv` when it exits (`calls<TAB>file:line<TAB>function`).
   On the compiled request path a count that grows with the requests names an
   interpreted function still on it (agent.bench.interp).
9. `--cpu N` (agent.proxy.pool rule 7, `--cpu-placement pin`): the worker pins
   itself, and every thread it will start, to CPU N before anything else. A CPU it
   may not use (the node's set changed) is logged and the worker runs wherever the
   kernel puts it.
10. Before it serves, the worker fixes glibc's malloc thresholds (agent.proxy.heap),
    so that the 256 KiB buffers of a bulk stream are reused from the heap instead of
    being given back to the kernel and faulted in again on every read.
11. `--pair-maps DIR` (the supervisor passes it in eBPF mode with acceleration):
    the worker uses the paired relay's pinned maps there (agent.proxy.pairing);
    until they are pinned, or without them, it relays every byte itself.
12. `--slice D` (agent.proxy.pool rule 9): before it serves, the worker asks for a
    scheduler slice of D for its loop's thread (agent.proxy.sched); a kernel that
    refuses is logged and the worker runs on the kernel's slice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import aio, logs, native
from agent.config import parse_positive_int
from agent.errors import AgentError
from agent.proxy import accept, heap, sched, tcp, uring
from agent.proxy import channel as ch
from agent.proxy.accept import HANDLERS, Conn, target_of
from agent.proxy.listener import LISTEN_BACKLOG, ListenerKind, UpstreamSockets
from agent.proxy.pool import H2_LANES, H2_UPGRADE_MODES
from agent.proxy.wstate import WorkerState
from agent.redirect.model import PROXY_MARK

if TYPE_CHECKING:
    from agent.proxy.pairing import PairMaps

logger = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 10_000  # rule 7

PROFILE_ENV = "MESHAGENT_PROFILE_DIR"  # rule 6 (agent.bench.profile sets it)
INTERP_ENV = "MESHAGENT_INTERP_DIR"  # rule 8 (agent.bench.interp sets it)

DEFAULT_GRACE_S = 30.0
DEFAULT_IDLE_TIMEOUT_S = 3600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_STATS_INTERVAL_S = 5.0


class ProxyLoopError(AgentError):
    """The target of a connection is the listener that accepted it."""

    def __init__(self, listener_id: str, target: tuple[str, int]) -> None:
        self.listener_id = listener_id
        self.target = target
        super().__init__(f"listener {listener_id}: target {target[0]}:{target[1]} is itself")


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerInfo:
    """What a worker knows about one listener."""

    listener_id: str
    pod: str
    kind: ListenerKind
    netns: str


# --- default handler: opaque relay to the original destination --------------------


async def relay_handler(conn: Conn) -> None:
    """Relay `conn` byte for byte to `resolve_target(conn)` from the pod's namespace.

    Raises:
        ProxyLoopError: the target is the listener itself.
        OSError, TimeoutError: the upstream connection failed.
    """
    target = target_of(conn)
    if target == conn.local:
        raise ProxyLoopError(conn.listener.listener_id, target)
    worker = conn.worker
    sock = await worker.upstreams.get(conn.listener.netns)
    try:
        async with asyncio.timeout(worker.connect_timeout):
            await asyncio.get_running_loop().sock_connect(sock, target)
    except BaseException:
        sock.close()
        raise
    held = conn.held
    relay = await tcp.open_relay(
        conn.transport,
        sock,
        prefix=bytes(held.prefix),
        eof=held.eof,
        idle_timeout=worker.idle_timeout,
    )
    conn.relay = relay
    try:
        await relay.wait()
    finally:
        if not relay.done.done():
            relay.abort()


# rule 4: the relay serves both kinds until a plugin (the data plane) puts its own in
HANDLERS.setdefault(ListenerKind.OUTBOUND, relay_handler)
HANDLERS.setdefault(ListenerKind.INBOUND, relay_handler)


# --- the worker ---------------------------------------------------------------------


class _Listener:
    __slots__ = ("conns", "info", "loop", "port", "server", "worker")

    def __init__(self, worker: Worker, info: ListenerInfo, loop: asyncio.AbstractEventLoop) -> None:
        self.worker = worker
        self.info = info
        self.loop = loop  # its connections' tasks' (rule 2)
        self.server: asyncio.Server | None = None
        self.conns: set[Conn] = set()
        self.port = 0  # the port it listens on (agent.proxy.inbound asks per connection)


class Worker:
    """The worker's loop-side state; `run` until drained."""

    def __init__(  # noqa: PLR0913 - every knob is a flag of the worker command
        self,
        *,
        worker_id: int,
        mark: int = PROXY_MARK,
        grace_s: float = DEFAULT_GRACE_S,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT_S,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        stats_interval: float = DEFAULT_STATS_INTERVAL_S,
        h2_upgrade: str = "auto",
        h2_lanes: int = H2_LANES,
    ) -> None:
        self.worker_id = worker_id
        self.h2_upgrade = h2_upgrade  # agent.proxy.h1toh2, agent.proxy.outbound rule 4
        self.h2_lanes = h2_lanes  # h2 connections per meshed endpoint (agent.proxy.h2pool rule 2)
        self.grace_s = grace_s
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self.stats_interval = stats_interval
        self.upstreams = UpstreamSockets(mark)
        self.state = WorkerState(self._ask)
        self.plane: Any = None  # agent.proxy.plane.plane_of's `Plane`, made on first use
        self.h2pool: Any = None  # agent.proxy.h2pool.pool_of's `H2Pool`, likewise
        self.listeners: dict[str, _Listener] = {}
        self.conns: set[Conn] = set()
        self.accepted_total = 0
        self.failed_total = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.pair_maps: PairMaps | None = None  # rule 11
        self._channel: ch.Channel | None = None
        self._inbox: asyncio.Queue[ch.Message] = asyncio.Queue()
        self._draining = False
        self._exit: asyncio.Future[int] | None = None

    # --- lifecycle ------------------------------------------------------------

    async def run(self, channel_sock: socket.socket) -> int:
        """Serve until drained; the exit status."""
        loop = asyncio.get_running_loop()
        self._exit = loop.create_future()
        loop.set_exception_handler(self._loop_error)
        self._channel = ch.Channel(
            channel_sock,
            on_message=self._inbox.put_nowait,
            on_closed=self._channel_closed,
            name=f"worker-{self.worker_id}",
        )
        self._channel.start()
        loop.add_signal_handler(signal.SIGTERM, self._sigterm)
        tasks = [
            aio.spawn(self._control(), name="worker-control"),
            aio.spawn(self._report(), name="worker-stats"),
        ]
        for hook in START_HOOKS:
            task = hook(self)
            if task is not None:
                tasks.append(task)
        self._channel.send(ch.Ready(worker_id=self.worker_id))
        logger.info(
            "worker ready",
            extra={"worker": self.worker_id, "pid": os.getpid(), "native": native.STATE},
        )
        try:
            return await self._exit
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            await aio.cancel_and_wait(tasks)
            self.upstreams.close()
            self._channel.close()

    def _sigterm(self) -> None:
        logger.info("sigterm, draining", extra={"worker": self.worker_id, "grace_s": self.grace_s})
        aio.spawn(self.drain(self.grace_s), name="worker-drain")

    def _channel_closed(self) -> None:
        if not self._draining:
            logger.warning("supervisor channel closed, draining", extra={"worker": self.worker_id})
            aio.spawn(self.drain(self.grace_s), name="worker-drain")

    def _loop_error(
        self,
        loop: asyncio.AbstractEventLoop,  # noqa: ARG002 - handler API
        context: dict[str, Any],
    ) -> None:
        # A protocol callback raised: the transport is closed by the loop; count it.
        self.failed_total += 1
        logger.error(
            "BUG: loop callback failed",
            extra={"worker": self.worker_id, "context": context.get("message")},
            exc_info=context.get("exception"),
        )

    async def drain(self, deadline_s: float) -> None:
        """Stop accepting everywhere, let connections finish up to `deadline_s`, exit 0."""
        if self._draining:
            return
        self._draining = True
        for lst in self.listeners.values():
            self._stop_accepting(lst)
        left = await _finish(self.conns, deadline_s)
        logger.info("worker drained", extra={"worker": self.worker_id, "reset_connections": left})
        for hook in DRAIN_HOOKS:
            try:
                hook(self)
            except Exception:
                logger.exception("BUG: drain hook failed", extra={"worker": self.worker_id})
        if self._channel is not None:
            self._channel.send(self._stats())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._channel.flush()
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(0)

    # --- control messages -------------------------------------------------------

    async def _control(self) -> None:
        while True:
            msg = await self._inbox.get()
            try:
                await self._apply(msg)
            except Exception:
                logger.exception(
                    "control message failed",
                    extra={"worker": self.worker_id, "kind": type(msg).__name__},
                )

    async def _apply(self, msg: ch.Message) -> None:
        if isinstance(msg, ch.StateUpdate | ch.StateDelete):
            self.state.apply(msg)
        elif isinstance(msg, ch.AddListener):
            await self._add_listener(msg)
        elif isinstance(msg, ch.RemoveListener):
            self._remove_listener(msg)
        elif isinstance(msg, ch.Drain):
            aio.spawn(self.drain(msg.deadline_s), name="worker-drain")
        elif isinstance(msg, ch.Ready | ch.Need | ch.Stats | ch.Metrics | ch.TapEvents):
            logger.error("BUG: worker got a worker message", extra={"kind": type(msg).__name__})
        else:
            raise AssertionError(f"BUG: unhandled message {msg!r}")  # noqa: TRY004 - STYLE dispatch

    async def _add_listener(self, msg: ch.AddListener) -> None:
        sock = socket.socket(fileno=msg.fd)
        if self._draining or msg.listener_id in self.listeners:
            sock.close()
            return
        info = ListenerInfo(
            listener_id=msg.listener_id, pod=msg.pod, kind=msg.kind, netns=msg.netns
        )
        lst = _Listener(self, info, asyncio.get_running_loop())
        lst.port = sock.getsockname()[1]
        self.listeners[msg.listener_id] = lst
        try:
            lst.server = await lst.loop.create_server(
                functools.partial(accept.Accepted, lst), sock=sock, backlog=LISTEN_BACKLOG
            )
        except OSError:
            sock.close()
            del self.listeners[msg.listener_id]
            raise
        logger.info(
            "listening",
            extra={"worker": self.worker_id, "pod": msg.pod, "listener": msg.listener_id},
        )

    def _remove_listener(self, msg: ch.RemoveListener) -> None:
        lst = self.listeners.pop(msg.listener_id, None)
        if lst is None:
            return
        self._stop_accepting(lst)
        if not any(other.info.netns == lst.info.netns for other in self.listeners.values()):
            self.upstreams.discard(lst.info.netns)
        aio.spawn(_finish(lst.conns, msg.drain_s), name=f"retire {msg.listener_id}")

    def _stop_accepting(self, lst: _Listener) -> None:
        if lst.server is not None:
            lst.server.close()
            lst.server = None

    # --- towards the supervisor --------------------------------------------------

    def _ask(self, need: ch.Need) -> None:
        if self._channel is not None:
            self._channel.send(need)

    def send(self, msg: ch.Message) -> bool:
        """Send a message to the supervisor; False when the channel is gone."""
        return self._channel is not None and self._channel.send(msg)

    def _stats(self) -> ch.Stats:
        return ch.Stats(
            worker_id=self.worker_id,
            pid=os.getpid(),
            listeners=len(self.listeners),
            open_connections=len(self.conns),
            accepted_total=self.accepted_total,
            failed_total=self.failed_total,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
        )

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval)
            if self._channel is not None:
                self._channel.send(self._stats())


StartHook = Callable[[Worker], asyncio.Task[Any] | None]
START_HOOKS: list[StartHook] = []
DRAIN_HOOKS: list[Callable[[Worker], None]] = []


async def _finish(conns: set[Conn], deadline_s: float) -> int:
    """Wait up to `deadline_s` for `conns` to end, then cancel the rest; how many were cut."""
    tasks = [c.task for c in conns if c.task is not None]
    if not tasks:
        return 0
    _, pending = await asyncio.wait(tasks, timeout=deadline_s)
    await aio.cancel_and_wait(list(pending))
    return len(pending)


# --- process entry --------------------------------------------------------------------


def load_plugin(spec: str) -> None:
    """Import a plugin: a module name, or a path to a `.py` file.

    Raises:
        ImportError: it cannot be found or loaded.
    """
    if not spec.endswith(".py"):
        importlib.import_module(spec)
        return
    name = "meshagent_plugin_" + os.path.basename(spec)[:-3]  # noqa: PTH119 - a plain string
    mod_spec = importlib.util.spec_from_file_location(name, spec)
    if mod_spec is None or mod_spec.loader is None:
        raise ImportError(f"cannot load plugin {spec}")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    mod_spec.loader.exec_module(module)


def pin(cpu: int) -> bool:
    """Rule 9: run on `cpu` only; False (logged) when the kernel refuses it."""
    try:
        os.sched_setaffinity(0, {cpu})
    except (OSError, ValueError) as exc:
        logger.warning(
            "cannot pin the worker to its CPU; it runs unpinned",
            extra={"cpu": cpu, "reason": str(exc)},
        )
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agent.proxy.worker")
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--mark", type=lambda s: int(s, 0), default=PROXY_MARK)
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    p.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S)
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S)
    p.add_argument("--stats-interval", type=float, default=DEFAULT_STATS_INTERVAL_S)
    p.add_argument("--h2-upgrade", choices=H2_UPGRADE_MODES, default="auto")
    p.add_argument("--h2-lanes", type=parse_positive_int, default=H2_LANES)
    p.add_argument("--io-uring", choices=("on", "off"), default="on")
    p.add_argument("--plugin", action="append", default=[])
    p.add_argument("--log-level", default="info")
    p.add_argument("--cpu", type=int, default=None)
    p.add_argument("--pair-maps", default="")
    p.add_argument("--slice", type=sched.parse_slice, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m agent.proxy.worker`."""
    args = parse_args(argv)
    logs.setup(
        args.log_level, f"%(asctime)s %(levelname)s worker-{args.worker_id} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.cpu is not None:
        pin(args.cpu)
    heap.tune()  # rule 10
    if args.slice is not None:
        sched.request(args.slice)  # rule 12
    for plugin in args.plugin:
        load_plugin(plugin)
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])  # rule 7
    uring.switch(args.io_uring == "on")  # agent.proxy.writes rule 6
    sock = socket.socket(fileno=args.channel_fd)
    worker = Worker(
        worker_id=args.worker_id,
        mark=args.mark,
        grace_s=args.grace,
        idle_timeout=args.idle_timeout or None,
        connect_timeout=args.connect_timeout,
        stats_interval=args.stats_interval,
        h2_upgrade=args.h2_upgrade,
        h2_lanes=args.h2_lanes,
    )
    if args.pair_maps:
        from agent.proxy.pairing import PairMaps  # noqa: PLC0415 - eBPF acceleration only

        worker.pair_maps = PairMaps(args.pair_maps)  # rule 11
    directory = os.environ.get(PROFILE_ENV)
    if directory:
        return _run_profiled(worker, sock, directory)
    counted = os.environ.get(INTERP_ENV)
    if counted:
        return _run_counted(worker, sock, counted)
    return aio.run(worker.run(sock))


def _run_profiled(worker: Worker, sock: socket.socket, directory: str) -> int:
    """Rule 6: the whole run under cProfile, its stats written to `directory` at the end."""
    import cProfile  # noqa: PLC0415 - only when profiling

    prof = cProfile.Profile()
    prof.enable()
    try:
        return aio.run(worker.run(sock))
    finally:
        prof.disable()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(out / f"worker-{worker.worker_id}-{os.getpid()}.prof")


def _run_counted(worker: Worker, sock: socket.socket, directory: str) -> int:
    """Rule 8: the whole run with interpreted calls counted, written to `directory` at the end."""
    calls: dict[Any, int] = {}

    def on_event(frame: Any, event: str, _arg: object) -> None:
        if event == "call":
            code = frame.f_code
            calls[code] = calls.get(code, 0) + 1

    sys.setprofile(on_event)
    try:
        return aio.run(worker.run(sock))
    finally:
        sys.setprofile(None)
        rows = sorted(calls.items(), key=lambda kv: -kv[1])
        text = "".join(
            f"{n}\t{code.co_filename}:{code.co_firstlineno}\t{code.co_qualname}\n"
            for code, n in rows
        )
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"worker-{worker.worker_id}-{os.getpid()}.tsv").write_text(text)


if __name__ == "__main__":
    # Run the importable module, not this `__main__` copy, so that plugins
    # that change `agent.proxy.worker.HANDLERS` change the ones in use.
    from agent.proxy import worker as _worker  # noqa: PLW0406 - on purpose, see above

    sys.exit(_worker.main())
