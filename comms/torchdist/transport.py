"""Transport over torch.distributed: gloo point-to-point messages, group means over them.

Role: `TorchTransport` implements `comms.transport.Transport` inside a trusted cluster or on one
machine (the simulator, tests). Its process groups are built directly (ProcessGroupGloo over a
TCPStore), not through the global default group, so nothing here is process-global.

Point-to-point. A message is `wire.pack` bytes on one gloo group spanning every peer: one uint8
tensor [int64 length | first 64 KiB of the frame] (tag 1), then the rest of a larger frame
(tag 2); gloo lets a recv buffer be larger than what was sent, so a small message is one gloo
message. Per destination, a sender thread (comms.throttle.LinkSender: shaping, FIFO, `send`
returns at once); per source, a receiver thread that checks the declared length against
`max_message_bytes` BEFORE allocating the body, and a validator thread for large frames (so the
next recv is posted while the last body is checked; small ones are checked inline when nothing
is queued, order is kept) that runs `wire.unpack` (size, crc, finiteness), counts and drops
rejects, and files messages in a bounded per-sender mailbox (backpressure when full); `recv`
waits on the mailbox with a deadline.
Facts about gloo that shape this design (measured, torch 2.13, Python 3.11):
- A recv that times out closes EVERY pair of its group ("Application timeout caused pair
  closure"), so receiver threads wait without a deadline (group timeout of 30 days). A send
  completes only once the receiver posted its recv; `is_completed()` of a send/recv stays
  false until `wait()` is called, so p2p waits cannot be polled.
- gloo cannot skip bytes: a declared length over the limit (or negative) is counted as a reject
  and that link is cut (we stop reading from that sender; `recv` from it raises PeerLost).
- A dead peer resets its pairs: that link's threads see an error and mark it lost; survivors
  keep talking to each other.
- A blocked gloo wait cannot be interrupted (abort and shutdown do not wake it), and a daemon
  thread whose gloo wait returns while the interpreter exits aborts the process ("terminate
  called without an active exception": pybind11's noexcept GIL guard meets pthread_exit). So
  `close` (also registered with atexit) sends a goodbye (length -1) to each peer, whose
  receiver answers with its own; after `close_timeout_s`, threads still blocked on a frozen peer
  are woken by poisoning the p2p group on purpose (a 1 ms recv that times out), and then end.

Group means (an all-gather of wire frames over these links, kind AVERAGE; arriving frames go
to their round, not the mailbox): comms/torchdist/mean.py.

Bytes counted: 8 (length) + frame per message, goodbyes as kind "control", a round's frames as
kind "average" (one to each other member, whatever the round's outcome).

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from comms import wire
from comms.codecs import Encoded
from comms.errors import PeerLost, PeerTimeout
from comms.throttle import Delivery, LinkSender, LinkShapers, Shaping
from comms.torchdist.gloo import gloo_group
from comms.torchdist.mean import MAX_GROUP_NAME, GroupMeans, MeanGroup
from comms.transport import TransportStats
from comms.wire import Expect, Kind, Message, Reject

_TAG_HEAD, _TAG_REST, _TAG_POISON = 1, 2, 3
_HEAD = 64 << 10  # frame bytes that travel with the length: small frames take one gloo message
_BYE = -1  # declared length of the goodbye frame (no body)
_POISON_WAIT = timedelta(milliseconds=1)


def parse_rendezvous(addr: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' or 'HOST:PORT' -> (host, port)."""
    parts = urlsplit(addr if "://" in addr else f"tcp://{addr}")
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"rendezvous must be tcp://HOST:PORT, got {addr!r}")
    return parts.hostname, parts.port


@dataclass(eq=False)
class _Link:
    """What we know about one other peer."""

    name: str
    rank: int
    cond: threading.Condition = field(default_factory=threading.Condition)
    box: collections.deque[Message] = field(default_factory=collections.deque)
    box_bytes: int = 0
    closed: str = ""  # why no more messages will arrive ("" while open)
    sender: LinkSender | None = None
    receiver: threading.Thread | None = None
    validator: threading.Thread | None = None
    inbox: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=2))
    queued: int = 0  # items given to the validator and not yet done


