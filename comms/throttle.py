"""Link shaping in the transport: bandwidth, one-way latency and seeded jitter, per link.

Role: make a loopback link behave like a WAN link, for `meshtrain simulate` and for tests. The
kernel on our CI box has HTB/TBF but no netem (shared/reference/hivemind.md section 6), so latency
and jitter must be emulated here, on the sending side; bandwidth is emulated here too so nothing
needs root. tests/throttled/ cross-checks the bandwidth model against kernel `tc` shaping.

The model of one direction of one link (pure, in `LinkShaper.schedule` / `release_times`):
  start_i    = max(arrival_i, finish_{i-1})              the link carries one message at a time
  finish_i   = start_i + 8 * n_i / (bandwidth_mbps * 1e6)  n bytes occupy the link for n / rate
  delay_i    = max(0, latency + U(-jitter, +jitter))     U from random.Random(link seed)
  release_i  = max(release_{i-1}, finish_i + delay_i)    jitter never reorders a link
Bandwidth is a token bucket of depth zero (no burst: bytes leave at exactly the rate, like a
busy WAN uplink); `release_i` is when the receiver may see message i (its last byte). Links of
one peer whose profiles name the same `uplink` share one bandwidth (a home or office uplink
carries every destination's bytes): there `finish_{i-1}` is the uplink's last message, to any
of them, while latency, jitter and the release order stay per link. Bytes are
what the transport puts on the wire per message (its framing included). `LinkSender` is the
thread that sleeps until each release time and then calls the real transport, so `send()`
returns at once and messages still pipeline (message 2 is not held back by message 1's
latency). A sender that sleeps inline per chunk instead (`LinkShapers.delay_s`) pays the
latency once per chunk: give it whole messages.

imports: stdlib only (no torch, no mesh, no cli).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from comms.errors import PeerLost, PeerTimeout

T = TypeVar("T")


@dataclass(frozen=True)
class LinkProfile:
    """One link direction. bandwidth_mbps None = unlimited; latency/jitter are one-way, in ms."""

    bandwidth_mbps: float | None = None
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0
    # links of one peer (LinkShapers) whose profiles name the same uplink share its bandwidth
    uplink: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth_mbps is not None and not self.bandwidth_mbps > 0:
            raise ValueError(f"bandwidth_mbps must be > 0 or None, got {self.bandwidth_mbps!r}")
        if not self.latency_ms >= 0 or not self.jitter_ms >= 0:
            raise ValueError(f"latency_ms and jitter_ms must be >= 0, got {self}")

    @property
    def is_shaped(self) -> bool:
        return self.bandwidth_mbps is not None or self.latency_ms > 0 or self.jitter_ms > 0

    def transmit_s(self, nbytes: int) -> float:
        """Seconds n bytes occupy the link (0 when bandwidth is unlimited)."""
        if self.bandwidth_mbps is None:
            return 0.0
        return 8.0 * nbytes / (self.bandwidth_mbps * 1e6)


PROFILES: dict[str, LinkProfile] = {
    "datacenter": LinkProfile(bandwidth_mbps=10_000.0, latency_ms=0.1),
    "wan100": LinkProfile(bandwidth_mbps=100.0, latency_ms=20.0),
    "wan10": LinkProfile(bandwidth_mbps=10.0, latency_ms=100.0),
}

Shaping = Mapping[str, "LinkProfile | str"] | LinkProfile | str | None


def link_seed(seed: int, stream: str) -> int:
    """Seed of one link's jitter stream ("src->dst"): distinct per link, stable across runs."""
    return (seed * 1_000_003 + zlib.crc32(stream.encode())) & 0xFFFFFFFF


class Wire:
    """The bandwidth one or more links share: when it finishes carrying its last message."""

    def __init__(self) -> None:
        self.finish = float("-inf")
        self.lock = threading.Lock()

    def carry(self, seconds: float, now: float) -> float:
        """Reserve the wire for `seconds` from `now` or its last message's end; that end."""
        with self.lock:
            self.finish = max(now, self.finish) + seconds
            return self.finish


class LinkShaper:
    """The timing model of one link direction (thread-safe; no sleeping here).

    Args:
        profile: the link's bandwidth, latency, jitter and seed.
        stream: mixed into the jitter seed ("src->dst", so links differ); "" = profile.seed.
        wire: the bandwidth it shares with other links (a peer's uplink); None: its own.
    """

    def __init__(self, profile: LinkProfile, stream: str = "", wire: Wire | None = None) -> None:
        self.profile = profile
        self._rng = random.Random(link_seed(profile.seed, stream) if stream else profile.seed)
        self._wire = Wire() if wire is None else wire
        self._release = float("-inf")  # release time of the last message
        self._lock = threading.Lock()

    def schedule(self, nbytes: int, now: float) -> float:
        """Reserve the link for a message of nbytes arriving at `now`; its release time."""
        p = self.profile
        with self._lock:
            finish = self._wire.carry(p.transmit_s(nbytes), now)
            delay = p.latency_ms
            if p.jitter_ms > 0:
                delay += self._rng.uniform(-p.jitter_ms, p.jitter_ms)
            self._release = max(self._release, finish + max(0.0, delay) / 1e3)
            return self._release

    def delay_s(self, nbytes: int, now: float | None = None) -> float:
        """schedule() as a delay from now: for senders that sleep inline (no LinkSender)."""
        now = time.monotonic() if now is None else now
        return max(0.0, self.schedule(nbytes, now) - now)


