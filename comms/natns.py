"""Homes behind NAT routers, in network namespaces: a test topology for peers that nobody can dial.

`nat_homes(n)` builds, and always deletes on exit:

    public  10.79.0.1/24 on a bridge, the "internet": the bootstrap and the public peers
    router k  wan 10.79.0.(k+2) on that bridge, lan 10.79.(k+1).1/24; nftables masquerades what
              leaves by wan and forwards nothing that starts there (no port forward, no inbound
              path: a home's peers are reached only over connections they opened)
    home k  10.79.(k+1).2/24, default route through router k

Addresses exist only inside these namespaces (the public namespace has no route to any home's
LAN, a router none to another home's). Namespaces are named "mt<pid>n<role>", so
`netns.sweep_stale` deletes those of a process that died before its cleanup ran. Needs root,
iproute2 and nftables (Debian's `nftables` package); `unavailable()` says why not, so callers
skip cleanly.

imports: stdlib and comms.netns (used by tests/throttled/test_join_nat_netns.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from comms import netns

PUBLIC_ADDR = "10.79.0.1"
_NAME = re.compile(r"^mt(\d+)n[a-z0-9]+$")  # mt<pid>n<role>


@dataclass(frozen=True)
class NatHomes:
    public: str  # namespace names
    routers: list[str]
    homes: list[str]
    home_addrs: list[str]  # each home's LAN address (what its peers announce; nobody reaches it)
    router_addrs: list[str]  # each router's public address (what the public side sees)

    @staticmethod
    def cmd(ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


def unavailable() -> str | None:
    """Why the NAT topology cannot be built here (None when it can)."""
    why = netns.unavailable()
    if why:
        return why
    if not shutil.which("nft"):
        return "nftables (nft) not installed: apt-get install nftables"
    return None


def _nat_rules(wan: str) -> str:
    """A home router's nftables ruleset: masquerade out of wan; forward only connections that
    started at home (and their replies)."""
    return f"""
table ip nat {{
  chain masq {{ type nat hook postrouting priority srcnat; oifname "{wan}" masquerade; }}
}}
table ip filter {{
  chain forward_home {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname != "{wan}" oifname "{wan}" accept
  }}
}}
"""


@contextlib.contextmanager
def nat_homes(n: int) -> Iterator[NatHomes]:
    """A public namespace and n homes behind their own NAT routers (see the module docstring)."""
    if not 1 <= n <= 8:
        raise ValueError(f"1..8 homes, got {n}")
    netns.sweep_stale(_NAME)
    tag = f"mt{os.getpid()}n"
    topo = NatHomes(
        public=f"{tag}pub",
        routers=[f"{tag}rt{k}" for k in range(n)],
        homes=[f"{tag}home{k}" for k in range(n)],
        home_addrs=[f"10.79.{k + 1}.2" for k in range(n)],
        router_addrs=[f"10.79.0.{k + 2}" for k in range(n)],
    )
    run = netns._run
    try:
        for ns in [topo.public, *topo.routers, *topo.homes]:
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "-n", topo.public, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", topo.public, "addr", "add", f"{PUBLIC_ADDR}/24", "dev", "br0")
        run("ip", "-n", topo.public, "link", "set", "br0", "up")
        for k, (rt, home) in enumerate(zip(topo.routers, topo.homes)):
            wan, port = f"{tag}w{k}", f"{tag}p{k}"  # router's wan <-> a bridge port
            lan, eth = f"{tag}l{k}", f"{tag}e{k}"  # router's lan <-> the home's link
            run("ip", "link", "add", wan, "type", "veth", "peer", "name", port)
            run("ip", "link", "set", wan, "netns", rt)
            run("ip", "link", "set", port, "netns", topo.public)
            run("ip", "-n", topo.public, "link", "set", port, "master", "br0")
            run("ip", "-n", topo.public, "link", "set", port, "up")
            run("ip", "link", "add", lan, "type", "veth", "peer", "name", eth)
            run("ip", "link", "set", lan, "netns", rt)
            run("ip", "link", "set", eth, "netns", home)
            run("ip", "-n", rt, "addr", "add", f"{topo.router_addrs[k]}/24", "dev", wan)
            run("ip", "-n", rt, "addr", "add", f"10.79.{k + 1}.1/24", "dev", lan)
            run("ip", "-n", home, "addr", "add", f"{topo.home_addrs[k]}/24", "dev", eth)
            for ns, dev in ((rt, wan), (rt, lan), (home, eth)):
                run("ip", "-n", ns, "link", "set", dev, "up")
            run("ip", "-n", home, "route", "add", "default", "via", f"10.79.{k + 1}.1")
            run(*topo.cmd(rt, "sysctl", "-qw", "net.ipv4.ip_forward=1"))
            nft = subprocess.run(
                topo.cmd(rt, "nft", "-f", "-"),
                input=_nat_rules(wan),
                capture_output=True,
                text=True,
                timeout=10,
            )
            if nft.returncode != 0:
                raise RuntimeError(f"nft in {rt}: {nft.stderr.strip()}")
        yield topo
    finally:
        # deleting a namespace deletes the veth ends inside it, and with them their peers
        for ns in [*topo.homes, *topo.routers, topo.public]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
