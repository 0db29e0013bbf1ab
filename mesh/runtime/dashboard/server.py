"""The dashboard's web server (stdlib http.server): GET / is page.html, GET /api/status the JSON
its script polls (the same that a test reads). One JSON source call at a time: a DHT scout and
the step clocks are not shared between threads.

What a visitor can hold is bounded: WORKERS threads serve connections, at most WAITING more
wait for one (further connections are closed at once, counted in `refused`), and a connection
that does not send its request within IDLE_S is closed (counted in `timed_out`).

imports: stdlib only.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from typing import Any

Source = Callable[[], dict[str, Any]]
IDLE_S = 10.0  # a connection's request must arrive within this long
WORKERS = 8  # threads serving connections
WAITING = 32  # connections queued for a free worker


class PooledHTTPServer(HTTPServer):
    """An HTTPServer whose connections are served by a bounded thread pool (see the module
    docstring), not a thread each."""

    def __init__(self, address: tuple[str, int], handler: Any, workers: int, waiting: int):
        # before binding: a failed bind calls server_close
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="dashboard")
        self._slots = threading.BoundedSemaphore(workers + waiting)
        self.refused = self.timed_out = self.failed = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a client that went away: its connection only
            self.failed += 1
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False)  # each connection ends within IDLE_S


class SourceError(Exception):
    """A poll that could not be answered now (the DHT did not answer): the page says why and
    polls again."""


def page_html() -> bytes:
    return resources.files(__package__).joinpath("page.html").read_bytes()


def make_server(
    source: Source,
    host: str,
    port: int,
    idle_s: float = IDLE_S,
    workers: int = WORKERS,
    waiting: int = WAITING,
) -> PooledHTTPServer:
    """A server bound to host:port (port 0: any free one, see server.server_address)."""
    lock = threading.Lock()
    page = page_html()

    class Handler(BaseHTTPRequestHandler):
        timeout = idle_s  # the socket's timeout: a half request is dropped after it

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

        def log_error(self, format: str, *args: Any) -> None:  # noqa: A002
            if format.startswith("Request timed out"):
                server.timed_out += 1

    server = PooledHTTPServer((host, port), Handler, workers, waiting)
    return server
