"""Quick, light checks of bootstrap addresses, before anything heavy is imported or any daemon
starts: a malformed multiaddr is refused by syntax with an example of the right form, and a
join naming only a dead bootstrap node fails in about a second, not after p2pd's own tries.
And what to tell the user about reachability: a dial-back's verdict with the fix (forward a port
and announce it, or --client-mode), and p2pd's start-up failures as their cause and fix. For a
peer behind NAT, the run's cells that can relay for it (`public_relays`).

imports: stdlib and comms.addrs (stdlib only): no daemon, no torch (public_relays imports
comms.p2p when called, with the scout's DHT running already).
"""

from __future__ import annotations

from typing import Any


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


def peer_id_of(maddr: str) -> str | None:
    """The PeerID a multiaddr ends with (/p2p/ID), None without one."""
    parts = maddr.rstrip("/").split("/")
    return parts[-1] if len(parts) >= 2 and parts[-2] == "p2p" else None


def short_reason(why: str) -> str:
    """p2pd's dial error without its preamble: "dial tcp4 1.2.3.4:5: connect: connection
    refused" of "Connect failed. msg=failed to dial: ...: all dials failed\\n * [ADDR] dial ..."."""
    last = why.strip().splitlines()[-1].strip() if why.strip() else ""
    if last.startswith("* [") and "] " in last:
        last = last.split("] ", 1)[1]
    return last or "no reason given"


def _port_of(maddrs: list[str]) -> str:
    from comms.addrs import host_port

    ports = [hp[2] for m in maddrs if (hp := host_port(m)) is not None and hp[2] != 0]
    return str(ports[0]) if ports else "PORT"


def reach_verdict(result: dict, announce_maddrs: list[str]) -> tuple[str, str]:
    """What a dial-back (comms.p2p.dialback.ask's result) says: ("reachable" | "unreachable" |
    "unknown", the lines to print). Unreachable comes with what to do about it."""
    from comms.addrs import address_class

    answers, asked = result.get("answers", []), result.get("maddrs", [])
    for a in answers:
        if a["ok"]:
            via = a["via"] or "?"
            where = {
                "loopback": " (this machine only: peers elsewhere cannot use it)",
                "private": " (a private address: only peers on that network can dial it)",
            }.get(address_class(via), "")
            return "reachable", f"reachable: a peer of the run dialed this one back at {via}{where}"
    tried = [a for a in answers if not a.get("refused")]
    if not tried:
        why = "; ".join(f"{a['helper'][:12]}...: {a['why']}" for a in answers)
        why = why or "none serves it: a plain hivemind bootstrap, or an older meshtrain"
        return "unknown", (
            "could not check whether other peers can dial this one: no peer of the run answered "
            f"a dial-back ({why}); joining without the check"
        )
    a = tried[0]
    observed = a.get("observed")
    if a["why"] == "no address to dial":
        problem = (
            f"the addresses this peer announces ({' '.join(asked) or 'none'}) are not on the "
            f"address it connects from, {observed or 'unknown'} (a NAT or a wrong "
            "--announce-maddrs): nothing to dial back"
        )
    else:
        problem = f"a peer of the run could not dial this one: {short_reason(a['why'])}"
    public = observed if observed and address_class(f"/ip4/{observed}/tcp/1") == "public" else None
    port = _port_of(announce_maddrs)
    return "unreachable", (
        f"{problem}. No cell was claimed: the other peers could not send to this one. Either\n"
        f"  - forward TCP port {port} of your router (or open it in the firewall) to this "
        f"machine and announce it: --host-maddrs /ip4/0.0.0.0/tcp/{port} --announce-maddrs "
        f"/ip4/{public or 'YOUR_PUBLIC_IP'}/tcp/{port}\n"
        "  - or join with --client-mode: other peers reach this one through a relay (slower)\n"
        "(--skip-reach-check claims a cell anyway, e.g. when your peers reach this one over a "
        "network the checking peer is not on)"
    )


