"""A quick, light check that a bootstrap address answers, before anything heavy is imported:
a join naming only a dead bootstrap node fails in about a second, not after p2pd's own tries.

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
