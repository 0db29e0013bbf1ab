"""Multiaddrs as plain strings: where one points (host, port, what kind of address) and which of
a peer's announced addresses a dial-back may dial.

A dial-back (comms/p2p/dialback.py) dials only addresses on the host its asker connected from:
a helper cannot be made to dial a third party's machine, and an asker behind NAT learns the
address the internet sees it at (the one it should announce once it forwards a port).

imports: stdlib only.
"""

from __future__ import annotations

import ipaddress
import re

MAX_DIALS = 4  # announced addresses a dial-back tries at most (a peer announces one or a few)

_HOST_PORT = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/(tcp|udp)/(\d+)(/.*)?$")


def host_port(maddr: str) -> tuple[str, str, int] | None:
    """(protocol, host, port) of /ip4|ip6|dns*/HOST/tcp|udp/PORT[...]; None for other shapes."""
    m = _HOST_PORT.match(maddr)
    if m is None:
        return None
    return m.group(1), m.group(2), int(m.group(4))


def address_class(maddr: str) -> str:
    """What kind of address a multiaddr dials: "relay" (through a /p2p-circuit), "loopback"
    (this machine only), "private" (a LAN, VPN or container network: RFC 1918, CGNAT, link-local,
    ULA), "public", "dns" (a name: whatever it resolves to), or "other" (unparsable, or no one
    host's: unspecified, multicast, broadcast and other reserved addresses)."""
    if "/p2p-circuit" in maddr:
        return "relay"
    hp = host_port(maddr)
    if hp is None:
        return "other"
    proto, host, _ = hp
    if proto.startswith("dns"):
        return "dns"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "other"
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved:  # 255.255.255.255 is reserved
        return "other"
    if ip.is_private or ip.is_link_local or ip in ipaddress.ip_network("100.64.0.0/10"):
        return "private"
    return "public"


def observed_host(maddr: str) -> str | None:
    """The IP a connection came from, given the remote multiaddr libp2p reports for it (None
    when it came through a relay or has no IP)."""
    if "/p2p-circuit" in maddr:
        return None
    hp = host_port(maddr)
    if hp is None or hp[0] not in ("ip4", "ip6"):
        return None
    return str(ipaddress.ip_address(hp[1]))


def dial_plan(
    maddrs: list[str], observed: str | None, limit: int = MAX_DIALS
) -> tuple[list[str], list[tuple[str, str]]]:
    """(addresses to dial, [(address, why not)]): a peer's announced TCP addresses on the host
    it connected from (`observed`), its /p2p/ suffix dropped, at most `limit` of them."""
    dial: list[str] = []
    skipped: list[tuple[str, str]] = []
    for maddr in maddrs:
        hp = host_port(maddr)
        if "/p2p-circuit" in maddr:
            why = "a relay address (the relay, not this peer, would be dialed)"
        elif hp is None or hp[0] not in ("ip4", "ip6"):
            why = "not an /ip4 or /ip6 address"
        elif not maddr.startswith(f"/{hp[0]}/{hp[1]}/tcp/"):
            why = "not TCP"
        elif observed is None or str(ipaddress.ip_address(hp[1])) != observed:
            why = f"not the address this peer connects from ({observed or 'unknown'})"
        elif len(dial) >= limit:
            why = f"more than {limit} addresses"
        else:
            bare = maddr.split("/p2p/")[0]
            if bare not in dial:
                dial.append(bare)
            continue
        skipped.append((maddr, why))
    return dial, skipped
