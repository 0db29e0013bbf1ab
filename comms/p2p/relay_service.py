"""Which relay service a p2pd runs, asked over circuit relay v2's own protocol, and a start that
retries until it is the one configured.

hivemind 1.1.12's p2pd runs two relay services on the same protocol: the one go-libp2p's relay
manager starts when the node's reachability turns public, with p2pd's -relayTimeLimit and
-relayDataLimit, and one it starts itself after the host (EnableRelayV2: relay.New(host)) with
go-libp2p's defaults, 2 minutes and 128 KiB each way per relayed connection. The one that
registers its handler last serves. Never public (a private address): always the default one.
Forced public (comms/p2p/relay.py): a race at start between the relay manager's goroutine and
the daemon's own call, lost by a third to a half of starts, and on every one of 24 starts on a
loaded CI box. A relayed connection through the default one cannot even carry a message over
128 KiB. With the Go runtime on one processor (GOMAXPROCS=1, `RELAY_P2PD_ENV`) the race has
one order: the daemon's own service registers first and the relay manager's, started by the
forced reachability, last, nearly always: measured here, 182 of 182 starts of one probe
answered with the configured limits (idle, beside a study, beside 3 CPU burners) and 2 of about
120 in repeated test runs did not, against 14 of 40 with two processors. One Go
processor is plenty for a relay: it waits on sockets, and its crypto is per connection.

`served_limit` asks a relay for a reservation (hop protocol, RESERVE) and reads the limit its
answer carries: (seconds, bytes) per relayed connection, so the answer tells the two apart.
`check_relay_service(limits)`, in a DHT process of a peer that relays, starts the first p2pd the
process starts with `RELAY_P2PD_ENV` (`start_serving`), has it ask itself that through a
throwaway probe p2pd (no listening, no relay), and starts p2pd again while the default service
answers, up to TRIES times (a safety net: with one Go processor the first start serves).
`relay_report`: a client-mode peer's view of its relays for its health rows (which carry it,
what they answer).

Wire (libp2p/specs relay/circuit-v2.md): a varint length, then a protobuf HopMessage: type = 1
(RESERVE 0, STATUS 2), limit = 4 (Limit: duration = 1, seconds; data = 2, bytes), status = 5
(OK 100). Nothing from the relay is trusted beyond these integers; the answer is bounded.

imports: stdlib, comms.p2p.relay; hivemind inside the functions that run in a DHT process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from comms.p2p.relay import RelayLimits, dialable, relays_in_use

HOP = "/libp2p/circuit/relay/0.2.0/hop"
RESERVE = b"\x08\x00"  # HopMessage{type: RESERVE}
STATUS_OK = 100
DEFAULT_LIMIT = (120, 1 << 17)  # go-libp2p's own relay service
MAX_ANSWER_BYTES = 4096
ASK_S = 10.0
# with two Go processors a forced-public start answered with the defaults 9 in 24 on a loaded
# 2-core box, 11-12 in 20 idle, 4 in 30 beside 4 CPU burners, and on all 24 of one relay's
# starts in a CI run; with one, about 1 in 60 (module docstring): the retries stay, and the
# warning lists every answer
TRIES = 24
RELAY_P2PD_ENV = {"GOMAXPROCS": "1"}
logger = logging.getLogger(__name__)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[i]
        i += 1
        n |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return n, i


def pb_fields(buf: bytes) -> dict[int, int | bytes]:
    """A protobuf message's varint and length-delimited fields by number (the last of each)."""
    out: dict[int, int | bytes] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        if key & 7 == 0:
            out[key >> 3], i = _varint(buf, i)
        elif key & 7 == 2:
            size, i = _varint(buf, i)
            if i + size > len(buf):
                raise ValueError("truncated field")
            out[key >> 3], i = buf[i : i + size], i + size
        else:
            raise ValueError(f"wire type {key & 7}")
    return out


def limit_of(answer: bytes) -> tuple[int, int] | None:
    """(seconds, bytes) of a HopMessage answering a RESERVE; None unless it is STATUS OK."""
    msg = pb_fields(answer)
    if msg.get(1) != 2 or msg.get(5) != STATUS_OK:
        return None
    limit = msg.get(4)
    fields = pb_fields(limit) if isinstance(limit, bytes) else {}
    seconds, data = fields.get(1, 0), fields.get(2, 0)
    return (seconds, data) if isinstance(seconds, int) and isinstance(data, int) else None


