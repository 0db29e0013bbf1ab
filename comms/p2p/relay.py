"""Relays for peers behind NAT (`join --client-mode`), and the relay service public peers give.

Role: what P2PTransport asks of p2pd (hivemind 1.1.12's go-libp2p-daemon) so that a peer nobody
can dial is reached through a relay, and what it publishes so that others find that path.

- A client-mode peer knows it is unreachable: its reachability is forced private (AutoNAT
  never says "private" when every address it sees is a private one, and autorelay waits for
  that), and its relays are static: the peers it names (`relays`, the bootstrap nodes and the
  public cells join found) get a reservation each at once. With p2pd's discovery instead
  (hivemind's default), the first reservation waits for 4 candidates or 3 minutes.
- It publishes `RELAY/p2p/RELAY_ID/p2p-circuit` for each of them beside its own addresses:
  libp2p itself announces circuit addresses only through relays with public IPs.
- A peer that others can dial forces its reachability public, which starts p2pd's relay service
  with its configured limits (`RelayLimits`: -relayTimeLimit, -relayDataLimit), and its p2pd
  is started until that service is the one answering (comms/p2p/relay_service.py: p2pd also
  runs go-libp2p's default one, which resets a relayed connection after 128 KiB each way or
  2 minutes whatever -relayDataLimit says; docs/wan.md, "Peers behind NAT").
- `wire_maddr` encodes a multiaddr as go-multiaddr reads it: hivemind's Python multiaddr writes
  a /p2p/ peer ID as a CIDv1, which p2pd refuses ("length greater than remaining number of
  bytes"), so a circuit address (which must name its relay) could not be dialed at all.

imports: stdlib, comms.addrs; hivemind (PeerID, Multiaddr) inside wire_maddr only (trainer
imports this module; hivemind is slow to import). No torch, no mesh, no cli.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from comms.addrs import address_class

CIRCUIT = "/p2p-circuit"
MAX_RELAYS = 4  # reservations a client-mode peer holds at most
_P2P, _CIRCUIT = 0x01A5, 0x0122  # multiaddr protocol codes


@dataclass(frozen=True)
class RelayLimits:
    """What this peer's relay service lets one relayed connection carry before it resets it
    (p2pd's -relayTimeLimit in whole seconds and -relayDataLimit, per direction); the two
    sides redial."""

    time_s: float = 1800.0
    data_bytes: int = 4 << 30


def via_relay(maddrs: Sequence[str]) -> bool:
    """Whether a peer announcing these addresses is reached through a relay."""
    return any(CIRCUIT in m for m in maddrs)


def relay_of(maddr: str) -> str | None:
    """The relay's peer ID in a circuit address (.../p2p/RELAY_ID/p2p-circuit...), else None."""
    head, sep, _ = maddr.partition(CIRCUIT)
    if not sep or "/p2p/" not in head:
        return None
    return head.rsplit("/p2p/", 1)[1].split("/")[0] or None


async def relays_in_use(p2p: Any) -> dict[str, int]:
    """Relay peer ID -> our connections through it now (p2pd's list of connected peers)."""
    counts: dict[str, int] = {}
    for info in await p2p._client.list_peers():
        for addr in info.addrs:
            relay = relay_of(str(addr))
            if relay is not None:
                counts[relay] = counts.get(relay, 0) + 1
    return counts


def circuit_maddrs(relays: Sequence[str]) -> list[str]:
    """Our addresses through each relay (RELAY must carry /p2p/RELAY_ID)."""
    return [f"{r}{CIRCUIT}" for r in relays if "/p2p/" in r and CIRCUIT not in r]


_PREFERRED = {"public": 0, "dns": 1, "private": 2, "loopback": 3}  # a relay's address to use


def relay_addrs(peers: Sequence[tuple[str, Sequence[str]]], limit: int = MAX_RELAYS) -> list[str]:
    """Relays among peers (peer ID, announced addresses): each one dialed directly (none of its
    addresses is a circuit) as `ADDR/p2p/ID`, ADDR its most public one; at most `limit`."""
    out: list[str] = []
    for peer_id, maddrs in peers:
        if via_relay(maddrs) or len(out) >= limit:
            continue
        direct = [m for m in maddrs if address_class(m) in _PREFERRED and "/p2p/" not in m]
        if direct:
            best = min(direct, key=lambda m: _PREFERRED[address_class(m)])
            out.append(f"{best}/p2p/{peer_id}")
    return list(dict.fromkeys(out))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class WireMaddr:
    """A multiaddr's bytes as p2pd reads them (a Multiaddr stand-in for p2pclient's connect)."""

    def __init__(self, text: str, data: bytes) -> None:
        self.text, self.data = text, data

    def to_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.text


def wire_maddr(text: str) -> WireMaddr:
    """`text` encoded for p2pd: /p2p/ID as the peer ID's multihash, /p2p-circuit as its code,
    every other part as hivemind's Multiaddr writes it. Raises ValueError on a malformed one."""
    from hivemind.p2p import PeerID  # here: hivemind is slow to import (trainer imports us)
    from hivemind.utils.multiaddr import Multiaddr

    parts = [p for p in text.split("/") if p]
    out, plain, k = bytearray(), [], 0
    while k < len(parts):
        name = parts[k]
        if name in ("p2p", "ipfs", "p2p-circuit"):
            if plain:
                out += Multiaddr("/" + "/".join(plain)).to_bytes()
                plain = []
            if name == "p2p-circuit":
                out += _varint(_CIRCUIT)
                k += 1
                continue
            if k + 1 >= len(parts):
                raise ValueError(f"{text}: /{name} without a peer ID")
            try:
                mh = PeerID.from_base58(parts[k + 1]).to_bytes()
            except Exception as e:  # noqa: BLE001 - any malformed base58 from a record
                raise ValueError(f"{text}: bad peer ID {parts[k + 1]!r}") from e
            out += _varint(_P2P) + _varint(len(mh)) + mh
            k += 2
            continue
        plain.append(name)
        k += 1
    if plain:
        out += Multiaddr("/" + "/".join(plain)).to_bytes()
    return WireMaddr(text, bytes(out))


def dialable(maddrs: Sequence[str]) -> list[WireMaddr]:
    """The addresses of a record that can be encoded (a malformed one is skipped)."""
    out = []
    for m in maddrs:
        try:
            out.append(wire_maddr(m))
        except Exception:  # noqa: BLE001, S112 - a peer's record may hold anything
            continue
    return out


def p2pd_options(
    client_mode: bool, relays: Sequence[str], limits: RelayLimits | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hivemind DHT/P2P kwargs, extra p2pd flags) for a peer: a client-mode one reserves on
    its static `relays`; any other serves as a relay with `limits` (None: p2pd's defaults)."""
    if client_mode:
        static = [r for r in relays if "/p2p/" in r][:MAX_RELAYS]
        kwargs: dict[str, Any] = {"use_auto_relay": True, "force_reachability": "private"}
        if not static:  # p2pd's own discovery: slow (see the module docstring), but something
            return kwargs, {}
        return {**kwargs, "trusted_relays": static}, {"relayDiscovery": 0}
    if limits is None:
        return {"force_reachability": "public"}, {}
    flags = {"relayTimeLimit": f"{int(limits.time_s)}s", "relayDataLimit": int(limits.data_bytes)}
    return {"force_reachability": "public", "relay_service": limits}, flags
