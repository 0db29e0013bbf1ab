"""One link of TorchTransport: what it knows about one other peer across its incarnations, and
the link's threads (comms/torchdist/pairs.py forms its pairs, pair_wire.py carries its frames).

imports: comms only.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from comms.throttle import LinkSender

END = ("end", 0, None)  # the last item of a link's validator


@dataclass(eq=False)
class Link:
    """What we know about one other peer, across its incarnations."""

    name: str
    peer_rank: int  # the peer's rank in our pair groups
    cond: threading.Condition = field(default_factory=threading.Condition)
    closed: str = ""  # why no more messages will arrive ("" while open or not formed yet)
    sender: LinkSender | None = None  # the current pair's
    receiver: threading.Thread | None = None  # forms the pairs and receives on them
    validator: threading.Thread | None = None
    inbox: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=2))
    queued: int = 0  # items given to the validator and not yet done
    pair: Any = None  # the current pair's gloo group (None before the first)
    inc: int = 0  # the peer's incarnation the current pair was formed with
    tried: int = 0  # the newest incarnation of the peer a pair was tried with
    up: bool = False  # the current pair carries messages
    lives: int = 0  # pairs formed with this peer so far
    receiving: bool = False  # a recv was posted on a pair (sends to us can complete)
    seen_inc: int = 0  # the peer's newest incarnation (the watcher's reading)
    seen_left: int = 0  # the newest incarnation of the peer that closed
    phase: str = "not started"  # where the link's thread is (said when a pair does not form)

    def mark_receiving(self) -> None:
        """The link's thread posted a recv: a start may end (a peer's send completes only once
        our recv is posted: a process frozen right after its start, with none posted, would
        hold the others' first sends)."""
        if not self.receiving:
            with self.cond:
                self.receiving = True
                self.cond.notify_all()

    def threads(self) -> list[Any]:
        return [self.sender, self.receiver, self.validator]

    def alive(self) -> bool:
        """True while a thread of this link may still sit in a gloo wait."""
        threads = (self.receiver, self.sender._thread if self.sender else None)
        return any(t is not None and t.is_alive() for t in threads)


def join_all(threads: list[Any], deadline: float) -> bool:
    """Join threads (or LinkSenders) until deadline; True if all ended."""
    ok = True
    for t in threads:
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
            ok &= not (t.is_alive() if isinstance(t, threading.Thread) else t.alive)
    return ok
