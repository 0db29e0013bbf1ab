"""The links of TorchTransport: one gloo group per pair of peers that talk, formed again when a
peer comes back as a new incarnation (a restarted process), while every other link stays up.

The rendezvous TCPStore (served by the process that launched the peers, so that it outlives
any of them; or by peers[0]) holds:
  mt/inc/NAME     the newest incarnation of peer NAME: a counter each transport start adds 1 to
  mt/left/NAME    the newest incarnation of NAME that closed (said goodbye)
  mt/changes      bumped after each of the above: the one key the watchers poll
  mt/pair/KEY/here/NAME, mt/pair/KEY/gloo/...
                  a pair's handshake and gloo's own rendezvous; KEY names both peers and both
                  incarnations, so a restarted peer never meets its old pair's keys.

One thread per link forms and receives: wait until the peer has an incarnation newer than the
last one tried and not closed -> handshake: write `here`, poll for the peer's, give up when the
peer's incarnation moves on or the transport closes -> the 2-member gloo group (rank 0: the
name that sorts first); its construction waits for the other member's address, which comes at
once since both are known to be there, and at most `timeout_s` (the other died in between: its
next incarnation forms a new pair) -> receive until the peer says goodbye, is lost, or is cut
-> wait for its next incarnation. Nothing here blocks a caller: while a link is down, sends to
that peer fail at once (PeerLost) and rounds go on without it.

A watcher thread polls mt/changes every WATCH_S and, when it moved, reads the linked peers'
incarnations. A link still up whose peer has a newer incarnation (the old process gone without
resetting the connection) is poisoned (a 1 ms recv that times out closes its pair), so its
receiver wakes and the link forms again. If the store goes away (peers[0] served it and died),
links that are up stay up and nothing forms again.

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from comms.errors import PeerTimeout
from comms.mailbox import Mailbox
from comms.throttle import LinkSender, LinkShapers
from comms.torchdist.gloo import gloo_device, pair_group
from comms.torchdist.link import END, Link, join_all
from comms.torchdist.pair_wire import PairWire

WATCH_S = 0.2  # how often a watcher polls the store for new or departed incarnations
HANDSHAKE_POLL_S = 0.05  # how often a forming link looks for the other side's `here`
# once a peer's process is there, the most its pair may take to form at our start (a handshake
# and a gloo connect: seconds on a 2-core box at load 40, where 3 s were not always enough)
FORM_S = 60.0
POISON_WAIT = timedelta(milliseconds=1)
TAG_POISON = 3
CHANGES = "mt/changes"


def inc_key(name: str) -> str:
    return f"mt/inc/{name}"


def left_key(name: str) -> str:
    return f"mt/left/{name}"


def pair_key(a: str, inc_a: int, b: str, inc_b: int) -> str:
    """The store prefix of the pair (a at inc_a, b at inc_b); the same from both sides
    (names length-prefixed: no two pairs share one)."""
    (lo, i_lo), (hi, i_hi) = sorted([(a, inc_a), (b, inc_b)])
    return f"mt/pair/{len(lo)}:{lo}.{i_lo}/{len(hi)}:{hi}.{i_hi}"


class PairLinks:
    """TorchTransport's links (see the module docstring): each Link's pairs formed, watched,
    poisoned and left; what travels on a pair is `wire`'s. `closing` is the transport's."""

    def __init__(
        self,
        me: str,
        timeout_s: float,
        peers: dict[str, Link],
        wire: PairWire,
        shapers: LinkShapers,
        mailbox: Mailbox,
        closing: threading.Event,
    ) -> None:
        self.me, self.timeout_s, self.by_name = me, timeout_s, peers
        self.wire, self._shapers, self.mailbox, self.closing = wire, shapers, mailbox, closing
        self.store: Any = None
        self._device: Any = None
        self._watcher: threading.Thread | None = None
        self._watch_wake = threading.Event()
        self._changed_at = time.monotonic()  # when the watcher last saw a peer start or leave
        self.incarnation = 0

    def open(self, store: Any, host: str, needed: set[str]) -> None:
        """Register this incarnation, start the watcher and a thread per link, and wait until
        every link is formed, or its peer closed and is not needed: PeerTimeout when a peer's
        process is not there within timeout_s (of our start, or of the latest start or leave
        in the run), or its pair not formed FORM_S after that."""
        self.store = store
        self._device = gloo_device(host)
        self._changed_at = time.monotonic()
        self.incarnation = int(store.add(inc_key(self.me), 1))
        store.add(CHANGES, 1)
        self._watcher = threading.Thread(target=self._watch_loop, name="pairs", daemon=True)
        self._watcher.start()
        for link in self.by_name.values():
            link.receiver = threading.Thread(
                target=self._link_loop, args=(link,), name=f"recv<-{link.name}", daemon=True
            )
            link.validator = threading.Thread(
                target=self.wire.validate_loop,
                args=(link,),
                name=f"check<-{link.name}",
                daemon=True,
            )
            link.receiver.start()
            link.validator.start()

        def settled(link: Link) -> bool:  # its messages can come in: a recv is posted
            return link.receiving or bool(link.closed and link.name not in needed)

        def started(link: Link) -> bool:  # a process of it is there (or it closed, not needed)
            return settled(link) or link.seen_inc > link.seen_left

        # a peer must start within timeout_s of our start or of the run's latest start (peers
        # of a grid on a loaded box arrive over more than one timeout_s, one after the other)
        self._wait_links(started, lambda: self._changed_at + self.timeout_s, "did not start")
        formed_by = time.monotonic() + FORM_S
        self._wait_links(
            settled, lambda: formed_by, f"formed no pair with us in {FORM_S}s", self._where
        )

    def _wait_links(self, ready: Any, deadline: Any, what: str, where: Any = None) -> None:
        for link in self.by_name.values():
            with link.cond:
                while not ready(link) and time.monotonic() < deadline():
                    link.cond.wait(min(0.1, max(0.0, deadline() - time.monotonic())))
        missing = [ln for ln in self.by_name.values() if not ready(ln)]
        if missing:
            names = [ln.name for ln in missing]
            said = "; ".join(where(ln) for ln in missing) if where else ""
            raise PeerTimeout(
                f"{self.me}: {names} {what} (timeout_s {self.timeout_s})"
                + (f": {said}" if said else "")
            )

    def _where(self, link: Link) -> str:
        """Where a link that did not form stands, on both sides: our thread's phase and the
        incarnations we saw, and whether the peer reached the handshake of the pair we wait
        on (if not, its thread for us never got past its previous pair)."""
        key = pair_key(self.me, self.incarnation, link.name, link.tried)
        try:
            theirs = "reached" if self.store.check([f"{key}/here/{link.name}"]) else "not reached"
        except Exception:  # noqa: BLE001 - the store is gone: say so, the timeout stands
            theirs = "unknown (store gone)"
        return (
            f"{link.name}: ours {link.phase} (its incarnation {link.seen_inc} seen, "
            f"{link.tried} tried, {link.seen_left} left), its handshake {theirs}"
        )

    def _link_loop(self, link: Link) -> None:
        try:
            while True:
                gave_up = f" ({link.phase})" if link.phase.startswith("gave up") else ""
                link.phase = "waiting for an incarnation" + gave_up
                inc = self._next_incarnation(link)
                if inc is None:
                    return
                pair = self._form(link, inc)
                if pair is not None and self._install(link, inc, pair):
                    link.phase = f"receiving from incarnation {inc}"
                    self.wire.receive(link, pair)  # until this pair's last item
                    link.phase = f"draining incarnation {inc}'s items"
                    with link.cond:  # the validator is done with this pair's items
                        while link.queued:
                            link.cond.wait(0.1)
        except Exception as e:  # noqa: BLE001 - the store is gone: this link forms no more
            self.wire.mark_closed(link, f"lost: the rendezvous store: {str(e)[:200]}")
        finally:
            link.inbox.put(END)

    def _next_incarnation(self, link: Link) -> int | None:
        """Wait for an incarnation of the peer to form a pair with; None once closing. A peer
        whose newest incarnation closed is marked so (nobody waits for it to start)."""
        while True:
            with link.cond:
                gone = False
                while not (self.closing.is_set() or gone):
                    if link.seen_inc > max(link.tried, link.seen_left):
                        link.tried = link.seen_inc
                        return link.seen_inc
                    gone = bool(link.seen_left) and not link.up and not link.closed
                    if not gone:
                        link.cond.wait()
                if not gone:
                    return None
            self.wire.mark_closed(link, "peer closed", link.lives)  # it left before we formed one

    def _form(self, link: Link, inc: int) -> Any:
        """The handshake, then the pair's gloo group; None when the peer's incarnation moved
        on, the transport closes, or the other side vanished mid-way."""
        key = pair_key(self.me, self.incarnation, link.name, inc)
        link.phase = f"in the handshake with incarnation {inc}"
        self.store.set(f"{key}/here/{self.me}", "1")
        theirs = [f"{key}/here/{link.name}"]
        while not self.store.check(theirs):
            with link.cond:
                if self.closing.is_set() or link.seen_inc != inc:
                    return None
                link.cond.wait(HANDSHAKE_POLL_S)
        store = dist.PrefixStore(f"{key}/gloo", self.store.clone())  # its own connection
        link.phase = f"forming the gloo pair with incarnation {inc}"
        try:
            return pair_group(
                store, 1 - link.peer_rank, self._device, timedelta(seconds=self.timeout_s)
            )
        except RuntimeError as e:  # DistStoreError: the other died between handshake and group
            link.phase = f"gave up on incarnation {inc}: {str(e)[:120]}"
            return None

    def _install(self, link: Link, inc: int, pair: Any) -> bool:
        """The new pair carries the link from now on; what the previous incarnation left in
        the mailbox is dropped (counted stale)."""
        with link.cond:
            if self.closing.is_set():
                return False
            self.mailbox.reset(link.name)
            old = link.sender
            link.pair, link.inc, link.up, link.closed = pair, inc, True, ""
            link.lives += 1
            link.sender = LinkSender(
                link.name,
                functools.partial(self.wire.deliver, link, pair),
                self._shapers.for_peer(link.name),
                on_lost=functools.partial(self._sender_lost, link, link.lives),
            )
            link.cond.notify_all()
        if old is not None:
            old.finish(drop_pending=True)
        return True

    def _sender_lost(self, link: Link, life: int, error: BaseException) -> None:
        self.wire.mark_closed(link, f"lost: {error}", life)

    def _watch_loop(self) -> None:
        seen = -1
        try:
            while not self.closing.is_set():
                changes = int(self.store.add(CHANGES, 0))
                if changes != seen:
                    seen, self._changed_at = changes, time.monotonic()
                    for link in self.by_name.values():
                        inc = int(self.store.add(inc_key(link.name), 0))
                        left = int(self.store.add(left_key(link.name), 0))
                        with link.cond:
                            link.seen_inc, link.seen_left = inc, left
                            stale = link.pair if link.up and inc > link.inc else None
                            link.cond.notify_all()
                        if stale is not None:  # its old process is gone: wake the receiver
                            self.poison(link, stale)
                self._watch_wake.wait(WATCH_S)
        except Exception:  # noqa: BLE001 - the store is gone: links that are up stay up
            return

    def poison(self, link: Link, pair: Any = None) -> None:
        """Close `pair` (default: the link's current one): a recv that times out closes every
        pair of its group (here: the one), which wakes a thread blocked on it."""
        pair = link.pair if pair is None else pair
        if pair is not None:
            with contextlib.suppress(Exception):
                dummy = torch.empty(1, dtype=torch.int64)
                pair.recv([dummy], link.peer_rank, TAG_POISON).wait(POISON_WAIT)

    def leave(self) -> None:
        """Tell the store this incarnation closed: peers stop waiting for it to start."""
        if not self.incarnation:
            return
        with contextlib.suppress(Exception):
            key = left_key(self.me)
            self.store.add(key, self.incarnation - int(self.store.add(key, 0)))
            self.store.add(CHANGES, 1)

    def wake(self) -> None:
        """Closing: wake the watcher and every thread waiting on a link's condition."""
        self._watch_wake.set()
        for link in self.by_name.values():
            with link.cond:
                link.cond.notify_all()

    def release(self, stuck: list[Link]) -> None:
        """Wake threads stuck in gloo waits (poison their pairs), wake recv() callers, free the
        groups and the store (the transport is closing)."""
        for link in stuck:
            self.poison(link)
        join_all([t for ln in stuck for t in ln.threads()], time.monotonic() + 1.0)
        for link in self.by_name.values():
            self.wire.mark_closed(link, "transport closed")
            if link.pair is not None and not link.alive():
                with contextlib.suppress(Exception):
                    link.pair.shutdown()
        if self._watcher is not None:
            self._watcher.join(1.0)
        self.store = None
