"""The sandbox's traffic driver: HTTP requests from inside a pod at a steady rate.

    python -m agent.sandbox.load --stats FILE --rps 2 URL [URL ...]

Each URL gets `--rps` requests per second over one keep-alive connection
(re-opened after errors). Every second the driver rewrites FILE with, per URL,
the last 10 seconds: requests, successes (status < 500, as Linkerd classifies
them), status counts and latencies in ms. The live view reads it.

Rules: stdlib only (http.client in threads); never exits on a request error.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path

WINDOW = 10.0


class Target:
    """One URL: its client and its recent results."""

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urllib.parse.urlsplit(url)
        self.host = parts.hostname or ""
        self.port = parts.port or 80
        self.path = parts.path or "/"
        self.results: deque[tuple[float, int, float]] = deque()  # (time, status, ms); 0: error
        self.lock = threading.Lock()
        self.conn: http.client.HTTPConnection | None = None

    def once(self) -> None:
        start = time.monotonic()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=5)
            self.conn.request("GET", self.path)
            resp = self.conn.getresponse()
            resp.read()
            status = resp.status
            if resp.will_close:
                self.conn.close()
                self.conn = None
        except (OSError, http.client.HTTPException):
            status = 0
            if self.conn is not None:
                self.conn.close()
            self.conn = None
        now = time.monotonic()
        with self.lock:
            self.results.append((now, status, (now - start) * 1000))

    def summary(self) -> dict[str, object]:
        cutoff = time.monotonic() - WINDOW
        with self.lock:
            while self.results and self.results[0][0] < cutoff:
                self.results.popleft()
            rows = list(self.results)
        statuses: dict[str, int] = {}
        for _, status, _ms in rows:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        return {
            "url": self.url,
            "window": WINDOW,
            "requests": len(rows),
            "success": sum(1 for _, s, _ms in rows if 0 < s < 500),
            "statuses": statuses,
            "latencies_ms": sorted(round(ms, 2) for _, _s, ms in rows),
        }


def _loop(target: Target, rps: float) -> None:
    interval = 1 / rps
    while True:
        start = time.monotonic()
        target.once()
        time.sleep(max(0.0, interval - (time.monotonic() - start)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.sandbox.load")
    parser.add_argument("--stats", required=True, type=Path)
    parser.add_argument("--rps", type=float, default=2.0)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args(argv)
    targets = [Target(u) for u in args.urls]
    for t in targets:
        threading.Thread(target=_loop, args=(t, args.rps), daemon=True).start()
    while True:
        time.sleep(1)
        tmp = args.stats.with_suffix(".tmp")
        tmp.write_text(json.dumps([t.summary() for t in targets]))
        tmp.replace(args.stats)


if __name__ == "__main__":
    sys.exit(main())