_P2PD_FAILURES: list[tuple[str, str]] = [
    # (pattern, message): {0} is the text the pattern matched up to its first group
    (
        r"listen tcp\d? ([^ ]+):(\d+): bind: address already in use",
        "port {1} on {0} is taken (another program, or another peer on this machine): choose "
        "another port in --host-maddrs, or /tcp/0 for any free one (`ss -ltnp 'sport = :{1}'` "
        "shows who holds it)",
    ),
    (
        r"listen (?:tcp|udp)\d? ([^ ]+):\d+: bind: cannot assign requested address",
        "{0} in --host-maddrs is not an address of this machine: listen on /ip4/0.0.0.0/tcp/PORT "
        "(every interface) and give the address others dial in --announce-maddrs",
    ),
    (
        r"failed to parse multiaddr (\"[^\"]*\": .*)",
        "a multiaddr in --host-maddrs is malformed ({0}); e.g. /ip4/0.0.0.0/tcp/31337",
    ),
    (
        r"no transport for protocol",
        "--host-maddrs names a transport p2pd cannot listen on: use /ip4/HOST/tcp/PORT",
    ),
    (
        r"explicit port in announce_maddrs",
        "--announce-maddrs needs the port others dial, not /tcp/0; e.g. "
        "/ip4/203.0.113.5/tcp/31337 with the same port in --host-maddrs",
    ),
    (
        r"listen unix ([^ ]+): bind: (.*)",
        "p2pd cannot create its control socket {0} ({1}): make /tmp writable by this user",
    ),
    (
        r"p2pd binary (not found|format incompatible)",
        "hivemind's p2pd binary is missing or built for another platform: reinstall hivemind "
        "(pip install --force-reinstall hivemind==1.1.12)",
    ),
    (
        r"Identity from `([^`]*)` is already taken",
        "--identity {0} is in use by another running peer: give each peer its own file",
    ),
    (
        r"directory `([^`]*)` for saving the identity does not exist",
        "--identity: the directory {0} does not exist; create it, or use a path in an existing one",
    ),
    (
        r"Daemon failed to start in ([\d.]+) seconds",
        "p2pd did not start within {0} s (a very busy machine?); try again",
    ),
    (r"Daemon failed to start: (?:[\d/]+ [\d:]+ )?(.*)", "{0}"),  # any other reason, as said
]


def p2pd_failure(error: BaseException | str) -> str | None:
    """A start-up failure of p2pd (libp2p's daemon, hivemind's P2PDaemonError and friends) as
    its cause and fix, in one line; None when the error is not one of those."""
    import re

    text = str(error)
    if "bootstrap peers" in text:  # not a start-up failure: the --initial-peers did not answer
        return None
    for pattern, message in _P2PD_FAILURES:
        m = re.search(pattern, text)
        if m is not None:
            return "the libp2p daemon (p2pd) could not start: " + message.format(*m.groups())
    return None


def public_relays(scout: Any, auth: Any, cells: list[str], timeout_s: float = 5.0) -> list[str]:
    """For a peer behind NAT (join --client-mode): relays among the run's cells that others dial
    directly, from their name records (only records of run members, so an outsider cannot
    become our relay); at most comms.p2p.relay.MAX_RELAYS, the bootstrap nodes come first."""
    from comms.p2p.peer_record import pick_record
    from comms.p2p.relay import relay_addrs

    def admits(rec: Any) -> bool:  # comms.p2p.auth.Auth's membership token
        return auth.valid(rec.peer_id.to_base58(), rec.signer, rec.auth)

    peers = []
    for found in scout.dht_get_many([f"peer.{c}" for c in cells], timeout_s=timeout_s):
        rec = pick_record(found or {}, admits)
        if rec is not None and admits(rec):
            peers.append((rec.peer_id.to_base58(), rec.maddrs))
    return relay_addrs(peers)