async def served_limit(p2p: Any, relay: Any, timeout_s: float = ASK_S) -> tuple[int, int] | None:
    """The limit `relay` (a PeerID we can reach) applies per relayed connection, from its answer
    to a reservation request; None when it refuses, does not answer or is no relay."""
    opened = p2p.call_binary_stream_handler(relay, HOP)
    _, reader, writer = await asyncio.wait_for(opened, timeout_s)
    try:
        writer.write(bytes([len(RESERVE)]) + RESERVE)
        await writer.drain()
        head = b""
        while not head or head[-1] & 0x80:
            head += await asyncio.wait_for(reader.readexactly(1), timeout_s)
            if len(head) > 4:
                return None
        size, _ = _varint(head, 0)
        if size > MAX_ANSWER_BYTES:
            return None
        return limit_of(await asyncio.wait_for(reader.readexactly(size), timeout_s))
    finally:
        writer.close()


async def start_probe(create: Any) -> Any:
    """A throwaway p2pd that only asks (no listening, no relay, a DHT client)."""
    return await create(
        no_listen=True,
        auto_nat=False,
        nat_port_map=False,
        use_relay=False,
        dht_mode="client",
        startup_timeout=15,
    )


async def own_limit(p2p: Any, probe: Any) -> tuple[int, int] | None:
    """What p2pd `p2p`'s relay service answers `probe` (start_probe; None: no answer)."""
    own = [str(m).rsplit("/p2p/", 1)[0] for m in await p2p.get_visible_maddrs()]
    await asyncio.wait_for(probe._client.connect(p2p.peer_id, dialable(own)), ASK_S)
    return await served_limit(probe, p2p.peer_id)


async def relay_report(
    p2p: Any, relays: list[str], limits: dict[str, list[int] | None]
) -> dict[str, Any]:
    """A client-mode peer's health fields: `relayed_via` (relay peer ID -> our connections
    through it now) and `relay_limits` (relay peer ID -> [seconds, bytes] it answered for a
    relayed connection, None before it answered): `limits` keeps the answers (asked until
    each relay gave one; asking again only refreshes our reservation there)."""
    from hivemind.p2p import PeerID

    for relay in relays:
        rid = relay.rsplit("/p2p/", 1)[-1]
        if limits.get(rid) is None:
            limits[rid] = None
            with contextlib.suppress(Exception):  # asked again at the next report
                got = await served_limit(p2p, PeerID.from_base58(rid), ASK_S / 4)
                limits[rid] = list(got) if got is not None else None
    return {"relayed_via": await relays_in_use(p2p), "relay_limits": dict(limits)}


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """os.environ with `extra` while the block runs (hivemind's P2P.create copies os.environ into
    p2pd's environment; nothing else in a DHT process starts one meanwhile but our probe)."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def start_serving(
    create: Any, want: tuple[int, int], tries: int, *args: Any, **kwargs: Any
) -> tuple[Any, list[tuple[int, int] | None]]:
    """A p2pd from `create(*args, **kwargs)` (with RELAY_P2PD_ENV) whose relay service answers
    `want`, started up to `tries` times (then the last one, with a warning), and the answers of
    each start. A probe p2pd starts beside the first and asks each."""
    with _environ(RELAY_P2PD_ENV):
        p2p, probe = await asyncio.gather(
            create(*args, **kwargs), start_probe(create), return_exceptions=True
        )
    if isinstance(p2p, BaseException):
        if not isinstance(probe, BaseException):
            await probe.shutdown()
        raise p2p
    if isinstance(probe, BaseException):
        logger.warning("relay service not checked: no probe p2pd (%s)", probe)
        return p2p, []
    answers: list[tuple[int, int] | None] = []
    try:
        for attempt in range(1, tries + 1):
            got = None
            with contextlib.suppress(Exception):  # no answer counts as the wrong one
                got = await own_limit(p2p, probe)
            answers.append(got)
            if got == want:
                return p2p, answers
            if attempt == tries:
                logger.warning(
                    "relay service answers %s, not %s, after %d starts of "
                    "p2pd: relayed connections get that limit (answers: %s)",
                    got,
                    want,
                    tries,
                    answers,
                )
                return p2p, answers
            logger.info("relay service answers %s, not %s: starting p2pd again", got, want)
            await p2p.shutdown()
            with _environ(RELAY_P2PD_ENV):
                p2p = await create(*args, **kwargs)
        raise AssertionError("unreachable")
    finally:
        await probe.shutdown()


def check_relay_service(limits: RelayLimits, tries: int = TRIES) -> None:
    """In a DHT process: the first P2P.create of the process (the DHT's own p2pd) returns a
    p2pd whose relay service answers with `limits` (start_serving). Later creates (dial-back
    probes) are left as they are."""
    from hivemind.p2p import P2P

    create = P2P.create  # bound to the class: called as P2P.create(**kwargs) by hivemind
    want = (int(limits.time_s), int(limits.data_bytes))
    first = [True]

    async def create_checked(*args: Any, **kwargs: Any) -> Any:
        if not first[0]:
            return await create(*args, **kwargs)
        first[0] = False
        p2p, _ = await start_serving(create, want, tries, *args, **kwargs)
        return p2p

    P2P.create = create_checked
