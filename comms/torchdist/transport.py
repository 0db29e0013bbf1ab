"""Transport over torch.distributed: gloo point-to-point messages, group means over them.

Role: `TorchTransport` implements `comms.transport.Transport` inside a trusted cluster or on one
machine (the simulator, tests). Its process groups are built directly (ProcessGroupGloo over a
TCPStore), not through the global default group, so nothing here is process-global.

Links. One 2-member gloo group per pair of peers that talk (`links`: every other peer by
default; the runtime passes a cell's pipeline neighbours and its stage's column), keyed in the
store by both peers and both incarnations, so a peer that is restarted forms new pairs with
the live peers while they keep their other links (comms/torchdist/pairs.py; a link is
comms/torchdist/link.py, what travels on its pairs comms/torchdist/pair_wire.py). The store is
served by whoever launched the peers (`serve_store=False`, comms.build.local_rendezvous) or by
peers[0]; only the former outlives every peer.

Point-to-point. A message is `wire.pack` bytes on the pair's group: one uint8 tensor [int64
length | first 64 KiB of the frame] (tag 1), then the rest of a larger frame (tag 2); gloo
lets a recv buffer be larger than what was sent, so a small message is one gloo message. Per
destination, a sender thread (comms.throttle.LinkSender: shaping, FIFO, `send` returns at once;
a new one for each pair); per source, a receiver thread that checks the declared length against
`max_message_bytes` BEFORE allocating the body, and a validator thread for large frames (so the
next recv is posted while the last body is checked; small ones are checked inline when nothing
is queued, order is kept) that runs `wire.unpack` (size, crc, finiteness), counts and drops
rejects, and files messages in the bounded per-sender mailbox (comms/mailbox.py; backpressure
when full, except for a sender whose next incarnation started: its message is dropped as stale,
so a full box never holds the link off a restarted peer); `recv` waits on the mailbox with a
deadline.
Facts about gloo that shape this design (measured, torch 2.13, Python 3.11):
- A recv that times out closes EVERY pair of its group ("Application timeout caused pair
  closure"), so receiver threads wait without a deadline. A group's own timeout (also that of
  any wait given none) is fixed at its construction (set_timeout does not reach the pairs), so
  a pair group is built with the startup deadline, which bounds its construction, and every
  send and recv on it waits with an explicit 30-day one. A send completes only once the
  receiver posted its recv; `is_completed()` of a send/recv stays false until `wait()` is
  called, so p2p waits cannot be polled.
- gloo cannot skip bytes: a declared length over the limit (or negative) is counted as a reject
  and that link is cut (we stop reading from that sender; `recv` from it raises PeerLost) until
  the peer's next incarnation.
- A dead peer resets its pairs: that link's threads see an error at once and mark it lost; the
  other pairs, on the same gloo device or not, keep working, and a pair formed again under new
  store keys with the peer's next process works.
- A blocked gloo wait cannot be interrupted (abort and shutdown do not wake it), and a daemon
  thread whose gloo wait returns while the interpreter exits aborts the process ("terminate
  called without an active exception": pybind11's noexcept GIL guard meets pthread_exit). So
  `close` (also registered with atexit) sends a goodbye (length -1) to each peer, whose
  receiver answers with its own; after `close_timeout_s`, threads still blocked on a frozen peer
  are woken by poisoning that peer's pair on purpose (a 1 ms recv that times out), and then end.
  A pair group still being built (the other side died between its handshake and its group)
  cannot be woken: its thread ends by itself within `timeout_s`.

Group means: comms/group_means.py over these links (`send_frame`); arriving AVERAGE frames go to
it, which keeps those of rounds not started yet in the mailbox.

Bytes counted: 8 (length) + frame per message, goodbyes as kind "control", a round's frames as
kind "average" (one to each other member, whatever the round's outcome).

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from comms import wire
from comms.codecs import Encoded
from comms.errors import PeerLost, PeerTimeout
from comms.group_means import GroupMeans
from comms.mailbox import Mailbox
from comms.means import MAX_GROUP_BYTES
from comms.throttle import Delivery, LinkShapers, Shaping
from comms.torchdist.gloo import store_client, store_server
from comms.torchdist.link import Link, join_all
from comms.torchdist.pair_wire import BYE, PairWire
from comms.torchdist.pairs import PairLinks
from comms.transport import Averaging, TransportStats
from comms.wire import Expect, Kind, Message


def parse_rendezvous(addr: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' or 'HOST:PORT' -> (host, port)."""
    parts = urlsplit(addr if "://" in addr else f"tcp://{addr}")
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"rendezvous must be tcp://HOST:PORT, got {addr!r}")
    return parts.hostname, parts.port


