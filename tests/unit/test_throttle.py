"""comms/throttle.py: the link timing model (pure, no sleeping) and the sender thread's bookkeeping.
Real timed measurements live in the bench (mesh/bench/comms.py) and in tests/throttled/."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comms.errors import PeerLost, PeerTimeout
from comms.throttle import (
    PROFILES,
    Delivery,
    LinkProfile,
    LinkSender,
    LinkShaper,
    LinkShapers,
    link_seed,
    release_times,
)

MB = 125_000  # bytes that take 0.1 s at 10 Mbit/s


def test_profiles_and_validation() -> None:
    assert PROFILES["wan100"] == LinkProfile(bandwidth_mbps=100.0, latency_ms=20.0)
    assert PROFILES["wan10"] == LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0)
    assert PROFILES["datacenter"].is_shaped and not LinkProfile().is_shaped
    assert LinkProfile(bandwidth_mbps=8.0).transmit_s(1_000_000) == pytest.approx(1.0)
    assert LinkProfile().transmit_s(10**12) == 0.0
    for bad in ({"bandwidth_mbps": 0.0}, {"latency_ms": -1.0}, {"jitter_ms": float("nan")}):
        with pytest.raises(ValueError):
            LinkProfile(**bad)


def test_bandwidth_serializes_a_backlog() -> None:
    p = LinkProfile(bandwidth_mbps=10.0)
    assert release_times(p, [MB, MB, MB], [0.0, 0.0, 0.0]) == pytest.approx([0.1, 0.2, 0.3])
    # an idle link starts at the arrival; a busy one when the previous message finished
    assert release_times(p, [MB, MB, MB], [0.0, 0.05, 1.0]) == pytest.approx([0.1, 0.2, 1.1])


def test_latency_is_added_once_and_pipelines() -> None:
    p = LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0)
    # message 2 is not held back by message 1's latency: only by its transmission
    assert release_times(p, [MB, MB], [0.0, 0.0]) == pytest.approx([0.2, 0.3])
    lat_only = LinkProfile(latency_ms=20.0)
    assert release_times(lat_only, [10**9, 1], [5.0, 5.0]) == pytest.approx([5.02, 5.02])


def test_jitter_is_seeded_bounded_and_never_reorders() -> None:
    p = LinkProfile(latency_ms=50.0, jitter_ms=40.0, seed=3)
    arrivals = [i * 0.001 for i in range(200)]
    a = release_times(p, [100] * 200, arrivals, "x->y")
    assert a == release_times(p, [100] * 200, arrivals, "x->y")  # same seed and link: same
    assert a != release_times(p, [100] * 200, arrivals, "y->x")  # another link: another stream
    other_seed = LinkProfile(latency_ms=50.0, jitter_ms=40.0, seed=4)
    assert a != release_times(other_seed, [100] * 200, arrivals, "x->y")
    assert all(b >= c for b, c in zip(a[1:], a[:-1]))
    for t, r in zip(arrivals, a):
        assert t + 0.010 - 1e-12 <= r  # latency - jitter
    spread = {round(r - t, 4) for t, r in zip(arrivals, a)}
    assert len(spread) > 20  # jitter actually varies
    assert link_seed(3, "x->y") == link_seed(3, "x->y") != link_seed(4, "x->y")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=30),
    st.lists(st.floats(0, 5), min_size=1, max_size=30),
    st.floats(0.1, 1000),
    st.floats(0, 100),
    st.floats(0, 100),
)
def test_model_properties(sizes, gaps, mbps, lat_ms, jit_ms) -> None:
    n = min(len(sizes), len(gaps))
    sizes, arrivals = sizes[:n], [sum(gaps[: i + 1]) for i in range(n)]
    p = LinkProfile(mbps, lat_ms, jit_ms, seed=1)
    rel = release_times(p, sizes, arrivals)
    assert all(b >= a for a, b in zip(rel, rel[1:]))  # FIFO
    floor = max(0.0, lat_ms - jit_ms) / 1e3
    busy_until = float("-inf")
    for size, t, r in zip(sizes, arrivals, rel):
        busy_until = max(t, busy_until) + p.transmit_s(size)
        assert r >= busy_until + floor - 1e-9  # never faster than the link, never early
        assert r <= busy_until + (lat_ms + jit_ms) / 1e3 + 1e-9  # finish times only grow


def test_long_backlog_runs_at_the_bandwidth() -> None:
    p = LinkProfile(bandwidth_mbps=40.0, latency_ms=30.0, jitter_ms=10.0)
    rel = release_times(p, [64 * 1024] * 500, [0.0] * 500)
    rate_mbps = 8 * 64 * 1024 * 499 / (rel[-1] - rel[0]) / 1e6
    assert rate_mbps == pytest.approx(40.0, rel=0.01)


def test_shaper_delay_s_and_link_shapers() -> None:
    s = LinkShaper(LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0))
    assert s.delay_s(MB, now=10.0) == pytest.approx(0.2)
    assert s.delay_s(MB, now=10.0) == pytest.approx(0.3)  # the link is still busy
    shapers = LinkShapers("a", {"b": "wan10", "c": LinkProfile()})
    assert shapers.for_peer("b").profile == PROFILES["wan10"]
    assert shapers.for_peer("b") is shapers.for_peer("b")  # one model per link
    assert shapers.for_peer("c") is None and shapers.for_peer("d") is None
    assert shapers.delay_s("c", 10**9) == 0.0
    every = LinkShapers("a", "wan100")
    assert every.for_peer("x").profile == every.for_peer("y").profile == PROFILES["wan100"]
    assert LinkShapers("a", None).for_peer("x") is None
    with pytest.raises(ValueError, match="unknown link profile"):
        LinkShapers("a", "wan1")


def test_link_sender_fifo_and_final_item() -> None:
    got: list[int] = []
    gate = threading.Event()

    def deliver(item: int) -> None:
        gate.wait(5)
        got.append(item)

    s = LinkSender("b", deliver)
    handles = [s.submit(i, 10) for i in range(5)]
    bye = s.finish(99)
    assert s.submit(7, 10).done()  # after finish: refused at once
    with pytest.raises(PeerLost):
        s.submit(7, 10).wait(0)
    gate.set()
    bye.wait(5)
    for h in handles:
        h.wait(5)
    assert got == [0, 1, 2, 3, 4, 99]
    assert s.join(5) and not s.alive
    assert s.finish(100) is bye  # idempotent


def test_link_sender_failure_fails_the_queue_and_reports_once() -> None:
    gate, lost = threading.Event(), []

    def deliver(item: int) -> None:
        gate.wait(5)
        raise RuntimeError("Connection reset by peer")

    s = LinkSender("b", deliver, on_lost=lost.append)
    first, second = s.submit(1, 10), s.submit(2, 10)
    with pytest.raises(PeerTimeout):
        first.wait(0)
    gate.set()
    for h in (first, second):
        with pytest.raises(PeerLost, match="reset"):
            h.wait(5)
    assert s.join(5) and len(lost) == 1 and s.lost is lost[0]
    with pytest.raises(PeerLost):
        s.submit(3, 10).wait(0)


def test_link_sender_drop_pending() -> None:
    gate, started = threading.Event(), threading.Event()

    def deliver(item: int) -> None:
        started.set()
        gate.wait(5)

    s = LinkSender("b", deliver)
    busy = s.submit(1, 10)
    assert started.wait(5)  # item 1 is on the wire, item 2 still queued
    queued = s.submit(2, 10)
    bye = s.finish(3, drop_pending=True)
    with pytest.raises(PeerLost, match="closed"):
        queued.wait(1)
    gate.set()
    busy.wait(5)
    bye.wait(5)
    assert s.join(5)


def test_delivery_failed() -> None:
    d = Delivery.failed("x", PeerLost("gone"))
    assert d.done()
    with pytest.raises(PeerLost, match="gone"):
        d.wait(0)


def test_links_naming_one_uplink_share_its_bandwidth() -> None:
    """A peer's links on one uplink carry one message at a time between them (the bytes to
    every destination leave through the same wire); latency stays per link; a link on no
    uplink, or on another one, keeps its own bandwidth."""
    up = LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0, uplink="home")
    alone = LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0)
    far = LinkProfile(bandwidth_mbps=10.0, latency_ms=300.0, uplink="home")
    shapers = LinkShapers("a", {"b": up, "c": up, "d": alone, "e": far})
    b, c, d, e = (shapers.for_peer(n) for n in "bcde")
    t = 5.0
    assert b.schedule(MB, t) == pytest.approx(t + 0.1 + 0.1)  # the wire, then the latency
    assert c.schedule(MB, t) == pytest.approx(t + 0.2 + 0.1)  # waited for b's bytes
    assert d.schedule(MB, t) == pytest.approx(t + 0.1 + 0.1)  # its own wire
    assert e.schedule(MB, t) == pytest.approx(t + 0.3 + 0.3)  # behind b and c, its latency
    assert b.schedule(MB, t + 10) == pytest.approx(t + 10 + 0.2)  # an idle uplink: no wait
    # two peers' shapers never share: the uplink is a peer's own
    other = LinkShapers("z", {"b": up}).for_peer("b")
    assert other.schedule(MB, t) == pytest.approx(t + 0.2)
    # a backlog over n links of one uplink runs at the uplink's rate, not n times it
    many = LinkShapers("a", {str(i): up for i in range(4)})
    ends = [many.for_peer(str(i % 4)).schedule(MB, 0.0) for i in range(40)]
    assert max(ends) == pytest.approx(40 * 0.1 + 0.1)
