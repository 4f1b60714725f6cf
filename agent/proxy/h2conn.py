"""One h2 connection as an `asyncio.Protocol`: the server side towards a client, or the
client side towards an upstream (agent.proxy.http2's rules 2, 3, 6 and 8).

It feeds received bytes to `h2`, turns events into items on its `H2Stream`s
(agent.proxy.h2stream), hands new request streams to `next_incoming`, and writes
what h2 queued once per loop iteration (`flush`), at once past `FLUSH_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import TYPE_CHECKING, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from agent.proxy import h2msg
from agent.proxy.h2stream import CANCEL, END, Data, H2Stream, Head, Item, StreamGoneError, Trailers

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable

    from agent.proxy.h2msg import H2Headers


logger = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20  # what one stream may have in flight towards us (http2 rule 2)
CONN_WINDOW = 8 << 20
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
FLUSH_BYTES = 64 * 1024  # DATA queued in h2 past this is written at once (http2 rule 8)
IDLE_TIMEOUT_S = 60.0


class H2Conn(asyncio.Protocol):
    """One h2 connection (either side); see the module rules."""

    def __init__(self, *, client_side: bool) -> None:
        config = h2.config.H2Configuration(
            client_side=client_side,
            header_encoding=None,
            validate_outbound_headers=False,  # h2msg rule 4 (rule 8)
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.client_side = client_side
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, H2Stream] = {}
        self.incoming: deque[H2Stream] = deque()  # server side: new request streams
        self.closed = False
        self.going_away = False
        self.pool_key: Hashable = None
        self._write_paused = False
        self._flush_soon = False
        self._queued = 0  # DATA bytes handed to h2 since the last write
        self._waiters: list[asyncio.Future[None]] = []  # window or drain or news
        self._idle: asyncio.TimerHandle | None = None
        self.on_idle: Callable[[H2Conn], None] | None = None

    # --- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr = cast("asyncio.Transport", transport)
        self.transport = tr
        tr.set_write_buffer_limits(HIGH_WATER, LOW_WATER)
        values = {
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
        }
        if self.client_side:
            values[h2.settings.SettingCodes.ENABLE_PUSH] = 0
        self.h2.local_settings = h2.settings.Settings(
            client=self.client_side, initial_values=values
        )
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONN_WINDOW - 65535)
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            logger.info("h2 protocol error, closing", extra={"error": str(exc)})
            self.flush()  # the GOAWAY
            self.close()
            return
        for ev in events:
            self._event(ev)
        self.flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - Protocol API
        self.closed = True
        for stream in list(self.streams.values()):
            stream.peer_reset(CANCEL)
        self.streams.clear()
        self.wake()
        if self._idle is not None:
            self._idle.cancel()
        if self.on_idle is not None:
            self.on_idle(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self.wake()

    # --- events (one isinstance chain, no await) -------------------------------------

    def _event(self, ev: h2.events.Event) -> None:  # noqa: C901, PLR0912 - the dispatch table
        if isinstance(ev, h2.events.DataReceived):
            stream = self.streams.get(ev.stream_id or 0)
            if stream is None or stream.gone is not None:
                self.ack(ev.stream_id or 0, ev.flow_controlled_length or 0)
            else:
                stream.push(Data(ev.data or b"", ev.flow_controlled_length or 0))
        elif isinstance(ev, h2.events.RequestReceived):
            stream = H2Stream(self, ev.stream_id or 0)
            stream.request = list(cast("H2Headers", ev.headers or []))
            self.streams[stream.sid] = stream
            self._busy()
            self.incoming.append(stream)
            self.wake()
        elif isinstance(ev, h2.events.ResponseReceived):
            self._push(ev.stream_id, Head(list(cast("H2Headers", ev.headers or [])), end=False))
        elif isinstance(ev, h2.events.TrailersReceived):
            self._push(ev.stream_id, Trailers(list(cast("H2Headers", ev.headers or []))))
        elif isinstance(ev, h2.events.StreamEnded):
            self._ended(ev.stream_id or 0)
        elif isinstance(ev, h2.events.StreamReset):
            stream = self.streams.pop(ev.stream_id or 0, None)
            if stream is not None:
                stream.peer_reset(int(ev.error_code or 0))
                self._maybe_idle()
        elif isinstance(ev, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            self.wake()
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self._goaway(ev.last_stream_id or 0)
        elif isinstance(
            ev,
            h2.events.InformationalResponseReceived
            | h2.events.SettingsAcknowledged
            | h2.events.PingReceived
            | h2.events.PingAckReceived
            | h2.events.PriorityUpdated
            | h2.events.UnknownFrameReceived
            | h2.events.AlternativeServiceAvailable
            | h2.events.PushedStreamReceived,
        ):
            pass  # nothing to forward: 1xx are dropped, pushes are refused by h2 settings
        else:
            logger.debug("h2 event ignored", extra={"event": type(ev).__name__})

    def _push(self, sid: int | None, item: Item) -> None:
        stream = self.streams.get(sid or 0)
        if stream is not None:
            stream.push(item)

    def _ended(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        last = stream.items[-1] if stream.items else None
        if isinstance(last, Head):  # a trailers-only (or bodiless) response
            last.end = True
            stream.remote_ended = True
        elif not isinstance(last, Trailers):  # trailers end the stream already
            stream.push(END)
        if stream.local_ended:
            self.forget(stream)

    def _goaway(self, last_stream_id: int) -> None:
        self.going_away = True
        if self.client_side:
            for sid, stream in list(self.streams.items()):
                if sid > last_stream_id:
                    self.streams.pop(sid, None)
                    stream.peer_reset(h2.errors.ErrorCodes.REFUSED_STREAM)
        if not self.streams:
            self.close()

    # --- helpers -------------------------------------------------------------------

    def flush(self) -> None:
        """Write what h2 queued at the end of this loop iteration (rule 8): one write for
        the frames of every stream that sent something meanwhile."""
        if not self._flush_soon:
            self._flush_soon = True
            asyncio.get_running_loop().call_soon(self.flush_now)

    def queued(self, size: int) -> None:
        """`size` DATA bytes went to h2: write soon, or now past `FLUSH_BYTES` so that
        the transport's buffer (and so `drained`) sees them (rule 2)."""
        self._queued += size
        if self._queued >= FLUSH_BYTES:
            self.flush_now()
        else:
            self.flush()

    def flush_now(self) -> None:
        """Write what h2 queued now."""
        self._flush_soon = False
        self._queued = 0
        data = self.h2.data_to_send()
        tr = self.transport
        if data and tr is not None and not tr.is_closing():
            tr.write(data)

    def ack(self, sid: int, flow: int) -> None:
        if flow <= 0 or self.closed or sid <= 0:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.acknowledge_received_data(flow, sid)
            self.flush()

    def forget(self, stream: H2Stream) -> None:
        """The stream is over on both sides (or reset): stop routing frames to it."""
        if self.streams.get(stream.sid) is stream:
            del self.streams[stream.sid]
        self._maybe_idle()

    def _busy(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _maybe_idle(self) -> None:
        if self.streams or self.closed:
            return
        if self.going_away:
            self.close()
        elif self.client_side and self._idle is None:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(IDLE_TIMEOUT_S, self._idle_close)

    def _idle_close(self) -> None:
        self._idle = None
        if not self.streams:
            self.close()

    def wake(self) -> None:
        """Wake every coroutine waiting on this connection (window, drain, news)."""
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def wait_window(self) -> None:
        """Until a WINDOW_UPDATE, a settings change, or the connection ends."""
        if self.closed:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    async def drained(self) -> None:
        """Until the transport's write buffer is below low water (or it is gone)."""
        while self._write_paused and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    async def next_incoming(self) -> H2Stream | None:
        """Server side: the next request stream; None once the connection is closed."""
        while not self.incoming:
            if self.closed:
                return None
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        return self.incoming.popleft()

    # --- client side -----------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Can carry one more stream now (rule 6)."""
        if self.closed or self.going_away or self.transport is None:
            return False
        if self.transport.is_closing():
            return False
        # Our own count: h2's `open_outbound_streams` walks every stream.
        return len(self.streams) < self.h2.remote_settings.max_concurrent_streams

    def open_stream(self, headers: H2Headers, *, end: bool) -> H2Stream:
        """Start a request stream.

        Raises:
            StreamGoneError: the connection cannot take it any more.
        """
        try:
            sid = self.h2.get_next_available_stream_id()
            stream = H2Stream(self, sid)
            self.streams[sid] = stream
            self.h2.send_headers(sid, h2msg.protect(headers), end_stream=end)
        except (h2.exceptions.ProtocolError, h2.exceptions.NoAvailableStreamIDError) as exc:
            self.going_away = True
            raise StreamGoneError(h2.errors.ErrorCodes.REFUSED_STREAM) from exc
        stream.local_ended = end
        self._busy()
        self.flush()
        return stream

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.close_connection()
            self.flush_now()
            self.transport.close()
