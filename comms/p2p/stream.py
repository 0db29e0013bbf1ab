"""The message protocol of P2PTransport on libp2p streams (client and server side).

Role: `Streams` (one a P2PTransport, `transport.streams`) is its wire: a stream opened with
`P2P.call_binary_stream_handler` carries messages back to back, each one
  header (magic "MTP1", version, sender name length, total frame bytes) + sender name (utf-8)
  + the frame (`comms.wire.pack` bytes) in chunks of <= CHUNK_BYTES,
answered by one ack byte (`Ack`). Idle streams are pooled per peer (a 4 KiB message on a fresh
stream costs ~1.7 ms on loopback, on a pooled one ~0.2 ms).

The receiving side never trusts the peer: the declared length is checked against
`max_message_bytes` before a body byte is buffered (larger: refused, stream closed); the claimed
sender name must resolve (DHT) to the libp2p-authenticated PeerID of the stream; the sender's
mailbox must have room (reserved while the body arrives); then `wire.unpack` validates the bytes
off the event loop. Every refusal is counted in `stats.rejects` and answered, never raised.

What a stranger can cost us is bounded. A stream is unproven until its first message's sender
name resolves to the stream's PeerID: at most `max_unproven_streams` unproven streams are held
at once (UNPROVEN_PER_PEER per PeerID), the excess is closed at once ("stream_cap"); a header or
a sender name that does not arrive within `stream_idle_s` closes the stream ("stream_timeout";
between messages of a proven stream, quietly: the sender drops pooled streams idle for half of
that). Proving a name costs at most SENDER_LOOKUPS DHT gets, shared with any other stream
claiming it at the same time, and a name that failed to prove for a PeerID is refused without
a get for REFUSED_NAME_S (at most REFUSED_NAMES remembered).

It works with the transport's names (comms.p2p.names.Names: resolving, proving senders,
membership), counters, mailbox and averaging rounds (where AVERAGE frames go), its thread pool
(validation off the event loop) and, once up, its libp2p client.

imports: hivemind, comms only (no mesh, no cli).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from hivemind.p2p import P2P, PeerID

from comms import wire
from comms.errors import PeerLost
from comms.group_means import GroupMeans
from comms.mailbox import Mailbox
from comms.p2p.names import Names
from comms.p2p.peer_record import parse_records
from comms.transport import TransportStats
from comms.wire import Expect, Message, Reject

STREAM_MAGIC = b"MTP1"
STREAM_VERSION = 1
STREAM_HEAD = struct.Struct("<4sBBQ")  # magic, version, sender name length, total frame bytes
CHUNK_BYTES = 1 << 20  # well under hivemind's 4 MiB frame limit; the unit of writes and reads
HANDLER = "meshtrain.rpc_deliver"
_STREAMS_PER_PEER = 4
STREAM_IDLE_S = 10.0  # default stream_idle_s: a header or name not sent by then is not coming
MAX_UNPROVEN_STREAMS = 256  # default max_unproven_streams
UNPROVEN_PER_PEER = 16  # unproven streams one PeerID may hold open
SENDER_LOOKUPS = 5  # DHT gets to prove one stream's sender name, at most
SENDER_POLL_S = 0.2  # the first pause between them (x3 each time)
REFUSED_NAME_S = 2.0
REFUSED_NAMES = 1024
logger = logging.getLogger(__name__)


class Ack(IntEnum):
    OK = 0
    REJECTED = 1  # wire.unpack refused the bytes
    FULL = 2  # the sender's mailbox stayed full
    BAD_SENDER = 3  # claimed name does not resolve to the stream's PeerID
    TOO_LARGE = 4  # declared length > max_message_bytes; the body was never read
    BAD_STREAM = 5  # header magic/version/name unreadable
    DROPPED = 6  # valid, but nobody there will take it: a finished round's or a broken
    # session's message (counted late / stale there)


@dataclass(frozen=True)
class StreamLimits:
    """What a stream may cost us (see the module docstring)."""

    timeout_s: float  # a body's chunks, a send's ack
    stream_idle_s: float = STREAM_IDLE_S
    max_unproven_streams: int = MAX_UNPROVEN_STREAMS
    max_message_bytes: int = 256 << 20


class Streams:
    """Client and server side of the stream protocol (see the module docstring)."""

    def __init__(
        self,
        me: str,
        handler_name: str,
        limits: StreamLimits,
        names: Names,
        stats: TransportStats,
        mailbox: Mailbox,
        means: GroupMeans,
        pool: cf.ThreadPoolExecutor,
    ) -> None:
        self.me, self.handler_name, self.limits = me, handler_name, limits
        self.names, self.stats, self.mailbox = names, stats, mailbox
        self.means, self._pool = means, pool
        self.p2p: P2P | None = None  # the transport's libp2p client, once up
        # per peer: pooled streams (reader, writer, monotonic time they went idle)
        self._idle: dict[
            PeerID, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]
        ] = {}
        self._slots: dict[PeerID, asyncio.Semaphore] = {}  # streams in use per peer
        self._unproven: Counter[PeerID] = Counter()  # PeerID -> its open unproven streams
        # (name, PeerID) -> when it failed to prove
        self._refused_names: OrderedDict[tuple[str, PeerID], float] = OrderedDict()

    async def deliver(self, to: str, frame: bytes, deadline: float) -> Ack:
        """Send on a reused stream; on failure re-resolve the name and retry once on a new one."""
        errors = []
        failed = None  # the peer attempt 0 could not reach: attempt 1 prefers another record
        for attempt in range(2):
            rec = await self.names.resolve(to, deadline, refresh=attempt > 0, avoid=failed)
            if not self.names.admits(
                rec
            ):  # no run key, another config, or an outsider took the name
                self.stats.add_reject("unauthorized")
                raise PeerLost(f"{to!r} is not a member of this run: not sending to it")
            reused = bool(self._idle.get(rec.peer_id))
            try:
                return await self._send_on_stream(rec.peer_id, frame)
            except Exception as e:  # noqa: BLE001 - any stream failure is a lost link
                errors.append(f"{type(e).__name__}: {e}")
                failed = rec.peer_id
                if reused and attempt == 0:
                    self._drop_idle(rec.peer_id)  # the idle stream may just have gone stale
        raise PeerLost(f"send to {to!r} failed: {'; '.join(errors)}"[:500])

    async def _send_on_stream(self, peer: PeerID, frame: bytes) -> Ack:
        # At most _STREAMS_PER_PEER streams per peer: a burst of small sends queues for a
        # pooled stream (~0.2 ms a message) instead of opening hundreds (~1.7 ms each).
        slots = self._slots.setdefault(peer, asyncio.Semaphore(_STREAMS_PER_PEER))
        async with slots:
            return await self._send_on_pooled(peer, frame)

    async def _send_on_pooled(self, peer: PeerID, frame: bytes) -> Ack:
        idle = self._idle.get(peer)
        reader = writer = None
        while idle:  # the receiver closes a stream idle for stream_idle_s: leave it earlier
            reader, writer, since = idle.pop()
            if time.monotonic() - since < self.limits.stream_idle_s / 2:
                break
            writer.close()
            reader = writer = None
        if writer is None:
            assert self.p2p is not None, "sending before the transport's start"
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer, self.handler_name)
        ok = False
        try:
            me = self.me.encode()
            writer.write(STREAM_HEAD.pack(STREAM_MAGIC, STREAM_VERSION, len(me), len(frame)) + me)
            view = memoryview(frame)
            for off in range(0, len(frame), CHUNK_BYTES):
                writer.write(view[off : off + CHUNK_BYTES])
                await writer.drain()
            await writer.drain()
            ack = Ack((await reader.readexactly(1))[0])
            # the receiver keeps the stream open after these
            ok = ack in (Ack.OK, Ack.REJECTED, Ack.DROPPED)
            return ack
        finally:
            pool = self._idle.setdefault(peer, [])
            if ok and len(pool) < _STREAMS_PER_PEER:
                pool.append((reader, writer, time.monotonic()))
            else:
                writer.close()

    def _drop_idle(self, peer: PeerID) -> None:
        for _, w, _ in self._idle.pop(peer, []):
            w.close()

    def close_idle(self) -> None:
        """Close every pooled stream (the transport's teardown)."""
        for peer in list(self._idle):
            self._drop_idle(peer)

    def unproven_streams(self) -> int:
        """Incoming streams held open now whose sender is not proven yet."""
        return sum(self._unproven.values())

    async def serve(self, info: Any, reader: asyncio.StreamReader, writer: Any) -> None:
        """Serve one incoming stream: messages back to back until the sender closes it."""
        remote = info.peer_id
        if (
            self.unproven_streams() >= self.limits.max_unproven_streams
            or self._unproven[remote] >= UNPROVEN_PER_PEER
        ):
            self.stats.add_reject("stream_cap")
            writer.close()
            return
        self._unproven[remote] += 1
        proven = [False]  # set by _serve_one once a message's sender is proven
        try:
            while await self._serve_one(remote, reader, writer, proven):
                pass
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            self.stats.add_reject("truncated_stream")
        except asyncio.CancelledError:
            pass  # closing: end quietly (hivemind logs a cancelled handler as an error)
        except Exception as e:  # noqa: BLE001 - e.g. our DHT went away: drop this stream only
            self.stats.add_reject("stream_error")
            logger.debug("stream from %s failed: %r", info.peer_id, e)
        finally:
            if not proven[0]:
                self._unproven_done(remote)
            writer.close()

    def _unproven_done(self, remote: PeerID) -> None:
        self._unproven[remote] -= 1
        if self._unproven[remote] <= 0:
            del self._unproven[remote]

    async def _serve_one(
        self, remote: PeerID, reader: asyncio.StreamReader, writer: Any, proven: list[bool]
    ) -> bool:
        try:
            head = await asyncio.wait_for(
                reader.readexactly(STREAM_HEAD.size), self.limits.stream_idle_s
            )
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
            return False  # clean close between messages
        except TimeoutError:  # a half-open stream (or a member's pooled one gone idle)
            if not proven[0]:
                self.stats.add_reject("stream_timeout")
            return False
        magic, version, name_len, total = STREAM_HEAD.unpack(head)
        if magic != STREAM_MAGIC or version != STREAM_VERSION:
            return await self._refuse(writer, Ack.BAD_STREAM, "bad_stream")
        try:
            name = await asyncio.wait_for(reader.readexactly(name_len), self.limits.stream_idle_s)
            sender = name.decode("utf-8")
        except UnicodeDecodeError:
            return await self._refuse(writer, Ack.BAD_STREAM, "bad_stream")
        except TimeoutError:
            self.stats.add_reject("stream_timeout")
            return False
        is_sender = await self._is_sender(sender, remote)
        if is_sender and not proven[0]:  # a member's stream: no longer held against the cap
            proven[0] = True
            self._unproven_done(remote)
        if total > self.limits.max_message_bytes:  # before buffering a single body byte
            if is_sender:  # a peer that announces absurd lengths is cut off (like a broken link)
                self.mailbox.mark_lost(sender, f"announced {total} bytes")
            return await self._refuse(writer, Ack.TOO_LARGE, "too_large")
        if not is_sender:
            return await self._refuse(writer, Ack.BAD_SENDER, "bad_sender")
        # The frame's header says what the message will hold once decoded (an fp8 body is a
        # quarter of its float32 copy): the room reserved is that, not the frame's length.
        head = await asyncio.wait_for(
            reader.readexactly(min(total, wire.MAX_HEADER_BYTES)), self.limits.timeout_s
        )
        held = wire.held_bytes(head, max_body_bytes=self.limits.max_message_bytes)
        if isinstance(held, Reject):  # read past the body (in chunks, nothing kept): the
            self.stats.add_reject(held.reason)  # stream stays usable, as for a bad body
            for off in range(len(head), total, CHUNK_BYTES):
                n = min(CHUNK_BYTES, total - off)
                await asyncio.wait_for(reader.readexactly(n), self.limits.timeout_s)
            writer.write(bytes([Ack.REJECTED]))
            await writer.drain()
            return True
        if not await self.mailbox.reserve(sender, held, self.limits.timeout_s):
            return await self._refuse(writer, Ack.FULL, "mailbox_full")
        answer, handed = Ack.REJECTED, False
        try:
            res = await self._read_body(reader, total, head)
            if isinstance(res, Reject):
                self.stats.add_reject(res.reason)
                label = wire.frame_label(head)
                if label is not None and label[0] == wire.Kind.AVERAGE:
                    self.means.refused(sender, label[1], res.reason)  # its round says refused
            elif res.kind == wire.Kind.AVERAGE:  # to its round (its room is the round's affair)
                self.stats.add_received(sender, res.kind, total)
                answer = Ack.OK if self.means.file(sender, res) else Ack.DROPPED
            else:
                assert res.held_bytes == held, (res.held_bytes, held)
                handed = True  # put files it, or drops it and gives its room back itself
                filed = self.mailbox.put(sender, res, held)
                self.stats.add_received(sender, res.kind, total)
                answer = Ack.OK if filed else Ack.DROPPED
        finally:
            if not handed:
                self.mailbox.release(sender, held)
        writer.write(bytes([answer]))
        await writer.drain()
        return True

    async def _read_body(
        self, reader: asyncio.StreamReader, total: int, head: bytes
    ) -> Message | Reject:
        """Read the rest of a frame (after its first bytes, `head`) in chunks into one buffer,
        then validate it off the event loop."""
        body = bytearray(total)
        view = memoryview(body)
        view[: len(head)] = head
        for off in range(len(head), total, CHUNK_BYTES):
            n = min(CHUNK_BYTES, total - off)
            view[off : off + n] = await asyncio.wait_for(
                reader.readexactly(n), self.limits.timeout_s
            )
        checks = Expect(max_body_bytes=self.limits.max_message_bytes)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, wire.unpack, body, checks)

    async def _refuse(self, writer: Any, ack: Ack, reason: str) -> bool:
        self.stats.add_reject(reason)
        with contextlib.suppress(Exception):
            writer.write(bytes([ack]))
            await writer.drain()
        return False  # the body (if any) is never read: the stream is closed

    async def _is_sender(self, name: str, remote: PeerID) -> bool:
        """The claimed name must have a record of the authenticated PeerID of the stream that
        proves membership (any of the name's records: during a replacement the old one may
        still be the newest by its publisher's clock). At most SENDER_LOOKUPS DHT gets; a
        failure is remembered for REFUSED_NAME_S (see the module docstring)."""
        cached = self.names.records.get(name)
        if cached is not None and cached.peer_id == remote and self.names.admits(cached):
            return True
        refused_at = self._refused_names.get((name, remote))
        if refused_at is not None and time.monotonic() - refused_at < REFUSED_NAME_S:
            return False
        if await self._prove(name, remote):
            self._refused_names.pop((name, remote), None)
            return True
        self._refused_names[(name, remote)] = time.monotonic()
        self._refused_names.move_to_end((name, remote))
        while len(self._refused_names) > REFUSED_NAMES:
            self._refused_names.popitem(last=False)
        return False

    async def _prove(self, name: str, remote: PeerID) -> bool:
        deadline = time.monotonic() + min(self.limits.timeout_s, 5.0)
        pause_s = SENDER_POLL_S
        for get in range(SENDER_LOOKUPS):
            try:
                records = parse_records(await self.names.lookup_shared(name))
            except Exception:  # noqa: BLE001 - no DHT answer: not proven
                return False
            mine = [r for r in records if r.peer_id == remote]
            if any(self.names.admits(r) for r in mine):
                return True
            if mine:  # a peer without the run key or with another config
                self.stats.add_reject("unauthorized")
                return False
            left = deadline - time.monotonic()
            if records or left <= 0 or get == SENDER_LOOKUPS - 1:
                return False  # the name is someone else's
            await asyncio.sleep(min(pause_s, left))  # its record may not have reached the DHT
            pause_s *= 3
        return False
