"""Bounded per-sender mailboxes for validated messages, keyed by tag.

Role: the meeting point of the transport's receiving loop (puts, on the asyncio thread) and
`recv` callers (blocking takes, on user threads). Each sender gets at most `max_messages`
messages and `max_bytes` bytes (stored plus reserved while a body is still arriving), so a
flooding peer fills only its own box. Messages nobody takes expire after `ttl_s`. A sender that
broke the stream protocol is marked lost: takes from it raise PeerLost when nothing with the tag
is waiting, until it delivers a valid message again. `wire.expect_reject` re-checks a filed message
against what a `recv` caller expects. Tags nobody will take any more are closed (`close_tag`: a
finished round's missing payloads; `close_prefix`: every message of a broken pipeline session):
what waits is dropped at once and what arrives later is dropped on arrival, both counted.

imports: stdlib and comms only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable

from comms.errors import PeerLost
from comms.wire import Kind, Message

CLOSED_TAGS = 1024  # per sender
_CLOSED_PREFIXES = 64  # broken sessions remembered (a neighbour notices a break within beats)


class Mailbox:
    def __init__(
        self,
        max_messages: int,
        max_bytes: int,
        ttl_s: float = 600.0,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        self.max_messages, self.max_bytes, self.ttl_s = max_messages, max_bytes, ttl_s
        self._on_drop = on_drop
        self._cond = threading.Condition()
        # sender -> tag -> deque of (arrival time, message, nbytes)
        self._boxes: dict[str, dict[str, deque[tuple[float, Message, int]]]] = defaultdict(dict)
        self._count: dict[str, int] = defaultdict(int)
        self._bytes: dict[str, int] = defaultdict(int)  # stored + reserved
        self._lost: dict[str, str] = {}  # sender -> why
        # tags nobody will take any more (a finished round's missing payloads): dropped on
        # arrival and counted as "late", so a frozen peer's stale contribution never lingers
        self._closed: dict[str, OrderedDict[str, None]] = defaultdict(OrderedDict)
        # averaging payloads refused on arrival (NaN, bad crc): tag -> why; a take of one
        # raises PeerLost, so its round leaves the sender out at once instead of at its deadline
        self._refused: dict[str, OrderedDict[str, str]] = defaultdict(OrderedDict)
        # tag prefixes nobody will take from anyone (a broken session's "epoch/"): "stale"
        self._closed_prefixes: OrderedDict[str, None] = OrderedDict()
        # told of each filed message (sender, tag) and each sender marked lost (sender, None)
        self._listeners: list[Callable[[str, str | None], None]] = []

    def on_put(self, fn: Callable[[str, str | None], None]) -> None:
        """Call fn(sender, tag) after each message filed and fn(sender, None) after a sender
        is marked lost (on that thread: keep it cheap)."""
        self._listeners.append(fn)

    def try_reserve(self, sender: str, nbytes: int) -> bool:
        """Reserve room for a message of nbytes (released by put or release)."""
        with self._cond:
            self._expire(sender, time.monotonic())
            self._evict_rounds(sender, nbytes)
            used = self._bytes[sender]
            # An empty box takes one message of any size (the transport caps sizes already).
            if self._count[sender] >= self.max_messages or (
                used and used + nbytes > self.max_bytes
            ):
                return False
            self._bytes[sender] += nbytes
            self._count[sender] += 1
            return True

    async def reserve(self, sender: str, nbytes: int, timeout_s: float) -> bool:
        """Wait (without blocking the event loop) until there is room, up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.try_reserve(sender, nbytes):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def release(self, sender: str, nbytes: int) -> None:
        with self._cond:
            self._bytes[sender] -= nbytes
            self._count[sender] -= 1
            self._cond.notify_all()

    def mark_lost(self, sender: str, why: str) -> None:
        with self._cond:
            self._lost[sender] = why
            self._cond.notify_all()
        for fn in self._listeners:
            fn(sender, None)

    def refuse(self, sender: str, tag: str, why: str) -> None:
        """sender's message `tag` arrived and was refused (its body failed a check): a take of
        `tag` from sender raises PeerLost while nothing valid with the tag waits. For averaging
        payloads: each is one frame a round, never sent again."""
        with self._cond:
            refused = self._refused[sender]
            refused[tag] = why
            while len(refused) > CLOSED_TAGS:
                refused.popitem(last=False)
            self._cond.notify_all()
        for fn in self._listeners:
            fn(sender, tag)

    def close_tag(self, sender: str, tag: str) -> int:
        """Nobody will take `tag` from sender any more: drop it now and when it arrives.
        Returns how many were waiting."""
        with self._cond:
            closed = self._closed[sender]
            closed[tag] = None
            while len(closed) > CLOSED_TAGS:
                closed.popitem(last=False)
            q = self._boxes.get(sender, {}).pop(tag, None)
            for _, _, nbytes in q or ():
                self._bytes[sender] -= nbytes
                self._count[sender] -= 1
                if self._on_drop is not None:
                    self._on_drop("late")
            return len(q or ())

    def close_prefix(self, prefix: str) -> int:
        """Nobody will take a tag starting with `prefix` from anyone (the messages of a broken
        pipeline session): drop those waiting now ("stale") and those that arrive later.
        Returns how many were dropped now."""
        if not prefix:
            raise ValueError("an empty prefix would close every tag")
        dropped = 0
        with self._cond:
            self._closed_prefixes[prefix] = None
            while len(self._closed_prefixes) > _CLOSED_PREFIXES:
                self._closed_prefixes.popitem(last=False)
            for sender, box in self._boxes.items():
                for tag in [t for t in box if t.startswith(prefix)]:
                    for _, _, nbytes in box.pop(tag):
                        self._drop(sender, nbytes, "stale")
                        dropped += 1
        return dropped

    def put(self, sender: str, msg: Message, nbytes: int) -> bool:
        """File a message whose room was reserved with reserve/try_reserve; False when its tag
        is closed (dropped, counted, its room given back)."""
        with self._cond:
            self._lost.pop(sender, None)
            if msg.name in self._closed.get(sender, ()):
                self._drop(sender, nbytes, "late")
                return False
            if any(msg.name.startswith(p) for p in self._closed_prefixes):
                self._drop(sender, nbytes, "stale")
                return False
            self._boxes[sender].setdefault(msg.name, deque()).append(
                (time.monotonic(), msg, nbytes)
            )
            self._cond.notify_all()
        for fn in self._listeners:
            fn(sender, msg.name)
        return True

    def take(self, sender: str, tag: str, deadline: float) -> Message | None:
        """Oldest message from sender with tag; None if none arrived by `deadline` (monotonic).
        Raises PeerLost if the sender is marked lost and nothing with that tag is waiting."""
        with self._cond:
            while True:
                q = self._boxes.get(sender, {}).get(tag)
                if q:
                    _, msg, nbytes = q.popleft()
                    if not q:
                        del self._boxes[sender][tag]
                    self._bytes[sender] -= nbytes
                    self._count[sender] -= 1
                    return msg
                if sender in self._lost:
                    raise PeerLost(f"{sender!r} is cut off: {self._lost[sender]}")
                if tag in self._refused.get(sender, ()):
                    raise PeerLost(
                        f"{sender!r}'s {tag!r} was refused: {self._refused[sender][tag]}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def take_prefix(self, sender: str, prefix: str, deadline: float) -> Message | None:
        """The oldest message from sender whose tag starts with prefix (see `take`)."""
        if not prefix:
            raise ValueError("an empty prefix would match every tag")
        with self._cond:
            while True:
                box = self._boxes.get(sender, {})
                waiting = [(q[0][0], tag) for tag, q in box.items() if tag.startswith(prefix)]
                if waiting:
                    _, tag = min(waiting)
                    q = box[tag]
                    _, msg, nbytes = q.popleft()
                    if not q:
                        del box[tag]
                    self._bytes[sender] -= nbytes
                    self._count[sender] -= 1
                    return msg
                if sender in self._lost:
                    raise PeerLost(f"{sender!r} is cut off: {self._lost[sender]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def pending(self, sender: str | None = None) -> int:
        """Messages waiting (from one sender, or from all)."""
        with self._cond:
            if sender is not None:
                return sum(len(q) for q in self._boxes.get(sender, {}).values())
            return sum(len(q) for box in self._boxes.values() for q in box.values())

    def _drop(self, sender: str, nbytes: int, why: str) -> None:
        """Give back the room of a message not filed (or taken out unread), and count it."""
        self._bytes[sender] -= nbytes
        self._count[sender] -= 1
        if self._on_drop is not None:
            self._on_drop(why)

    def _evict_rounds(self, sender: str, nbytes: int) -> None:
        """A full box makes room by dropping its oldest averaging payloads ("evicted"): those
        of rounds this peer is not running (it stalled, or its state was replaced) must not
        lock out a pipeline or state message behind them."""
        box = self._boxes.get(sender)
        while box and (
            self._count[sender] >= self.max_messages
            or (self._bytes[sender] and self._bytes[sender] + nbytes > self.max_bytes)
        ):
            rounds = [(q[0][0], tag) for tag, q in box.items() if q[0][1].kind == Kind.AVERAGE]
            if not rounds:
                return
            _, tag = min(rounds)
            q = box[tag]
            _, _, size = q.popleft()
            if not q:
                del box[tag]
            self._bytes[sender] -= size
            self._count[sender] -= 1
            if self._on_drop is not None:
                self._on_drop("evicted")

    def _expire(self, sender: str, now: float) -> None:
        box = self._boxes.get(sender)
        if not box:
            return
        for tag in list(box):
            q = box[tag]
            while q and now - q[0][0] > self.ttl_s:
                _, _, nbytes = q.popleft()
                self._bytes[sender] -= nbytes
                self._count[sender] -= 1
                if self._on_drop is not None:
                    self._on_drop("expired")
            if not q:
                del box[tag]
