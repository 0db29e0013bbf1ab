"""What a stranger or a stalled peer can cost stays bounded: the dashboard's connections, a
link's send queue, a cell's loss curve (the p2p streams' limits: tests/integration/
test_p2p_limits.py)."""

import socket
import threading
import time
import urllib.request

import pytest

from comms.errors import PeerTimeout
from comms.throttle import LinkSender
from mesh.runtime.dashboard.rundir import Curve
from mesh.runtime.dashboard.server import make_server


def test_a_link_that_does_not_keep_up_refuses_more_than_its_bound():
    gate = threading.Event()
    sender = LinkSender("b", lambda _item: gate.wait(10), max_items=3, max_bytes=1000)
    try:
        first = sender.submit(0, 10)  # taken by the sender thread, blocked on the link
        while sender.queued:
            time.sleep(0.01)
        queued = [sender.submit(i, 10) for i in range(1, 4)]
        over = sender.submit(4, 10)
        assert over.done() and sender.queued == 3 and sender.refused == 1
        with pytest.raises(PeerTimeout, match="does not keep up"):
            over.wait(0)
        gate.set()
        for h in [first, *queued]:
            h.wait(5)
        assert sender.submit(5, 10).wait(5) is None  # room again once the link moved
        gate.clear()
        big = sender.submit(6, 999)  # bytes bound: 999 on the wire fits...
        while sender.queued:
            time.sleep(0.01)
        assert sender.submit(7, 600).done() is False  # one waiting
        assert sender.submit(8, 600).done() and sender.refused == 2  # 1200 bytes would wait
        gate.set()
        big.wait(5)
    finally:
        gate.set()
        sender.finish()
        sender.join(5)


def test_a_run_long_curve_stays_bounded_and_spans_the_whole_run():
    curve = Curve(keep=100)
    for step in range(100_000):
        curve.append((step, 1.0 / (step + 1)))
    points = list(curve)
    assert 50 <= len(points) <= 101 and len(curve) == len(points)
    steps = [s for s, _ in points]
    assert steps[0] == 0 and steps[-1] == 99_999 and steps == sorted(steps)
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert len(gaps) == 1  # evenly spread, the newest point added at the end


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


def test_the_dashboard_drops_half_requests_and_serves_from_a_bounded_pool():
    server = make_server(lambda: {"cells": []}, "127.0.0.1", 0, idle_s=0.5, workers=2, waiting=2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    socks = []
    try:
        for _ in range(6):  # a request line, never the end of its headers
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /api/status HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t0 = time.monotonic()
        while server.refused < 2 and time.monotonic() - t0 < 5:
            time.sleep(0.01)
        assert server.refused == 2  # 2 served, 2 waiting, the rest closed at once
        workers = [t for t in threading.enumerate() if t.name.startswith("dashboard")]
        assert len(workers) <= 2
        assert all(_closed_within(s, 5.0) for s in socks)  # every half request dropped
        assert time.monotonic() - t0 < 4.0 and server.timed_out == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
            assert r.status == 200 and r.read() == b'{"cells": []}'
    finally:
        for s in socks:
            s.close()
        server.shutdown()
        server.server_close()
