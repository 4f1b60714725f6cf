"""Tap events: the worker's side of `/tap`, drawn from the recorder's responses.

`Tapping` sits between `agent.admin.labelsets.LabelSets` (whose pods and
endpoints an event names) and `agent.admin.observe.Observer`, which calls
`_tap` for a response only while the supervisor's `("tap",)` state is
non-empty, and sends `take_tap()` to the supervisor `TAP_FLUSH_S` after the first
event entered an empty ring (`_tap_waiting`), and with every report.

Rules:
1. Only a response of a tapped pod becomes an event: the `("tap",)` state
   names the pods being tapped (or "*": all). An outbound request to a pod
   on this node is also that pod's inbound event (`labelsets` rule 2).
2. Events wait in a bounded ring (`TAP_RING`); when it is full the oldest is
   dropped and counted, so traffic never waits for a tap reader.
3. An event is a plain dict (sent in `TapEvents`): method, path (without its
   query) and Host from the request head (`record.REQUEST`), then status,
   latency, addresses, tls and identities from the labels; no other header
   is read.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from agent.admin.labelsets import LabelSets, conn_pod, parse_addr
from agent.proxy import channel as ch
from agent.proxy import record
from agent.proxy.state import POD_IP

if TYPE_CHECKING:
    from agent.admin.metrics import WorkerMetrics
    from agent.proxy.accept import Conn
    from agent.proxy.record import Labels
    from agent.proxy.worker import Worker

TAP_RING: Final = 1024
TAP: Final = "tap"  # state key ("tap",) -> frozenset of pod keys being tapped ("*": all)


class Tapping(LabelSets):
    """The label sets plus the ring of tap events waiting to be sent (the module rules)."""

    def __init__(self, worker: Worker, metrics: WorkerMetrics | None = None) -> None:
        super().__init__(worker, metrics)
        self.tap_ring: deque[dict[str, Any]] = deque(maxlen=TAP_RING)
        self.tap_dropped = 0

    def _tap(  # noqa: PLR0913 - the facts of one response
        self,
        taps: Any,
        *,
        conn: Conn | None,
        direction: str,
        labels: Labels,
        status: int,
        latency_ms: float,
    ) -> None:
        pod_key = self._own_pod(conn, labels) if direction == "inbound" else conn_pod(conn)
        peer_key: str | None = None
        if direction == "outbound" and labels.get("hop") == "local":
            addr = parse_addr(labels.get("dst_addr", ""))
            found = self.worker.state.get((POD_IP, addr[0])) if addr else None
            peer_key = found if isinstance(found, str) else None
        wanted = [k for k in (pod_key, peer_key) if k and ("*" in taps or k in taps)]
        if not wanted:
            return
        event = self._event(
            conn,
            direction=direction,
            labels=labels,
            status=status,
            latency_ms=latency_ms,
            pod_key=pod_key,
        )
        ring = self.tap_ring
        first = not ring
        for key in wanted:
            if len(ring) == ring.maxlen:
                self.tap_dropped += 1
            if key == pod_key:
                ring.append(event)
            else:  # the same request seen from the called pod's side (rule 1)
                ring.append({**event, "pod": key, "direction": "inbound", "from_pod": pod_key})
        if first:
            self._tap_waiting()

    def _tap_waiting(self) -> None:
        """The first event entered an empty ring: the observer times its flush (here the
        events wait for `take_tap`)."""

    def _event(  # noqa: PLR0913 - the facts of one response
        self,
        conn: Conn | None,
        *,
        direction: str,
        labels: Labels,
        status: int,
        latency_ms: float,
        pod_key: str,
    ) -> dict[str, Any]:
        head = record.REQUEST.get()
        method = path = host = ""
        if head is not None:
            method = head.method.decode("latin-1")
            path = head.target.decode("latin-1").partition("?")[0]
            host = _header(head.headers, b"host")
        event: dict[str, Any] = {
            "ts": round(time.time(), 6),
            "pod": pod_key,
            "direction": direction,
            "method": method,
            "authority": labels.get("authority") or host,
            "path": path,
            "status": status,
            "latency_ms": round(latency_ms, 3),
            "src": f"{conn.peer[0]}:{conn.peer[1]}" if conn is not None else "",
            "dst": labels.get("dst_addr", ""),
        }
        if direction == "inbound":
            event["tls"] = labels.get("tls", "")
            event["client_id"] = labels.get("client_id", "")
        else:
            hop = labels.get("hop", "")
            server_id, ep_labels = self._endpoint(labels.get("authority", ""), event["dst"])
            src = self._pod_info(pod_key)
            event["tls"] = "true" if hop in ("mtls", "local") else "no_identity"
            event["client_id"] = src.identity if src is not None else ""
            event["server_id"] = server_id or ""
            if hop == "local":
                event["tls"] = "true"
            event["dst_pod"] = dict(ep_labels).get("pod", "")
        return event

    def take_tap(self) -> ch.TapEvents | None:
        """The queued tap events as one message (None when there are none)."""
        if not self.tap_ring and not self.tap_dropped:
            return None
        msg = ch.TapEvents(
            worker_id=self.worker.worker_id,
            events=tuple(self.tap_ring),
            dropped=self.tap_dropped,
        )
        self.tap_ring.clear()
        self.tap_dropped = 0
        return msg


def _header(headers: Any, name: bytes) -> str:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""