class TorchTransport(GroupMeans):
    """Transport over torch.distributed (see the module docstring).

    Args:
        me: this peer's name; must be in peers.
        peers: every peer's name, in rank order (peers[0] hosts the rendezvous store).
        groups: averaging group name -> member names (order = summation order).
        rendezvous: "tcp://HOST:PORT" of the TCPStore (bound by peers[0], loopback in tests).
        timeout_s: startup deadline: every peer must arrive within it (else PeerTimeout).
        shaping: per-destination LinkProfile dict, one profile for every link, or None.
        max_message_bytes: largest declared p2p frame accepted (checked before allocating).
        host: address gloo binds and announces for its pairs.
        mailbox_messages / mailbox_bytes: bound of each sender's mailbox (backpressure).
        close_timeout_s: how long close() waits for goodbyes before abandoning threads.
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
    ) -> None:
        if me not in peers or len(set(peers)) != len(peers):
            raise ValueError(f"peers must be unique names including me={me!r}: {peers}")
        for g, members in groups.items():
            if len(g.encode()) > MAX_GROUP_NAME or not members or len(set(members)) != len(members):
                raise ValueError(f"group {g!r}: bad name or members {members}")
            if not set(members) <= set(peers):
                raise ValueError(f"group {g!r} names unknown peers {set(members) - set(peers)}")
        self.me, self.peers, self.timeout_s = me, list(peers), timeout_s
        self.rank = peers.index(me)
        self.max_message_bytes = max_message_bytes
        self.mailbox_messages, self.mailbox_bytes = mailbox_messages, mailbox_bytes
        self.close_timeout_s = close_timeout_s
        self.stats = TransportStats()
        self._limit = Expect(max_body_bytes=max_message_bytes)
        self._shapers = LinkShapers(me, shaping)
        self._closed = False
        self._stale: collections.deque[str] = collections.deque(maxlen=64)  # see drop_tags
        self._lock = threading.Lock()
        self._init_means()

        self._store = self._world = None
        self._groups: dict[str, MeanGroup] = {}
        self._links: dict[str, _Link] = {}
        try:
            self._connect(rendezvous, groups, host)
        except BaseException as e:
            self._closed = True
            self._release(stuck=list(self._links.values()))
            if isinstance(e, RuntimeError):  # DistStoreError, DistNetworkError, gloo connect
                raise PeerTimeout(f"{me}: startup at {rendezvous} failed: {e}"[:500]) from e
            raise

    def _connect(self, rendezvous: str, groups: dict[str, list[str]], host: str) -> None:
        """Rendezvous, the world group, receiver threads, a barrier."""
        me, peers, timeout_s = self.me, self.peers, self.timeout_s
        rz_host, port = parse_rendezvous(rendezvous)
        rz_timeout = timedelta(seconds=timeout_s)
        listen = None
        if self.rank == 0:  # bind the store ourselves: only on the rendezvous address
            listen = socket.create_server((rz_host, port), reuse_port=False)
        self._store = dist.TCPStore(
            rz_host,
            port,
            len(peers),
            self.rank == 0,
            rz_timeout,
            master_listen_fd=None if listen is None else listen.detach(),
        )
        self._world = gloo_group(
            dist.PrefixStore("mt/world", self._store), self.rank, len(peers), host
        )
        for g in sorted(groups):
            if me in groups[g]:
                self._groups[g] = MeanGroup(g, tuple(groups[g]))
        self._links = {p: _Link(p, r) for r, p in enumerate(peers) if p != me}
        for link in self._links.values():
            link.receiver = threading.Thread(
                target=self._receive_loop, args=(link,), name=f"recv<-{link.name}", daemon=True
            )
            link.validator = threading.Thread(
                target=self._validate_loop, args=(link,), name=f"check<-{link.name}", daemon=True
            )
            link.receiver.start()
            link.validator.start()
        _store_barrier(self._store, "mt/ready", len(peers), time.monotonic() + timeout_s)
        atexit.register(self.close)  # threads must not sit in gloo waits while Python exits

    # ---------------------------------------------------------------- Transport protocol

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> Delivery:
        """Frame enc now (a snapshot); the bytes leave from this link's sender thread."""
        frame = wire.pack(tag, kind, enc, step)
        return self._submit(self._link(to), frame, Kind(kind).name.lower(), len(frame))

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """The oldest message from frm named tag that matches expect (others with that tag
        that do not match are counted as rejects and dropped)."""
        link = self._link(frm)
        deadline = time.monotonic() + timeout_s
        with link.cond:
            while True:
                msg = self._take(link, tag)
                if msg is not None:
                    bad = wire.expect_reject(msg, expect)
                    if bad is None:
                        return msg
                    self.stats.add_reject(bad.reason)
                    continue
                if link.closed:
                    raise PeerLost(f"no message {tag!r} from {frm!r}: {link.closed}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout(f"no message {tag!r} from {frm!r} within {timeout_s}s")
                link.cond.wait(remaining)

    def drop_tags(self, prefix: str) -> int:
        """Drop waiting and later messages whose tag starts with prefix (a broken session's;
        a fixed grid's one session never breaks, so this serves the protocol and tests)."""
        if not prefix:
            raise ValueError("an empty prefix would close every tag")
        self._stale.append(prefix)
        dropped = 0
        for link in self._links.values():
            with link.cond:
                for msg in [m for m in link.box if m.name.startswith(prefix)]:
                    link.box.remove(msg)
                    link.box_bytes -= msg.held_bytes
                    self.stats.add_reject("stale")
                    dropped += 1
                link.cond.notify_all()
        return dropped

    def health(self) -> dict[str, Any]:
        """Messages (and their held bytes) waiting in the mailboxes, rounds open and round
        frames waiting for this member to start their round."""
        pending = held = 0
        for link in self._links.values():
            with link.cond:
                pending += len(link.box)
                held += link.box_bytes
        with self._mean_cond:
            open_rounds = sum(len(g.open) for g in self._groups.values())
            early = sum(len(f) for g in self._groups.values() for f in g.early.values())
        return {
            "mailbox_pending": pending,
            "mailbox_bytes": held,
            "rounds_open": open_rounds,
            "round_frames_early": early,
        }

    def close(self) -> None:
        """Say goodbye to every peer, stop our threads, release the process groups; idempotent.

        Threads still blocked on a peer after close_timeout_s (a frozen peer) are woken by
        poisoning the p2p group (a 1 ms recv that times out closes all its pairs): a thread
        left inside a gloo wait that returns while the interpreter exits aborts the process
        (pybind11 + Python 3.11), so none may be left behind.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        deadline = time.monotonic() + self.close_timeout_s
        for link in self._links.values():
            if not link.closed.startswith("lost"):
                self._sender(link).finish((b"", "control", _BYE))
        self._close_means()  # open rounds fail ("transport closed"), the rounds' thread ends
        p2p = [t for ln in self._links.values() for t in (ln.sender, ln.receiver, ln.validator)]
        _join_all(p2p, deadline)
        self._release(stuck=[link for link in self._links.values() if _alive(link)])

    def _release(self, stuck: list[_Link]) -> None:
        """Wake threads stuck in gloo waits (poison), wake recv() callers, free the groups."""
        if stuck and self._world is not None:
            with contextlib.suppress(Exception):  # the timed-out recv closes every pair
                dummy = torch.empty(1, dtype=torch.int64)
                self._world.recv([dummy], stuck[0].rank, _TAG_POISON).wait(_POISON_WAIT)
            threads = [t for ln in stuck for t in (ln.sender, ln.receiver, ln.validator)]
            _join_all(threads, time.monotonic() + 1.0)
        for link in self._links.values():
            self._mark_closed(link, "transport closed")
        if self._world is not None:
            with contextlib.suppress(Exception):
                self._world.shutdown()
        self._groups = {}  # start_mean after close: "not in a group"
        self._store = None  # peers[0]: stops the rendezvous server, frees its port

    def __enter__(self) -> TorchTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- test hooks (bad peers)

    def _send_raw(self, to: str, data: bytes, declared_len: int | None = None) -> Delivery:
        """Send arbitrary bytes as one frame (declared_len != len(data): length only, no body)."""
        n = len(data) if declared_len is None else declared_len
        return self._submit(self._link(to), bytes(data), "raw", n)

    # ---------------------------------------------------------------- point-to-point internals

    def _link(self, name: str) -> _Link:
        link = self._links.get(name)
        if link is None:
            raise ValueError(f"unknown peer {name!r} (me={self.me!r})")
        return link

    def _sender(self, link: _Link) -> LinkSender:
        with self._lock:
            if link.sender is None:
                link.sender = LinkSender(
                    link.name,
                    lambda item: self._deliver(link, item),
                    self._shapers.for_peer(link.name),
                    on_lost=lambda e: self._mark_closed(link, f"lost: {e}"),
                )
            return link.sender

    def _submit(self, link: _Link, frame: bytes, kind: str, declared: int) -> Delivery:
        if self._closed:
            return Delivery.failed(link.name, PeerLost("transport closed"))
        return self._sender(link).submit((frame, kind, declared), 8 + len(frame))

    def _deliver(self, link: _Link, item: tuple[bytes, str, int]) -> None:
        """Sender thread: one gloo message with the length and the first _HEAD frame bytes
        (all of a small frame), then the rest if any (only when the length is the true one)."""
        frame, kind, declared = item
        head = struct.pack("<q", declared) + frame[:_HEAD]
        self._world.send([torch.frombuffer(head, dtype=torch.uint8)], link.rank, _TAG_HEAD).wait()
        if declared == len(frame) > _HEAD:
            rest = torch.frombuffer(frame, dtype=torch.uint8, offset=_HEAD)
            self._world.send([rest], link.rank, _TAG_REST).wait()
        self.stats.add_sent(link.name, kind, 8 + len(frame))

    def _receive_loop(self, link: _Link) -> None:
        """Receiver thread for one source: frames off the wire. Small frames are checked right
        here when nothing is queued; large ones go to the link's validator, so the next recv is
        posted while the last body is checked. Order is kept either way."""
        try:
            while True:
                head = torch.zeros(8 + _HEAD, dtype=torch.uint8)  # zeros: short sends read 0s
                self._world.recv([head], link.rank, _TAG_HEAD).wait()
                n = int(head[:8].view(torch.int64).item())
                if n == _BYE:
                    item = ("bye", 8, None)
                elif not 0 <= n <= self.max_message_bytes:  # cannot skip n bytes: cut the link
                    item = ("cut", n, None)
                elif n <= _HEAD:
                    item = ("body", n, head[8 : 8 + n].clone())
                else:
                    body = torch.empty(n, dtype=torch.uint8)  # n was checked: allocate
                    body[:_HEAD].copy_(head[8:])
                    self._world.recv([body[_HEAD:]], link.rank, _TAG_REST).wait()
                    item = ("body", n, body)
                if self._dispatch(link, item):
                    return
        except Exception as e:  # noqa: BLE001 - a reset pair means the peer is gone
            self._dispatch(link, ("lost", 0, f"lost: {str(e)[:200]}"))

    def _dispatch(self, link: _Link, item: tuple[str, int, object]) -> bool:
        """Handle item here if the validator is idle and item is cheap, else queue it; True
        for the link's last item."""
        with link.cond:
            inline = link.queued == 0 and (item[0] != "body" or item[1] <= _HEAD)
            if not inline:
                link.queued += 1
        if inline:
            return self._check(link, *item)
        link.inbox.put(item)
        return item[0] != "body"

    def _validate_loop(self, link: _Link) -> None:
        """Validator thread for one source: queued items in arrival order."""
        while True:
            item = link.inbox.get()
            done = self._check(link, *item)
            with link.cond:
                link.queued -= 1
            if done:
                return

    def _check(self, link: _Link, what: str, n: int, item: object) -> bool:
        """wire.unpack (size, crc, finiteness), count, file in the mailbox; or the goodbye,
        cut or loss of the link. True when no more items will come from it."""
        if what == "body":
            got = wire.unpack(memoryview(item.numpy()), self._limit)
            kind = got.kind.name.lower() if isinstance(got, Message) else "invalid"
            self.stats.add_received(link.name, kind, 8 + n)
            if isinstance(got, Reject):
                self.stats.add_reject(got.reason)
                if got.reason == "not_finite":  # a round's payload: its round says refused
                    raw = wire.unpack(memoryview(item.numpy()), self._limit, check_finite=False)
                    if isinstance(raw, Message) and raw.kind == Kind.AVERAGE:
                        self._mean_rejected(link.name, raw.name, got.reason)
            else:
                self._file(link, got)
            return False
        if what == "bye":
            self.stats.add_received(link.name, "control", 8)
            self._peer_left(link)
        elif what == "cut":
            self.stats.add_received(link.name, "invalid", 8)
            self.stats.add_reject("too_large" if n > 0 else "malformed")
            self._mark_closed(link, f"broken: peer declared a {n}-byte frame")
        else:
            self._mark_closed(link, item)
        return True

    def _file(self, link: _Link, msg: Message) -> None:
        nbytes = msg.held_bytes  # the body and its decoded copy: what the box really holds
        if any(msg.name.startswith(p) for p in self._stale):
            self.stats.add_reject("stale")
            return
        if msg.kind == Kind.AVERAGE:  # a round's frame goes to its round, never waits here
            self._file_mean(link.name, msg)
            return
        with link.cond:
            while link.box and (
                len(link.box) >= self.mailbox_messages
                or link.box_bytes + nbytes > self.mailbox_bytes
            ):
                if self._closed:
                    self.stats.add_reject("mailbox_closed")
                    return
                link.cond.wait(0.1)  # backpressure: the sender's gloo send waits on us
            link.box.append(msg)
            link.box_bytes += nbytes
            link.cond.notify_all()

    def _take(self, link: _Link, tag: str) -> Message | None:
        for i, msg in enumerate(link.box):
            if msg.name == tag:
                del link.box[i]
                link.box_bytes -= msg.held_bytes
                link.cond.notify_all()
                return msg
        return None

    def _mark_closed(self, link: _Link, why: str) -> None:
        with link.cond:
            link.closed = link.closed or why
            link.cond.notify_all()
        self._member_lost(link.name, link.closed)

    # ---------------------------------------------------------------- what the means use

    def _submit_to(self, name: str, frame: bytes, kind: str) -> Delivery:
        return self._submit(self._link(name), frame, kind, len(frame))

    def _link_lost(self, name: str) -> str:
        link = self._links.get(name)
        return "" if link is None else link.closed

    def _peer_left(self, link: _Link) -> None:
        """The peer said goodbye: its remaining messages stay readable; answer with ours so
        its receiver thread for us can end (drop what we still had queued for it)."""
        self._mark_closed(link, "peer closed")
        self._sender(link).finish((b"", "control", _BYE), drop_pending=True)


def _store_barrier(store: dist.Store, key: str, n: int, deadline: float) -> None:
    store.add(key, 1)
    while store.add(key, 0) < n:
        if time.monotonic() > deadline:
            raise PeerTimeout(f"only {store.add(key, 0)} of {n} peers ready in time")
        time.sleep(0.01)


def _alive(link: _Link) -> bool:
    """True while a thread of this link may still sit in a gloo wait."""
    threads = (link.receiver, link.sender._thread if link.sender else None)
    return any(t is not None and t.is_alive() for t in threads)


def _join_all(threads: list, deadline: float) -> bool:
    """Join threads (or LinkSenders) until deadline; True if all ended."""
    ok = True
    for t in threads:
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
            ok &= not (t.is_alive() if isinstance(t, threading.Thread) else t.alive)
    return ok