def release_times(
    profile: LinkProfile, sizes: Iterable[int], arrivals: Iterable[float], stream: str = ""
) -> list[float]:
    """Release time of each message (sizes in bytes, arrivals in s, non-decreasing): the pure
    model every LinkShaper follows, for tests and for planning."""
    shaper = LinkShaper(profile, stream)
    return [shaper.schedule(n, a) for n, a in zip(sizes, arrivals, strict=True)]


def resolve_profile(p: LinkProfile | str) -> LinkProfile:
    if isinstance(p, LinkProfile):
        return p
    if p in PROFILES:
        return PROFILES[p]
    raise ValueError(f"unknown link profile {p!r}; known: {', '.join(sorted(PROFILES))}")


class LinkShapers:
    """The shapers of one peer's outgoing links, built from a shaping spec.

    Args:
        me: this peer's name (seeds each link's jitter stream with "me->to").
        shaping: None (no shaping), one profile (or PROFILES name) for every link, or a dict
            destination -> profile; destinations missing from the dict are not shaped. Links
            whose profiles name the same `uplink` share one Wire (its bandwidth).
    """

    def __init__(self, me: str, shaping: Shaping) -> None:
        self.me = me
        self._default: LinkProfile | None = None
        self._per_peer: dict[str, LinkProfile] = {}
        if isinstance(shaping, LinkProfile | str):
            self._default = resolve_profile(shaping)
        elif shaping is not None:
            self._per_peer = {k: resolve_profile(v) for k, v in shaping.items()}
        self._shapers: dict[str, LinkShaper | None] = {}
        self._uplinks: dict[str, Wire] = {}
        self._lock = threading.Lock()

    def for_peer(self, to: str) -> LinkShaper | None:
        with self._lock:
            if to not in self._shapers:
                p = self._per_peer.get(to, self._default)
                shaper = None
                if p is not None and p.is_shaped:
                    wire = self._uplinks.setdefault(p.uplink, Wire()) if p.uplink else None
                    shaper = LinkShaper(p, f"{self.me}->{to}", wire)
                self._shapers[to] = shaper
            return self._shapers[to]

    def delay_s(self, to: str, nbytes: int) -> float:
        """Seconds to hold nbytes for `to` before handing them to the real link (0 unshaped)."""
        s = self.for_peer(to)
        return 0.0 if s is None else s.delay_s(nbytes)