class TorchTransport(Averaging):
    """Transport over torch.distributed (see the module docstring).

    Args:
        me: this peer's name; must be in peers.
        peers: every peer's name, in rank order (peers[0] serves the store if serve_store).
        groups: averaging group name -> member names (order = summation order).
        rendezvous: "tcp://HOST:PORT" of the TCPStore (loopback in tests).
        timeout_s: startup deadline: every linked peer's process must be there within it
            (else PeerTimeout), unless it closed and is not needed (then each pair has
            pairs.FORM_S to form); also bounds building a pair group.
        shaping: per-destination LinkProfile dict, one profile for every link, or None.
        max_message_bytes: largest declared p2p frame accepted (checked before allocating).
        host: address gloo binds and announces for its pairs.
        mailbox_messages / mailbox_bytes: bound of each sender's mailbox (backpressure).
        close_timeout_s: how long close() waits for goodbyes before abandoning threads.
        links: the peers this one talks to (default: every other peer); must hold the other
            members of its groups.
        needed: the links startup waits for even when that peer closed before (its next
            process is waited for; default: every link). A link to a peer that closed and is
            not needed starts closed (PeerLost) and forms when the peer starts again.
        serve_store: peers[0] serves the store at `rendezvous` (False: someone else does,
            e.g. the launcher, and the links can form again after any peer restarts).
    """

    backend = "torch"

    def __init__(
        self,
        me: str,
        peers: list[str],
        groups: dict[str, list[str]],
        rendezvous: str,
        *,
        timeout_s: float = 10.0,
        shaping: Shaping = None,
        max_message_bytes: int = 256 << 20,
        host: str = "127.0.0.1",
        mailbox_messages: int = 64,
        mailbox_bytes: int = 1 << 30,
        close_timeout_s: float = 2.0,
        links: list[str] | None = None,
        needed: list[str] | None = None,
        serve_store: bool = True,
    ) -> None:
        if me not in peers or len(set(peers)) != len(peers):
            raise ValueError(f"peers must be unique names including me={me!r}: {peers}")
        linked = [p for p in peers if p != me] if links is None else list(links)
        if me in linked or len(set(linked)) != len(linked) or not set(linked) <= set(peers):
            raise ValueError(f"links must be other peers, each once: {links}")
        needed = linked if needed is None else list(needed)
        if not set(needed) <= set(linked):
            raise ValueError(f"needed peers {set(needed) - set(linked)} are not links")
        for g, members in groups.items():
            if (
                len(g.encode()) > MAX_GROUP_BYTES
                or not members
                or len(set(members)) != len(members)
            ):
                raise ValueError(f"group {g!r}: bad name or members {members}")
            if not set(members) <= set(peers):
                raise ValueError(f"group {g!r} names unknown peers {set(members) - set(peers)}")
            if me in members and not set(members) - {me} <= set(linked):
                raise ValueError(f"group {g!r}: no link to {set(members) - {me} - set(linked)}")
        self.me, self.peers, self.timeout_s = me, list(peers), timeout_s
        self.rank = peers.index(me)
        self.max_message_bytes = max_message_bytes
        self.mailbox_messages, self.mailbox_bytes = mailbox_messages, mailbox_bytes
        self.close_timeout_s = close_timeout_s
        self.stats = TransportStats()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.mailbox = Mailbox(mailbox_messages, mailbox_bytes, on_drop=self.stats.add_reject)
        self.means = GroupMeans(self, self.mailbox, {g: ms for g, ms in groups.items() if me in ms})
        limit = Expect(max_body_bytes=max_message_bytes)
        wire_ = PairWire(self.stats, self.mailbox, self.means, limit, self._closing)
        peers_linked = {p: Link(p, int(p < me)) for p in linked}
        self.links = PairLinks(
            me,
            timeout_s,
            peers_linked,
            wire_,
            LinkShapers(me, shaping),
            self.mailbox,
            self._closing,
        )
        self._server = None
        try:
            rz_host, port = parse_rendezvous(rendezvous)
            wait = timedelta(seconds=timeout_s)
            if serve_store and self.rank == 0:  # bind the store ourselves: on that address only
                store = self._server = store_server(rz_host, port, wait)
            else:
                store = store_client(rz_host, port, wait)
            self.links.open(store, host, set(needed))
        except BaseException as e:
            self._closing.set()
            self.links.leave()
            self.links.wake()
            self._release(stuck=list(self.links.by_name.values()))
            if isinstance(e, RuntimeError):  # DistStoreError, DistNetworkError, gloo connect
                raise PeerTimeout(f"{me}: startup at {rendezvous} failed: {e}"[:500]) from e
            raise
        atexit.register(self.close)  # threads must not sit in gloo waits while Python exits

    # ---------------------------------------------------------------- Transport protocol

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> Delivery:
        """Frame enc now (a snapshot); the bytes leave from this link's sender thread."""
        frame = wire.pack(tag, kind, enc, step)
        return self._submit(self._link(to), frame, Kind(kind).name.lower(), len(frame))

    def send_frame(self, to: str, frame: bytes) -> Delivery:
        """Queue frame bytes as they are (comms.means.RoundLink)."""
        label = wire.frame_label(frame[: wire.MAX_HEADER_BYTES])
        kind = label[0].name.lower() if label is not None else "raw"
        return self._submit(self._link(to), frame, kind, len(frame))

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """See comms.transport.Transport.recv (comms.mailbox.Mailbox.receive)."""
        self._link(frm)
        return self.mailbox.receive(frm, tag, expect, timeout_s)

    def wait_arrival(self, seen: int, timeout_s: float) -> int:
        """See comms.transport.Transport.wait_arrival."""
        return self.mailbox.wait_put(seen, timeout_s)

    def recv_prefix(self, frm: str, prefix: str, expect: Expect, timeout_s: float) -> Message:
        """See comms.transport.Transport.recv_prefix."""
        self._link(frm)
        return self.mailbox.receive_prefix(frm, prefix, expect, timeout_s)

    def drop_tags(self, prefix: str) -> int:
        """Drop waiting and later messages whose tag starts with prefix (a broken session's;
        a fixed grid's one session never breaks, so this serves the protocol and tests)."""
        return self.mailbox.close_prefix(prefix)

    def health(self) -> dict[str, Any]:
        """Messages (and their held bytes) waiting in the mailbox, rounds open."""
        return {
            "mailbox_pending": self.mailbox.pending(),
            "mailbox_bytes": self.mailbox.held_bytes(),
            **self.means.health(),
        }

    def close(self) -> None:
        """Say goodbye to every peer, stop our threads, release the pair groups; idempotent.

        Threads still blocked on a peer after close_timeout_s (a frozen peer) are woken by
        poisoning that peer's pair (a 1 ms recv that times out closes it): a thread left
        inside a gloo wait that returns while the interpreter exits aborts the process
        (pybind11 + Python 3.11), so none may be left behind.
        """
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
        atexit.unregister(self.close)
        self.links.leave()  # the peers' link threads stop waiting for this incarnation
        self.links.wake()
        deadline = time.monotonic() + self.close_timeout_s
        links = list(self.links.by_name.values())
        for link in links:  # a peer that said goodbye was answered then
            with link.cond:
                sender = link.sender if link.up else None
            if sender is not None:
                sender.finish((b"", "control", BYE))
        self.means.close()  # open rounds fail ("transport closed"), the rounds' thread ends
        join_all([t for ln in links for t in ln.threads()], deadline)
        self._release(stuck=[link for link in links if link.alive()])

    def _release(self, stuck: list[Link]) -> None:
        """The links released (comms.torchdist.pairs.PairLinks.release), then the store we
        served: it stops and frees its port."""
        self.links.release(stuck)
        self._server = None

    @property
    def incarnation(self) -> int:
        """This process's incarnation in the run's store (1 for the first start of a name)."""
        return self.links.incarnation

    def __enter__(self) -> TorchTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- point-to-point internals

    def _link(self, name: str) -> Link:
        link = self.links.by_name.get(name)
        if link is None:
            known = list(self.links.by_name)
            raise ValueError(f"unknown peer {name!r} (me={self.me!r}, links {known})")
        return link

    def _submit(self, link: Link, frame: bytes, kind: str, declared: int) -> Delivery:
        """To the current pair's sender; at once PeerLost while the link is down."""
        with link.cond:
            closed = self._closing.is_set()
            sender = link.sender if link.up and not closed else None
            why = "transport closed" if closed else link.closed or "not connected"
        if sender is None:
            return Delivery.failed(link.name, PeerLost(f"link to {link.name!r}: {why}"))
        return sender.submit((frame, kind, declared), 8 + len(frame))
