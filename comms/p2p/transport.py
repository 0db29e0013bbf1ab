"""Transport over hivemind: named tensors on libp2p streams, peer names in the DHT.

Role: `P2PTransport` implements `comms.transport.Transport` for peers that meet through a hivemind
DHT (WAN, NAT, relays). Each transport starts its own `hivemind.DHT` (one p2pd per peer) and
shares that daemon through a replica P2P on a private asyncio loop thread.

- Names: `me -> (PeerID, maddrs)` is published under `{run_id}.peer.{me}` with an expiration and
  refreshed; peers are resolved through the DHT, cached, and re-resolved when a send fails.
- Point-to-point (comms/p2p/stream.py, `streams`): our own binary stream handler
  `{run_id}::meshtrain.rpc_deliver`. A stream
  carries messages back to back: a small header (magic, version, sender name, total length),
  then `comms.wire.pack` bytes in chunks of <= 1 MiB, answered by one ack byte. The receiver
  checks the declared length against `max_message_bytes` BEFORE buffering, checks that the
  claimed sender name resolves to the libp2p-authenticated PeerID of the stream, validates the
  bytes with `wire.unpack` (rejects are counted in stats, never raised into the peer), and files
  the message in a bounded per-sender mailbox keyed by tag (the wire name).
- Group means: comms/group_means.py over our streams (`send_frame`; an acked frame was taken).
- Dial-backs: a peer that serves the DHT also answers joiners' "dial me back" (dialback.py).
- Run records (cell claims, sessions, the run's config) in the same DHT: `dht_store` / `dht_get`
  (comms.p2p.dht.RunRecords); with `auth` (comms/p2p/auth.py) only members' streams are served.

Nothing from a peer is unpickled: message bodies only go through `wire.unpack`; DHT records are
hivemind's MSGPack of plain dicts we write, and are type-checked when read.

imports: torch, hivemind, comms only (no mesh, no cli).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from comms import wire
from comms.codecs import Encoded
from comms.errors import PeerLost, PeerTimeout, StartTimeout
from comms.group_means import GroupMeans
from comms.mailbox import Mailbox
from comms.p2p import dialback
from comms.p2p.auth import Auth
from comms.p2p.dht import (
    DHT_COUNTS,
    RunRecords,
    adopt_socket,
    kill_unstopped,
    msgpack_bytes,
    not_started,
    start_dht,
)
from comms.p2p.names import Names
from comms.p2p.peer_record import PeerRecord
from comms.p2p.relay import RelayLimits, circuit_maddrs, p2pd_options, via_relay
from comms.p2p.relay_service import relay_report
from comms.p2p.stream import (
    HANDLER,
    MAX_UNPROVEN_STREAMS,
    STREAM_IDLE_S,
    Ack,
    StreamLimits,
    Streams,
)
from comms.throttle import LinkShapers, Shaping
from comms.transport import Averaging, TransportStats
from comms.wire import Expect, Kind, Message

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
PUBLISH_RETRY_S = 1.0  # between tries of a start's first store of our address


class SendResult:
    """Handle of one send: done() when the receiver acked (or the send failed)."""

    def __init__(self, fut: cf.Future[Ack], to: str, tag: str) -> None:
        self._fut, self._to, self._tag = fut, to, tag

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout_s: float) -> None:
        """Block until the receiver acked. Raises PeerTimeout or PeerLost."""
        try:
            self._fut.result(timeout=timeout_s)
        except cf.TimeoutError as e:
            raise PeerTimeout(
                f"send {self._tag!r} to {self._to!r}: not acked in {timeout_s}s"
            ) from e
        except cf.CancelledError as e:
            raise self._cancelled() from e

    def taken(self) -> bool:
        """The receiver took the frame (acked OK; comms.means.Sent)."""
        return self.ack == Ack.OK

    @property
    def ack(self) -> Ack | None:
        """The receiver's answer once done (REJECTED/FULL mean the message was dropped there)."""
        if not self._fut.done() or self._fut.cancelled() or self._fut.exception() is not None:
            return None
        return self._fut.result()

    def error(self) -> BaseException | None:
        """Why the send failed (PeerLost / PeerTimeout), once done; None otherwise."""
        if self._fut.cancelled():
            return self._cancelled()
        return self._fut.exception() if self._fut.done() else None

    def cancel(self) -> None:
        """Give up on the send (e.g. its averaging round is long over)."""
        self._fut.cancel()

    def _cancelled(self) -> PeerLost:
        return PeerLost(f"send {self._tag!r} to {self._to!r}: cancelled")

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call fn() once the send is done (at once if it is): on the transport's loop."""
        self._fut.add_done_callback(lambda _fut: fn())

    @classmethod
    def failed(cls, to: str, tag: str, error: BaseException) -> SendResult:
        fut: cf.Future[Ack] = cf.Future()
        fut.set_exception(error)
        return cls(fut, to, tag)


