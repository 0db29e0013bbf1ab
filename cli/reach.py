"""Quick, light checks of bootstrap addresses, before anything heavy is imported or any daemon
starts: a malformed multiaddr is refused by syntax with an example of the right form, and a
join naming only a dead bootstrap node fails in about a second, not after p2pd's own tries.

imports: stdlib only.
"""

from __future__ import annotations


def any_reachable(maddrs: list[str], timeout_s: float = 3.0) -> bool:
    """Whether any /ip4|ip6|dns*/.../tcp/PORT address accepts a TCP connection. Addresses of
    other shapes (QUIC, relays) are not probed: then the answer is True and p2pd decides."""
    import re
    import socket

    probed = False
    for maddr in maddrs:
        m = re.match(r"^/(ip4|ip6|dns|dns4|dns6)/([^/]+)/tcp/(\d+)(/|$)", maddr)
        if m is None:
            return True
        probed = True
        try:
            with socket.create_connection((m.group(2), int(m.group(3))), timeout=timeout_s):
                return True
        except OSError:
            continue
    return not probed


EXAMPLE_MADDR = (
    "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWLmVKHJP3ztkbN8zXcZfBDMfZ9Go9tJ2ZeFmGyZ3M6fr5"
)
_BASE58 = set("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")
_HOSTNAME_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"


def maddr_problem(maddr: str) -> str | None:
    """What is wrong with a bootstrap multiaddr, by syntax alone (None: it looks right):
    /ip4|ip6|dns|dns4|dns6/HOST/tcp|udp/PORT[/quic|/quic-v1|/ws|...]/p2p/PEER_ID, optionally
    through a relay (.../p2p/RELAY_ID/p2p-circuit/p2p/PEER_ID)."""
    import ipaddress
    import re

    if not maddr.startswith("/"):
        if re.fullmatch(r"\[?[\w.:-]+\]?:\d+", maddr):
            return "HOST:PORT is not a multiaddr"
        return "a multiaddr starts with /"
    parts = maddr[1:].split("/")
    if len(parts) < 4:
        return "too short"
    proto, host, transport, port = parts[:4]
    if proto not in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return f"/{proto}: expected /ip4, /ip6, /dns, /dns4 or /dns6 first"
    try:
        if proto == "ip4":
            ipaddress.IPv4Address(host)
        elif proto == "ip6":
            ipaddress.IPv6Address(host)
        elif not re.fullmatch(rf"{_HOSTNAME_LABEL}(\.{_HOSTNAME_LABEL})*\.?", host):
            return f"/{proto}/{host}: not a host name"
    except ValueError:
        return f"/{proto}/{host}: not an {'IPv4' if proto == 'ip4' else 'IPv6'} address"
    if transport not in ("tcp", "udp"):
        return f"/{transport} after the host: expected /tcp/PORT or /udp/PORT"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"/{transport}/{port}: the port must be a number from 1 to 65535"
    rest = parts[4:]
    if "p2p" not in rest:
        return "no /p2p/PEER_ID part (the bootstrap node's identity, printed by `meshtrain dht`)"
    ids = [rest[k + 1] if k + 1 < len(rest) else "" for k, p in enumerate(rest) if p == "p2p"]
    for peer_id in ids:
        if not (32 <= len(peer_id) <= 64 and set(peer_id) <= _BASE58):
            return f"/p2p/{peer_id}: not a peer ID (base58, like 12D3KooW... in full)"
    if rest[-2:-1] != ["p2p"]:
        return "the address must end with /p2p/PEER_ID"
    return None


def maddr_problems(maddrs: list[str]) -> list[str]:
    """One line per malformed multiaddr: "ADDR: what is wrong"."""
    return [f"{m}: {why}" for m in maddrs if (why := maddr_problem(m)) is not None]
