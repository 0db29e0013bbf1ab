"""Bounded per-sender mailboxes for validated messages, keyed by tag: both transports' one box.

Role: the meeting point of a transport's receiving side (puts, from its link threads or its
event loop) and `recv` callers (blocking takes, on user threads). Each sender gets at most
`max_messages` messages and `max_bytes` bytes (stored plus reserved while a body is still
arriving), so a flooding peer fills only its own box. A full box first drops its oldest
averaging frames ("evicted": rounds this peer is not running must not lock out a pipeline or
state message). Messages nobody takes expire after `ttl_s`. Room is reserved before a message
is filed: at once or not at all (`try_reserve`, `reserve` for an event loop), or by waiting
(`wait_room`: a link that cannot refuse a message holds its sender off instead).

A sender whose link is gone is marked lost (`mark_lost`, with listeners: comms.group_means ends the
rounds that wait for it): takes from it raise PeerLost when nothing with the tag is waiting,
until it delivers a valid message again or its link forms again (`reset`). The frames of
averaging rounds not started here wait here too (comms.group_means files and takes them). Tags of a
broken pipeline session are closed (`close_prefix`): what waits is dropped at once and what
arrives later is dropped on arrival, counted "stale". `receive` re-checks a filed message
against what a caller expects (`wire.expect_reject`).

imports: stdlib and comms only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable

from comms.errors import PeerLost, PeerTimeout
from comms.wire import Expect, Kind, Message, expect_reject

_CLOSED_PREFIXES = 64  # broken sessions remembered (a neighbour notices a break within beats)
ROOM_POLL_S = 0.1  # how often a wait for room looks whether to give up


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
        self.puts = 0  # messages filed so far (wait_put)
        self._cond = threading.Condition()
        # sender -> tag -> deque of (arrival time, message, nbytes)
        self._boxes: dict[str, dict[str, deque[tuple[float, Message, int]]]] = defaultdict(dict)
        self._count: dict[str, int] = defaultdict(int)
        self._bytes: dict[str, int] = defaultdict(int)  # stored + reserved
        self._lost: dict[str, str] = {}  # sender -> why
        # tag prefixes nobody will take from anyone (a broken session's "epoch/"): "stale"
        self._closed_prefixes: OrderedDict[str, None] = OrderedDict()
        self._lost_listeners: list[Callable[[str, str], None]] = []

    def on_lost(self, fn: Callable[[str, str], None]) -> None:
        """Call fn(sender, why) after each `mark_lost` (on that thread: keep it cheap)."""
        self._lost_listeners.append(fn)

    # ---------------------------------------------------------------- room

    def try_reserve(self, sender: str, nbytes: int) -> bool:
        """Reserve room for a message of nbytes (released by put or release)."""
        with self._cond:
            self._expire(sender, time.monotonic())
            self._evict_rounds(sender, nbytes)
            if self._full(sender, nbytes):
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

    def wait_room(self, sender: str, nbytes: int, give_up: Callable[[], str]) -> str:
        """Block until room for nbytes is reserved (""), or until give_up() names a reason to
        stop waiting (returned; nothing reserved). give_up is asked every ROOM_POLL_S."""
        while not self.try_reserve(sender, nbytes):
            why = give_up()
            if why:
                return why
            with self._cond:
                if self._full(sender, nbytes):
                    self._cond.wait(ROOM_POLL_S)
        return ""

    def release(self, sender: str, nbytes: int) -> None:
        with self._cond:
            self._bytes[sender] -= nbytes
            self._count[sender] -= 1
            self._cond.notify_all()

    # ---------------------------------------------------------------- senders and tags

    def mark_lost(self, sender: str, why: str) -> None:
        with self._cond:
            self._lost.setdefault(sender, why)
            self._cond.notify_all()
        for fn in self._lost_listeners:
            fn(sender, why)

    def lost(self, sender: str) -> str:
        """Why sender is cut off ("" while it is not)."""
        with self._cond:
            return self._lost.get(sender, "")

    def reset(self, sender: str) -> int:
        """Sender's link formed again (its next process): what its last one left is dropped
        ("stale") and it is no longer lost. Returns how many were dropped."""
        with self._cond:
            self._lost.pop(sender, None)
            box = self._boxes.pop(sender, {})
            dropped = 0
            for q in box.values():
                for _, _, nbytes in q:
                    self._drop(sender, nbytes, "stale")
                    dropped += 1
            self._cond.notify_all()
            return dropped

    def close_prefix(self, prefix: str) -> int:
        """Nobody will take a tag starting with `prefix` from anyone (the messages of a broken
        pipeline session): drop those waiting now ("stale") and those that arrive later.
        Returns how many were dropped now."""
        if not prefix:
            raise ValueError("an empty prefix would close every tag")
        with self._cond:
            self._closed_prefixes[prefix] = None
            while len(self._closed_prefixes) > _CLOSED_PREFIXES:
                self._closed_prefixes.popitem(last=False)
            return sum(
                self._drop_tags(sender, lambda t: t.startswith(prefix), "stale")
                for sender in list(self._boxes)
            )

    def drop_tags(self, sender: str, which: Callable[[str], bool], why: str) -> int:
        """Drop what waits from sender under the tags `which` accepts (counted `why`)."""
        with self._cond:
            return self._drop_tags(sender, which, why)

    # ---------------------------------------------------------------- messages

    def put(self, sender: str, msg: Message, nbytes: int) -> bool:
        """File a message whose room was reserved; False when its tag is closed (dropped,
        counted, its room given back)."""
        with self._cond:
            self._lost.pop(sender, None)
            if any(msg.name.startswith(p) for p in self._closed_prefixes):
                self._drop(sender, nbytes, "stale")
                return False
            self._boxes[sender].setdefault(msg.name, deque()).append(
                (time.monotonic(), msg, nbytes)
            )
            self.puts += 1
            self._cond.notify_all()
        return True

    def wait_put(self, seen: int, timeout_s: float) -> int:
        """Wait until a message is filed after the `seen`-th (or timeout_s); returns how many
        have been filed. A receiver that takes from several senders by prefix (a stage pool's
        cell) sleeps here instead of polling."""
        with self._cond:
            if self.puts == seen:
                self._cond.wait(timeout_s)
            return self.puts

    def take(self, sender: str, tag: str, deadline: float) -> Message | None:
        """Oldest message from sender with tag; None if none arrived by `deadline` (monotonic).
        Raises PeerLost if the sender is marked lost and nothing with that tag is waiting."""
        return self._take(sender, lambda box: tag if tag in box else None, deadline)

    def take_prefix(self, sender: str, prefix: str, deadline: float) -> Message | None:
        """The oldest message from sender whose tag starts with prefix (see `take`)."""
        if not prefix:
            raise ValueError("an empty prefix would match every tag")

        def oldest(box: dict[str, deque[tuple[float, Message, int]]]) -> str | None:
            waiting = [(q[0][0], t) for t, q in box.items() if t.startswith(prefix)]
            return min(waiting)[1] if waiting else None

        return self._take(sender, oldest, deadline)

    def receive(self, sender: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """The oldest message from sender named tag that matches expect (others with that tag
        that do not match are counted as rejects and dropped); PeerTimeout after timeout_s."""
        deadline = time.monotonic() + timeout_s
        late = f"no message {tag!r} from {sender!r} within {timeout_s}s"
        return self._receive(lambda: self.take(sender, tag, deadline), expect, late)

    def receive_prefix(self, sender: str, prefix: str, expect: Expect, timeout_s: float) -> Message:
        """`receive` of the oldest message whose tag starts with prefix."""
        deadline = time.monotonic() + timeout_s
        late = f"no message {prefix!r}* from {sender!r} within {timeout_s}s"
        return self._receive(lambda: self.take_prefix(sender, prefix, deadline), expect, late)

    def pending(self, sender: str | None = None) -> int:
        """Messages waiting (from one sender, or from all)."""
        with self._cond:
            if sender is not None:
                return sum(len(q) for q in self._boxes.get(sender, {}).values())
            return sum(len(q) for box in self._boxes.values() for q in box.values())

    def held_bytes(self) -> int:
        """Bytes the waiting messages hold (and room reserved for arriving ones)."""
        with self._cond:
            return sum(self._bytes.values())

    # ---------------------------------------------------------------- internals

    def _receive(self, take: Callable[[], Message | None], expect: Expect, late: str) -> Message:
        while True:
            msg = take()
            if msg is None:
                raise PeerTimeout(late)
            bad = expect_reject(msg, expect)
            if bad is None:
                return msg
            if self._on_drop is not None:  # dropped; keep waiting for a matching one
                self._on_drop(bad.reason)

    def _take(
        self,
        sender: str,
        pick: Callable[[dict[str, deque[tuple[float, Message, int]]]], str | None],
        deadline: float,
    ) -> Message | None:
        with self._cond:
            while True:
                box = self._boxes.get(sender, {})
                tag = pick(box)
                if tag is not None:
                    q = box[tag]
                    _, msg, nbytes = q.popleft()
                    if not q:
                        del box[tag]
                    self._bytes[sender] -= nbytes
                    self._count[sender] -= 1
                    self._cond.notify_all()  # room for a sender waiting in wait_room
                    return msg
                if sender in self._lost:
                    raise PeerLost(f"{sender!r} is cut off: {self._lost[sender]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def _full(self, sender: str, nbytes: int) -> bool:
        """No room for nbytes more (an empty box takes one message of any size: the
        transport caps sizes already)."""
        used = self._bytes[sender]
        return self._count[sender] >= self.max_messages or bool(
            used and used + nbytes > self.max_bytes
        )

    def _drop_tags(self, sender: str, which: Callable[[str], bool], why: str) -> int:
        box = self._boxes.get(sender, {})
        dropped = 0
        for tag in [t for t in box if which(t)]:
            for _, _, nbytes in box.pop(tag):
                self._drop(sender, nbytes, why)
                dropped += 1
        if dropped:
            self._cond.notify_all()
        return dropped

    def _drop(self, sender: str, nbytes: int, why: str) -> None:
        """Give back the room of a message not filed (or taken out unread), and count it."""
        self._bytes[sender] -= nbytes
        self._count[sender] -= 1
        if self._on_drop is not None:
            self._on_drop(why)

    def _evict_rounds(self, sender: str, nbytes: int) -> None:
        """A full box makes room by dropping its oldest averaging frames ("evicted")."""
        box = self._boxes.get(sender)
        while box and self._full(sender, nbytes):
            rounds = [(q[0][0], tag) for tag, q in box.items() if q[0][1].kind == Kind.AVERAGE]
            if not rounds:
                return
            tag = min(rounds)[1]
            q = box[tag]
            _, _, size = q.popleft()
            if not q:
                del box[tag]
            self._drop(sender, size, "evicted")

    def _expire(self, sender: str, now: float) -> None:
        box = self._boxes.get(sender)
        for tag in list(box or ()):
            q = box[tag]
            while q and now - q[0][0] > self.ttl_s:
                self._drop(sender, q.popleft()[2], "expired")
            if not q:
                del box[tag]