class P2PTransport(RunRecords, Averaging):
    """Transport over hivemind's libp2p (see the module docstring).

    Args:
        me: this peer's name (e.g. "s1r0"); unique within run_id.
        run_id: namespace of DHT keys and the stream handler.
        initial_peers: multiaddrs of ANY hivemind DHT node (ours, `meshtrain dht`, `hivemind-dht`).
        host_maddrs: listen addresses; default loopback only.
        announce_maddrs: addresses others should dial (NAT / port mapping); explicit ports.
        identity_path: private key file; makes the PeerID stable across restarts.
        client_mode: DHT client (does not serve DHT requests; for unreachable peers).
        dht_client: a DHT client only (still dialed directly, no relay): for most peers of a
            large grid, beside a few DHT servers.
        relays: a client_mode peer's relays besides initial_peers (/p2p/ multiaddrs of public
            peers): it takes a reservation on each at once and publishes its circuit addresses
            through them (comms/p2p/relay.py).
        relay_limits: what this peer, if not in client_mode, relays for others per connection
            (comms.p2p.relay.RelayLimits; None: p2pd's defaults).
        timeout_s: default deadline of sends and name resolution.
        startup_timeout_s: deadline of starting the DHT and publishing our name (default
            max(timeout_s, 15): p2pd alone may need seconds on a busy host).
        max_message_bytes: largest frame accepted from a peer (checked before buffering).
        stream_idle_s: an incoming stream whose header or sender name does not arrive within
            this long is closed (comms/p2p/stream.py).
        max_unproven_streams: incoming streams held at once before their sender is proven;
            more are closed at once (counted "stream_cap").
        mailbox_messages / mailbox_bytes: bound of each sender's mailbox.
        record_ttl_s: expiration of our DHT name record; refreshed every ttl/3.
        shaping: link profiles of our outgoing links (comms.throttle.Shaping): each message is
            held until its release time under the link model, then sent.
        peers: names this peer will talk to; resolved (and dialed) in the background from the
            start, so a first message does not pay the DHT lookups.
        auth: comms.p2p.auth.Auth: our record carries its token, and streams from peers whose
            record lacks a valid token are refused ("unauthorized"); None accepts any peer.
    """

    backend = "hivemind"

    def __init__(
        self,
        me: str,
        *,
        run_id: str = "meshtrain",
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = (LOOPBACK,),
        announce_maddrs: Sequence[str] | None = None,
        identity_path: str | None = None,
        client_mode: bool = False,
        dht_client: bool = False,
        relays: Sequence[str] = (),
        relay_limits: RelayLimits | None = None,
        timeout_s: float = 30.0,
        startup_timeout_s: float | None = None,
        max_message_bytes: int = 256 << 20,
        stream_idle_s: float = STREAM_IDLE_S,
        max_unproven_streams: int = MAX_UNPROVEN_STREAMS,
        mailbox_messages: int = 256,
        mailbox_bytes: int = 1 << 30,
        record_ttl_s: float = 60.0,
        shaping: Shaping | LinkShapers = None,
        peers: Sequence[str] = (),
        auth: Auth | None = None,
    ) -> None:
        if not 0 < len(me.encode()) < 256:
            raise ValueError(f"peer name must be 1..255 utf-8 bytes, got {me!r}")
        self.me, self.run_id, self.timeout_s = me, run_id, timeout_s
        self.max_message_bytes, self.record_ttl_s = max_message_bytes, record_ttl_s
        self.auth = auth
        self.dht_server = not (client_mode or dht_client)
        self._shapers = shaping if isinstance(shaping, LinkShapers) else LinkShapers(me, shaping)
        startup_s = max(timeout_s, 15.0) if startup_timeout_s is None else startup_timeout_s
        self.stats = TransportStats()
        self.mailbox = Mailbox(mailbox_messages, mailbox_bytes, on_drop=self.stats.add_reject)
        self.means = GroupMeans(self, self.mailbox)
        self._order: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}  # lock, users
        self._closed = False
        self._inflight: set[cf.Future[Any]] = set()  # see _submit
        self._handler_name = f"{run_id}::{HANDLER}"
        self._pool = cf.ThreadPoolExecutor(2, thread_name_prefix=f"p2p-{me}")
        self.client_mode = client_mode
        self.relays = list(dict.fromkeys([*initial_peers, *relays])) if client_mode else []
        self._relay_limits: dict[str, list[int] | None] = {}  # see relay_report
        relay_kwargs, p2pd_flags = p2pd_options(client_mode, self.relays, relay_limits)
        # The DHT forks its process: start it before our loop thread exists.
        try:
            self.dht = start_dht(
                list(initial_peers),
                startup_s,
                host_maddrs=list(host_maddrs),
                announce_maddrs=list(announce_maddrs) if announce_maddrs else None,
                identity_path=identity_path,
                client_mode=not self.dht_server,
                p2pd_flags=p2pd_flags,
                **relay_kwargs,
            )
        except StartTimeout:  # hivemind's bare "not ready" named neither the step nor the fix
            raise not_started(me, startup_s, "starting its DHT process") from None
        self.names = Names(self.dht, run_id, self.admits)
        limits = StreamLimits(timeout_s, stream_idle_s, max_unproven_streams, max_message_bytes)
        self.streams = Streams(
            me,
            self._handler_name,
            limits,
            self.names,
            self.stats,
            self.mailbox,
            self.means,
            self._pool,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"p2p-{me}", daemon=True
        )
        self._thread.start()
        self._setup_step = "connecting to its DHT's p2pd"  # what a start that timed out did
        self._startup_s = startup_s
        try:
            try:
                self._run(self._setup(time.monotonic() + startup_s), startup_s)
            except cf.TimeoutError:  # a bare TimeoutError says nothing: name the step
                raise not_started(me, startup_s, self._setup_step) from None
            others = [n for n in peers if n != me]
            self._submit(self._warm(others, startup_s))
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- Transport protocol

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> SendResult:
        """Frame `enc` now (a snapshot), deliver it in the background; see SendResult."""
        return self._post(to, tag, kind, wire.pack(tag, kind, enc, step))

    def send_frame(self, to: str, frame: bytes) -> SendResult:
        """Deliver frame bytes as they are (comms.means.RoundLink)."""
        label = wire.frame_label(frame[: wire.MAX_HEADER_BYTES])
        kind, tag = label if label is not None else ("raw", "<raw>")
        return self._post(to, tag, kind, frame)

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """See comms.transport.Transport.recv (comms.mailbox.Mailbox.receive)."""
        return self.mailbox.receive(frm, tag, expect, timeout_s)

    def wait_arrival(self, seen: int, timeout_s: float) -> int:
        """See comms.transport.Transport.wait_arrival."""
        return self.mailbox.wait_put(seen, timeout_s)

    def recv_prefix(self, frm: str, prefix: str, expect: Expect, timeout_s: float) -> Message:
        """See comms.transport.Transport.recv_prefix."""
        return self.mailbox.receive_prefix(frm, prefix, expect, timeout_s)

    def drop_tags(self, prefix: str) -> int:
        """See comms.transport.Transport.drop_tags (the mailbox counts drops as "stale")."""
        return self.mailbox.close_prefix(prefix)

    def health(self, timeout_s: float = 1.0) -> dict[str, Any]:
        """What leaks would show in: live asyncio tasks on our loop (None when the loop did not
        answer within timeout_s: it is blocked, which is worth seeing too), messages waiting in
        the mailbox, and this process's own DHT calls so far (comms.p2p.dht.DhtCounts)."""

        async def count() -> int:
            return len(asyncio.all_tasks()) - 1  # not this one

        tasks = None
        if not self._closed:
            with contextlib.suppress(Exception):
                tasks = self._run(count(), timeout_s)
        out = {
            "asyncio_tasks": tasks,
            "mailbox_pending": self.mailbox.pending(),
            "dht": DHT_COUNTS.as_dict(),
        }
        if self.client_mode and not self._closed:  # behind NAT: its relays, what they carry
            with contextlib.suppress(Exception):
                report = relay_report(self._p2p, self.relays, self._relay_limits)
                out.update(self._run(report, 2 * timeout_s))
        return out

    def close(self) -> None:
        """Stop streams, the loop thread and the DHT (which reaps its p2pd)."""
        if self._closed:
            return
        self._closed = True
        self.means.close()
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._teardown(), 10.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.dht.shutdown()
        self.dht.join(10.0)
        kill_unstopped(self.dht)  # a DHT stuck in its shutdown (seen under load, mid-transfer)

    def __enter__(self) -> P2PTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- public extras

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    @property
    def relayed(self) -> bool:
        """Whether others reach this peer through a relay (it announces /p2p-circuit)."""
        return self.client_mode or via_relay(getattr(self, "_record", {}).get("maddrs", ()))

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs (with /p2p/<id>) that others can pass as initial_peers."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def resolve(self, name: str, timeout_s: float | None = None) -> PeerRecord:
        """PeerRecord of a peer name, waiting up to timeout_s for it to appear in the DHT."""
        t = self.timeout_s if timeout_s is None else timeout_s
        return self._run(self.names.resolve(name, time.monotonic() + t, refresh=True), t + 5.0)

    def wait_for_peers(self, names: Sequence[str], timeout_s: float) -> None:
        """Block until every name resolves (PeerTimeout otherwise)."""
        deadline = time.monotonic() + timeout_s
        for n in names:
            if n != self.me:
                try:
                    self.resolve(n, max(0.0, deadline - time.monotonic()))
                except PeerLost as e:
                    raise PeerTimeout(f"{n!r} did not appear within {timeout_s}s") from e

    def unproven_streams(self) -> int:
        """Incoming streams held open now whose sender is not proven yet."""
        return self.streams.unproven_streams()

    def admits(self, rec: PeerRecord) -> bool:
        """Whether a peer's record proves membership of our run (always, without auth)."""
        return self.auth is None or self.auth.valid(rec.peer_id.to_base58(), rec.signer, rec.auth)

    # ---------------------------------------------------------------- internals

    def _post(self, to: str, tag: str, kind: Kind | str, frame: bytes) -> SendResult:
        """Deliver a frame in the background, held back by the link model of `to`."""
        if self._closed:
            return SendResult.failed(to, tag, PeerLost(f"transport of {self.me!r} is closed"))
        shaper = self._shapers.for_peer(to)
        release = shaper.schedule(len(frame), time.monotonic()) if shaper is not None else 0.0
        return SendResult(self._submit(self._send(to, tag, kind, frame, release)), to, tag)

    def _submit(self, coro: Any) -> cf.Future[Any]:
        """Run coro on our loop, fire and forget allowed. asyncio keeps only weak references to
        tasks: a send whose handle the caller drops (the worker keeps only the last one per
        neighbour) could be garbage-collected mid-flight, silently. We hold it until done."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return fut

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    async def _setup(self, deadline: float) -> None:
        self._p2p = self.names.p2p = self.streams.p2p = await self.dht.replicate_p2p()
        own_socket = self._p2p._client_listen_maddr["unix"]
        self._setup_step = "adopting its p2pd's socket"
        await self.dht.run_coroutine(partial(adopt_socket, own_socket), return_future=True)
        self._setup_step = "opening its stream handler"
        await self._p2p.add_binary_stream_handler(self._handler_name, self.streams.serve)
        if self.dht_server:  # joiners may ask any DHT server to dial them back
            with contextlib.suppress(Exception):  # a service to others: never fails our start
                await self.dht.run_coroutine(dialback.serve, return_future=True)
        # without the /p2p/<id> suffix: p2pd's connect refuses addresses that carry it
        own = Multiaddr(f"/p2p/{self.peer_id}")
        maddrs = [str(m.decapsulate(own)) for m in await self._p2p.get_visible_maddrs()]
        maddrs += [m for m in circuit_maddrs(self.relays) if m not in maddrs]
        self._record = {"v": 1, "peer_id": self.peer_id, "maddrs": maddrs, "t": time.time()}
        self._subkey = f"{self.peer_id}{self.owner_marker}"  # signed: only we can write it
        if self.auth is not None:
            self._record["auth"] = self.auth.token(self.peer_id, self.owner_marker)
        # a loaded DHT refuses or drops a store now and then: again until the deadline
        self._setup_step = "publishing its address in the DHT"
        while not await self._publish():
            if time.monotonic() + PUBLISH_RETRY_S >= deadline:
                # our start's failure, not a lost neighbour's: the launcher stops the grid at once
                raise not_started(self.me, self._startup_s, self._setup_step)
            await asyncio.sleep(PUBLISH_RETRY_S)
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def _warm(self, names: list[str], within_s: float) -> None:
        """Resolve and dial peers early (peers that start later are waited for)."""
        deadline = time.monotonic() + within_s

        async def one(name: str) -> None:
            with contextlib.suppress(Exception):
                await self.names.resolve(name, deadline)

        await asyncio.gather(*(one(n) for n in names))

    async def _publish(self) -> bool:
        # A later expiration wins in the DHT; if an older record of this name (a crashed run, a
        # skewed clock) outlives ours, outbid it once.
        for ttl in (self.record_ttl_s, 2 * self.record_ttl_s + 10):
            exp = get_dht_time() + ttl
            DHT_COUNTS.add(stores=1, store_bytes=msgpack_bytes(self._record))
            stored = self.dht.store(
                self.names.key(self.me), self._record, exp, subkey=self._subkey, return_future=True
            )
            if await stored:
                self._record_exp = exp
                return True
        return False

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.record_ttl_s / 3)
            with contextlib.suppress(Exception):
                await self._publish()

    async def _teardown(self) -> None:
        """Undo _setup as far as it got; every step on its own (a failed start calls this too)."""
        refresher = getattr(self, "_refresher", None)
        if refresher is not None:
            refresher.cancel()
        if hasattr(self, "_record_exp"):  # "delete" our record: a None expiring just after it,
            exp = self._record_exp + 1e-3  # so a restart under this name can publish at once
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self.dht.store(
                        self.names.key(self.me), None, exp, subkey=self._subkey, return_future=True
                    ),
                    2,
                )
        self.streams.close_idle()
        p2p = getattr(self, "_p2p", None)
        if p2p is not None:
            with contextlib.suppress(Exception):
                await p2p.remove_binary_stream_handler(self._handler_name)
            await p2p.shutdown()  # a replica: closes our client sockets, not the daemon
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _send(self, to: str, tag: str, kind: Kind | str, frame: bytes, release: float) -> Ack:
        key = (to, tag)
        lock, users = self._order.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._order[key] = (lock, users + 1)
        try:
            # Same (to, tag): delivered in send order. These coroutines start in send() order
            # and the lock is FIFO; release times never decrease along a link.
            async with lock:
                await asyncio.sleep(max(0.0, release - time.monotonic()))  # link model
                deadline = time.monotonic() + self.timeout_s
                ack = await asyncio.wait_for(
                    self.streams.deliver(to, frame, deadline), self.timeout_s
                )
        except TimeoutError as e:
            raise PeerTimeout(f"send {tag!r} to {to!r}: no ack in {self.timeout_s}s") from e
        finally:
            lock, users = self._order[key]
            if users == 1:
                del self._order[key]  # tags are often unique (per microbatch): keep the dict small
            else:
                self._order[key] = (lock, users - 1)
        if ack == Ack.OK:
            self.stats.add_sent(to, kind, len(frame))
        return ack
