"""The dashboard's web server (stdlib http.server): GET / is page.html, GET /api/status the JSON
its script polls (the same that a test reads). One JSON source call at a time: a DHT scout and
the step clocks are not shared between threads.

imports: stdlib only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

Source = Callable[[], dict[str, Any]]


class SourceError(Exception):
    """A poll that could not be answered now (the DHT did not answer): the page says why and
    polls again."""


def page_html() -> bytes:
    return resources.files(__package__).joinpath("page.html").read_bytes()


def make_server(source: Source, host: str, port: int) -> ThreadingHTTPServer:
    """A server bound to host:port (port 0: any free one, see server.server_address)."""
    lock = threading.Lock()
    page = page_html()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/status":
                try:
                    with lock:
                        body, code = source(), 200
                except SourceError as e:
                    body, code = {"error": str(e)}, 503
                self._send(code, "application/json", json.dumps(body).encode())
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # a poll every two seconds is not worth a terminal line

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
