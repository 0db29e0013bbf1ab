"""Peer names -> PeerRecords through the DHT, for P2PTransport (its `names`).

Role: `Names` looks a name up (`{run_id}.peer.{name}`, comms.p2p.dht's records) and dials the
record's addresses. One DHT get per name is in flight however many sends wait for it, and
an empty answer stands a while: sends to a replica's absent cells (every averaging round goes
to the whole stage column) each polled the DHT 5x a second, about 100 gets/s per cell in
`bench scale`, the load that kept the grid's other replicas from forming. After an empty
answer the next lookup comes RESOLVE_POLL_S later, then x ABSENT_BACKOFF after each further
one, up to ABSENT_REUSE_MAX_S: a peer that starts with the others is found within a poll or
two, a replica still forming is asked about once a second.

It holds the DHT, the run's key space, the transport's membership test (`admits`) and, once
the transport's libp2p client is up, that client (to dial what it resolved).

imports: hivemind, comms only (no mesh, no cli).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from hivemind.p2p import PeerID

from comms.errors import PeerLost
from comms.p2p.dht import DHT_COUNTS, msgpack_bytes
from comms.p2p.peer_record import PeerRecord, parse_records, pick_record
from comms.p2p.relay import dialable

RESOLVE_POLL_S = 0.2
ABSENT_BACKOFF = 1.5
ABSENT_REUSE_MAX_S = 1.0


class Names:
    """A run's peer names in the DHT (see the module docstring)."""

    def __init__(self, dht: Any, run_id: str, admits: Callable[[PeerRecord], bool]) -> None:
        self.dht, self.run_id, self.admits = dht, run_id, admits
        self.p2p: Any = None  # the transport's libp2p client, once up: dials resolved records
        self.records: dict[str, PeerRecord] = {}  # name -> the record it resolved to
        self._lookups: dict[str, asyncio.Future[dict[str, object]]] = {}  # name -> get in flight
        self._absent: dict[str, tuple[float, float]] = {}  # name -> (not found at, stands for)

    def key(self, name: str) -> str:
        """The DHT key of a name's records."""
        return f"{self.run_id}.peer.{name}"

    async def lookup(self, name: str) -> dict[str, object]:
        """Every record of a name in the DHT now (subkey -> value; {} when there is none)."""
        found = await self.dht.get(self.key(name), latest=True, return_future=True)
        value = found.value if found is not None else None
        if not isinstance(value, dict):
            DHT_COUNTS.add(gets=1)
            return {}
        records = {str(k): v.value for k, v in value.items() if hasattr(v, "value")}
        size = sum(len(k) + msgpack_bytes(v) for k, v in records.items())
        DHT_COUNTS.add(gets=1, get_records=len(records), get_bytes=size)
        return records

    async def lookup_shared(self, name: str) -> dict[str, object]:
        """lookup, with one DHT get per name in flight however many callers wait for it."""
        fut = self._lookups.get(name)
        if fut is None:
            fut = asyncio.ensure_future(self._lookup_noted(name))
            self._lookups[name] = fut
            fut.add_done_callback(lambda _f: self._lookups.pop(name, None))
        return await asyncio.shield(fut)  # a waiter's cancellation leaves the others' get be

    async def _lookup_noted(self, name: str) -> dict[str, object]:
        """lookup, noting how long an empty answer stands (see RESOLVE_POLL_S)."""
        found = await self.lookup(name)
        if parse_records(found):
            self._absent.pop(name, None)
        else:
            _, stood_s = self._absent.get(name, (0.0, 0.0))
            grown = min(ABSENT_REUSE_MAX_S, max(RESOLVE_POLL_S, stood_s * ABSENT_BACKOFF))
            self._absent[name] = (time.monotonic(), grown)
        return found

    async def resolve(
        self, name: str, deadline: float, refresh: bool = False, avoid: PeerID | None = None
    ) -> PeerRecord:
        """The record `name` resolves to (the cached one unless `refresh`; `avoid`: another
        PeerID's if the name has one), dialed; PeerLost when none appears by `deadline`."""
        if not refresh and name in self.records:
            return self.records[name]
        while True:
            at, stands_s = self._absent.get(name, (-math.inf, 0.0))
            if time.monotonic() - at >= stands_s:
                rec = pick_record(await self.lookup_shared(name), self.admits, avoid)
                if rec is not None:
                    # hivemind exposes no public connect; dial the published addresses so
                    # streams to peers we only know through the DHT find a route (the DHT
                    # itself does the same), a relay's circuit among them (comms/p2p/relay.py)
                    with contextlib.suppress(Exception):
                        addrs = dialable(rec.maddrs)
                        await asyncio.wait_for(self.p2p._client.connect(rec.peer_id, addrs), 5)
                    self.records[name] = rec
                    return rec
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"peer {name!r} not found in the DHT (run {self.run_id!r})")
            at, stands_s = self._absent.get(name, (time.monotonic(), RESOLVE_POLL_S))
            await asyncio.sleep(max(0.01, min(at + stands_s - time.monotonic(), left)))
