"""agent.admin.client: `tap` against an admin server that is not there, or that sends
what is not a tap stream, says so instead of raising a socket's or JSON's error."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.admin import client
from agent.bench.mesh import free_port  # nothing binds it: connections are refused
from agent.errors import AgentError


def test_tap_at_a_port_nobody_listens_on_is_unreachable():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(client.AdminUnreachable, match="Connection refused") as got:
        list(client.tap("default/web", urls=[url]))
    assert got.value.urls == [url]


def _serving(body: bytes) -> ThreadingHTTPServer:
    class Tap(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Tap)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("line", [b"<html>not json</html>\n", b"[1, 2]\n"])
def test_a_line_that_is_not_a_json_object_ends_the_tap_with_an_error(line):
    good = b'{"pod": "default/web", "path": "/a"}\n'
    server = _serving(good + line)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        events = client.tap("default/web", urls=[url])
        assert next(events)["path"] == "/a"  # what came before is delivered
        with pytest.raises(AgentError, match="not a JSON object"):
            next(events)
    finally:
        server.shutdown()
        server.server_close()
