"""What travels on TorchTransport's pairs: frames out on a link's sender thread, frames in on its
receiver thread (the declared length checked before the body is allocated), large bodies
validated on the link's validator thread, messages filed in the mailbox or handed to their
averaging round, and a link's goodbye, cut or loss (comms/torchdist/transport.py's docstring
has the protocol and the facts about gloo it rests on).

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import torch

from comms import wire
from comms.group_means import GroupMeans
from comms.mailbox import Mailbox
from comms.stats import TransportStats
from comms.torchdist.gloo import FOREVER
from comms.torchdist.link import END, Link
from comms.wire import Expect, Kind, Message, Reject

TAG_HEAD, TAG_REST = 1, 2
HEAD_BYTES = 64 << 10  # frame bytes that travel with the length: small frames take one message
BYE = -1  # declared length of the goodbye frame (no body)


class PairWire:
    """Frames on the pairs of one transport's links (see the module docstring). `closing` is
    the transport's: set, a full mailbox no longer holds a link's receiver."""

    def __init__(
        self,
        stats: TransportStats,
        mailbox: Mailbox,
        means: GroupMeans,
        limit: Expect,
        closing: threading.Event,
    ) -> None:
        self.stats, self.mailbox, self.means = stats, mailbox, means
        self.limit, self.closing = limit, closing

    def deliver(self, link: Link, pair: Any, item: tuple[bytes, str, int]) -> None:
        """Sender thread: one gloo message with the length and the first HEAD_BYTES frame bytes
        (all of a small frame), then the rest if any (only when the length is the true one)."""
        frame, kind, declared = item
        head = struct.pack("<q", declared) + frame[:HEAD_BYTES]
        head_t = torch.frombuffer(head, dtype=torch.uint8)
        pair.send([head_t], link.peer_rank, TAG_HEAD).wait(FOREVER)
        if declared == len(frame) > HEAD_BYTES:
            rest = torch.frombuffer(frame, dtype=torch.uint8, offset=HEAD_BYTES)
            pair.send([rest], link.peer_rank, TAG_REST).wait(FOREVER)
        self.stats.add_sent(link.name, kind, 8 + len(frame))

    def receive(self, link: Link, pair: Any) -> None:
        """The link's thread, for one pair: frames off the wire until the pair's last item.
        Small frames are checked right here when nothing is queued; large ones go to the
        link's validator, so the next recv is posted while the last body is checked. Order
        is kept either way."""
        try:
            while True:
                head = torch.zeros(8 + HEAD_BYTES, dtype=torch.uint8)  # zeros: short sends read 0s
                posted = pair.recv([head], link.peer_rank, TAG_HEAD)
                link.mark_receiving()
                posted.wait(FOREVER)
                n = int(head[:8].view(torch.int64).item())
                if n == BYE:
                    item = ("bye", 8, None)
                elif not 0 <= n <= self.limit.max_body_bytes:  # cannot skip n bytes: cut the link
                    item = ("cut", n, None)
                elif n <= HEAD_BYTES:
                    item = ("body", n, head[8 : 8 + n].clone())
                else:
                    body = torch.empty(n, dtype=torch.uint8)  # n was checked: allocate
                    body[:HEAD_BYTES].copy_(head[8:])
                    pair.recv([body[HEAD_BYTES:]], link.peer_rank, TAG_REST).wait(FOREVER)
                    item = ("body", n, body)
                if self._dispatch(link, item):
                    return
        except Exception as e:  # noqa: BLE001 - a reset pair means the peer is gone
            self._dispatch(link, ("lost", 0, f"lost: {str(e)[:200]}"))

    def _dispatch(self, link: Link, item: tuple[str, int, object]) -> bool:
        """Handle item here if the validator is idle and item is cheap, else queue it; True
        for the pair's last item."""
        with link.cond:
            inline = link.queued == 0 and (item[0] != "body" or item[1] <= HEAD_BYTES)
            if not inline:
                link.queued += 1
        if inline:
            return self._check(link, *item)
        link.inbox.put(item)
        return item[0] != "body"

    def validate_loop(self, link: Link) -> None:
        """Validator thread for one source: queued items in arrival order, every pair's."""
        while True:
            item = link.inbox.get()
            if item is END:
                return
            self._check(link, *item)
            with link.cond:
                link.queued -= 1
                link.cond.notify_all()

    def _check(self, link: Link, what: str, n: int, item: object) -> bool:
        """wire.unpack (size, crc, finiteness), count, file in the mailbox; or the goodbye,
        cut or loss of the pair. True when no more items will come from it."""
        if what == "body":
            got = wire.unpack(memoryview(item.numpy()), self.limit)
            kind = got.kind.name.lower() if isinstance(got, Message) else "invalid"
            self.stats.add_received(link.name, kind, 8 + n)
            if isinstance(got, Reject):
                self.stats.add_reject(got.reason)
                label = wire.frame_label(item[: wire.MAX_HEADER_BYTES].numpy())
                if label is not None and label[0] == Kind.AVERAGE:  # its round says refused
                    self.means.refused(link.name, label[1], got.reason)
            elif got.kind == Kind.AVERAGE:  # a round's frame: to its round, or early in the box
                self.means.file(link.name, got)
            else:
                self._file(link, got)
            return False
        if what == "bye":
            self.stats.add_received(link.name, "control", 8)
            self._peer_left(link)
        elif what == "cut":
            self.stats.add_received(link.name, "invalid", 8)
            self.stats.add_reject("too_large" if n > 0 else "malformed")
            self.mark_closed(link, f"broken: peer declared a {n}-byte frame")
        else:
            self.mark_closed(link, item)
        return True

    def _file(self, link: Link, msg: Message) -> None:
        """Into the mailbox, once it has room (backpressure: the sender's gloo send waits on
        us), unless we close or its sender is gone (its next pair drops the box anyway, and
        must not wait on us)."""

        def give_up() -> str:
            return (
                "mailbox_closed"
                if self.closing.is_set()
                else "stale"
                if link.seen_inc > link.inc
                else ""
            )

        nbytes = msg.held_bytes  # the body and its decoded copy: what the box really holds
        why = self.mailbox.wait_room(link.name, nbytes, give_up)
        if why:
            self.stats.add_reject(why)
        else:
            self.mailbox.put(link.name, msg, nbytes)

    def mark_closed(self, link: Link, why: str, life: int | None = None) -> None:
        """No more messages will come from the peer until its next incarnation forms a new
        pair; ours fail at once from now on, except after a cut (we stopped reading, the peer
        did not); `life`: only if that pair is still the link's current one."""
        with link.cond:
            if life is not None and life != link.lives:
                return
            link.closed = link.closed or why
            link.up = link.up and why.startswith("broken")
            link.cond.notify_all()
        self.mailbox.mark_lost(link.name, link.closed)  # its rounds stop waiting for it

    def _peer_left(self, link: Link) -> None:
        """The peer said goodbye: its remaining messages stay readable; answer with ours so
        its receiver thread for us can end (drop what we still had queued for it)."""
        self.mark_closed(link, "peer closed")
        if link.sender is not None:
            link.sender.finish((b"", "control", BYE), drop_pending=True)