class Delivery:
    """Handle of one queued message (a comms.transport.SendHandle, a comms.means.Sent)."""

    def __init__(self, to: str) -> None:
        self.to = to
        self._left: cf.Future[None] = cf.Future()  # done when the bytes left, or never will
        self._cancel: Callable[[], None] | None = None  # set by the LinkSender that queued it

    def done(self) -> bool:
        return self._left.done()

    def error(self) -> BaseException | None:
        """Why the bytes never left, once done; None otherwise."""
        return self._left.exception(0) if self._left.done() else None

    def taken(self) -> None:
        """None: a link without acknowledgements cannot tell whether the peer used them."""
        return None

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call fn() once done (at once if it is; else on the thread that finishes it)."""
        self._left.add_done_callback(lambda _: fn())

    def cancel(self) -> None:
        """Take the message out of its queue if it has not left yet (it fails: PeerLost)."""
        if self._cancel is not None:
            self._cancel()

    def wait(self, timeout_s: float) -> None:
        """Block until the bytes left; PeerTimeout after timeout_s, PeerLost if they never will."""
        try:
            self._left.result(timeout_s)
        except cf.TimeoutError:
            if self._left.done():  # the send's own error (a PeerTimeout is a TimeoutError)
                raise
            raise PeerTimeout(f"send to {self.to!r} not delivered within {timeout_s}s") from None

    def _finish(self, error: BaseException | None = None) -> None:
        try:
            if error is None:
                self._left.set_result(None)
            else:
                self._left.set_exception(error)
        except cf.InvalidStateError:  # finished already (sent, then cancelled too late)
            return

    @classmethod
    def failed(cls, to: str, error: BaseException) -> Delivery:
        d = cls(to)
        d._finish(error)
        return d


SENDER_MAX_ITEMS = 4096  # LinkSender's default bound on queued items
SENDER_MAX_BYTES = 1 << 30  # and on their bytes


class LinkSender(Generic[T]):
    """A queue and a thread per destination: holds each item until the shaper's release time,
    then calls `deliver(item)` (which may block: e.g. a gloo send). FIFO; send returns at once.

    Args:
        to: destination name (for messages and thread names).
        deliver: moves one item over the real link; an exception marks the link lost.
        shaper: the link's timing model, or None to deliver as fast as the link goes.
        on_lost: called once (from the sender thread) with the error when deliver raised.
        max_items / max_bytes: what may wait in the queue at once; a submit beyond either is
            refused at once (its handle fails with PeerTimeout, counted in `refused`): a peer
            that stops reading must not grow its senders' memory for the rest of the run.
    """

    def __init__(
        self,
        to: str,
        deliver: Callable[[T], None],
        shaper: LinkShaper | None = None,
        on_lost: Callable[[BaseException], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_items: int = SENDER_MAX_ITEMS,
        max_bytes: int = SENDER_MAX_BYTES,
    ) -> None:
        self.to, self._deliver, self._shaper, self._on_lost = to, deliver, shaper, on_lost
        self._clock = clock
        self.max_items, self.max_bytes = max_items, max_bytes
        self.refused = 0  # submits refused because the queue was full
        self._queued_bytes = 0
        # (release time, item, handle, nbytes)
        self._queue: collections.deque[tuple[float, T, Delivery, int]] = collections.deque()
        self._cond = threading.Condition()
        self._final: tuple[T, Delivery] | None = None  # last item (e.g. goodbye), then exit
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"send->{to}", daemon=True)
        self._thread.start()

    def submit(self, item: T, nbytes: int) -> Delivery:
        """Queue item (nbytes long on the wire); the handle completes when deliver returned."""
        with self._cond:
            if self._error is not None or self._final is not None:
                error = self._error or PeerLost(f"link to {self.to!r} closed")
                return Delivery.failed(self.to, error)
            queued = len(self._queue)
            if queued >= self.max_items or self._queued_bytes + nbytes > self.max_bytes:
                self.refused += 1
                return Delivery.failed(
                    self.to,
                    PeerTimeout(
                        f"link to {self.to!r}: {queued} messages ({self._queued_bytes} bytes) "
                        "already wait to be sent; the link does not keep up"
                    ),
                )
            now = self._clock()
            release = self._shaper.schedule(nbytes, now) if self._shaper else now
            d = Delivery(self.to)
            d._cancel = lambda: self._drop(d)
            self._queue.append((release, item, d, nbytes))
            self._queued_bytes += nbytes
            self._cond.notify()
            return d

    @property
    def queued(self) -> int:
        """Items waiting to be sent."""
        with self._cond:
            return len(self._queue)

    def finish(self, final: T | None = None, drop_pending: bool = False) -> Delivery:
        """Deliver `final` after the queue (or instead of it, with drop_pending), then stop.
        Idempotent: only the first call's item is sent."""
        with self._cond:
            if drop_pending:
                self._fail_queue(PeerLost(f"link to {self.to!r} closed"))
            if self._final is None:
                self._final = (final, Delivery(self.to))
                self._cond.notify()
            return self._final[1]

    def join(self, timeout_s: float) -> bool:
        self._thread.join(max(0.0, timeout_s))
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def lost(self) -> BaseException | None:
        return self._error

    def _drop(self, d: Delivery) -> None:
        """Take d's item out of the queue if it is still there (Delivery.cancel)."""
        with self._cond:
            for entry in self._queue:
                if entry[2] is d:
                    self._queue.remove(entry)
                    self._queued_bytes -= entry[3]
                    break
            else:
                return
        d._finish(PeerLost(f"send to {self.to!r}: cancelled"))

    def _fail_queue(self, error: BaseException) -> None:
        while self._queue:
            self._queue.popleft()[2]._finish(error)
        self._queued_bytes = 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue:
                        release, item, d, nbytes = self._queue[0]
                        wait = release - self._clock()
                        if wait <= 0:
                            self._queue.popleft()
                            self._queued_bytes -= nbytes
                            is_final = False
                            break
                        self._cond.wait(wait)
                    elif self._final is not None:
                        (item, d), is_final = self._final, True
                        break
                    else:
                        self._cond.wait()
            if is_final and item is None:
                d._finish()
                return
            try:
                self._deliver(item)
            except BaseException as e:  # noqa: BLE001 - a broken link is a value, not a crash
                lost = PeerLost(f"link to {self.to!r} lost: {e}"[:300])
                with self._cond:
                    self._error = lost
                    d._finish(lost)
                    self._fail_queue(lost)
                    if self._final is not None:
                        self._final[1]._finish(lost)
                if self._on_lost is not None:
                    self._on_lost(lost)
                return
            d._finish()
            if is_final:
                return
