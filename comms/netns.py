"""Two network namespaces joined by a veth pair, with kernel `tc` shaping, for tests and the bench.

`netns_pair(rate_mbit)` creates namespaces "mt<pid>x<n>a" and "...b" (first deleting such
leftovers of processes that died), a veth pair between them with private addresses that exist
only inside them (10.77.0.1 and 10.77.0.2; nothing routes out), optionally a `tbf` qdisc on a's
side (a -> b is shaped), and always deletes both namespaces on exit (which removes the veths).
Needs root and iproute2; `unavailable()` says why not, so callers skip cleanly. netem does not
exist on our kernel: only bandwidth is shaped here (latency is emulated in the application,
comms/throttle.py).

`measure_mbps(pair, nbytes, app_mbps)` sends nbytes over plain TCP from a to b with this file's
`send` / `recv` commands (small scripts run with `ip netns exec`) and returns the goodput the
receiver saw; app_mbps paces the sender with comms.throttle instead of relying on the kernel.

Run as a script: `python netns.py recv HOST PORT` / `python netns.py send HOST PORT NBYTES [MBPS]`.

imports: stdlib and comms.throttle (used by tests/throttled and mesh/bench/comms.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
PORT = 5301
CHUNK = 64 * 1024
_SELF = str(Path(__file__).resolve())
_NAME = re.compile(r"^mt(\d+)x\d+[ab]$")  # mt<pid>x<n>a / b
_COUNT = 0


@dataclass(frozen=True)
class NetnsPair:
    a: str
    b: str
    veth_a: str
    veth_b: str

    def cmd(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


def unavailable() -> str | None:
    """Why kernel shaping cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) not installed"
    probe = f"mtprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str) -> None:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")


@contextlib.contextmanager
def netns_pair(rate_mbit: float | None = None, burst_kb: int = 32) -> Iterator[NetnsPair]:
    """Namespaces a, b joined by veth; tbf at rate_mbit on a's egress (None: unshaped)."""
    sweep_stale()
    global _COUNT
    _COUNT += 1
    tag = f"mt{os.getpid()}x{_COUNT % 1000}"
    pair = NetnsPair(f"{tag}a", f"{tag}b", f"{tag}va", f"{tag}vb")  # veth names <= 15 chars
    try:
        _run("ip", "netns", "add", pair.a)
        _run("ip", "netns", "add", pair.b)
        _run("ip", "link", "add", pair.veth_a, "type", "veth", "peer", "name", pair.veth_b)
        _run("ip", "link", "set", pair.veth_a, "netns", pair.a)
        _run("ip", "link", "set", pair.veth_b, "netns", pair.b)
        for ns, dev, addr in ((pair.a, pair.veth_a, ADDR_A), (pair.b, pair.veth_b, ADDR_B)):
            _run("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        if rate_mbit is not None:
            set_rate(pair, rate_mbit, burst_kb)
        yield pair
    finally:
        for ns in (pair.a, pair.b):  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", pair.veth_a], capture_output=True)  # if never moved


def sweep_stale(name: re.Pattern[str] = _NAME) -> None:
    """Delete namespaces that a helper of ours (whose names `name` matches, its first group the
    maker's pid) made in a process that died before its cleanup ran."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = name.match(line.split(" ")[0])
        if m and not Path(f"/proc/{m.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True)


def set_rate(pair: NetnsPair, rate_mbit: float | None, burst_kb: int = 32) -> None:
    """Replace a's egress qdisc: tbf at rate_mbit, or the default (None)."""
    qdisc = pair.cmd(pair.a, "tc", "qdisc")
    subprocess.run([*qdisc, "del", "dev", pair.veth_a, "root"], capture_output=True)
    if rate_mbit is not None:
        tbf = ["rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"]
        _run(*qdisc, "add", "dev", pair.veth_a, "root", "tbf", *tbf)


def drop_new_connections(pair: NetnsPair) -> None:
    """From now on a cannot open TCP connections to b (its SYNs are dropped on the way out),
    while b's connections to a work both ways: b is behind a NAT or a firewall, as a seen from
    a. (htb + u32 + a zero-length pfifo: this kernel has no prio qdisc or drop action.)"""
    tc = pair.cmd(pair.a, "tc")
    dev = ["dev", pair.veth_a]
    _run(*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "10")
    _run(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit")
    _run(*tc, "class", "add", *dev, "parent", "1:", "classid", "1:20", "htb", "rate", "8kbit")
    _run(*tc, "qdisc", "add", *dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
    # TCP (protocol 6) with SYN set and ACK clear (flags byte at 20 + 13 behind an optionless
    # IPv4 header): a new connection's first packet
    syn = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x02", "0x12", "at", "33"]
    _run(
        *tc,
        "filter",
        "add",
        *dev,
        "parent",
        "1:",
        "protocol",
        "ip",
        "prio",
        "1",
        "u32",
        *syn,
        "flowid",
        "1:20",
    )


def measure_mbps(pair: NetnsPair, nbytes: int, app_mbps: float | None = None) -> float:
    """Goodput a -> b in Mbit/s as the receiver saw it (first to last byte)."""
    py = sys.executable
    recv = subprocess.Popen(
        pair.cmd(pair.b, py, _SELF, "recv", ADDR_B, str(PORT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert recv.stdout is not None
        assert recv.stdout.readline().strip() == "ready"
        send = [py, _SELF, "send", ADDR_B, str(PORT), str(nbytes)]
        if app_mbps is not None:
            send.append(str(app_mbps))
        subprocess.run(pair.cmd(pair.a, *send), check=True, timeout=60)
        out, _ = recv.communicate(timeout=30)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    got = json.loads(out)
    return 8 * (got["bytes"] - got["first_chunk"]) / (got["last"] - got["first"]) / 1e6


def _recv(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("ready", flush=True)
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            total, first, first_chunk, last = 0, 0.0, 0, 0.0
            while data := conn.recv(1 << 20):
                now = time.monotonic()
                if not total:
                    first, first_chunk = now, len(data)
                total += len(data)
                last = now
    print(json.dumps({"bytes": total, "first": first, "first_chunk": first_chunk, "last": last}))


def _send(host: str, port: int, nbytes: int, app_mbps: float | None) -> None:
    from comms.throttle import LinkProfile, LinkSender, LinkShaper

    with socket.create_connection((host, port), timeout=30) as conn:
        payload = b"\x5a" * CHUNK
        if app_mbps is None:
            for off in range(0, nbytes, CHUNK):
                conn.sendall(payload[: min(CHUNK, nbytes - off)])
            return
        shaper = LinkShaper(LinkProfile(bandwidth_mbps=app_mbps))
        sender: LinkSender[bytes] = LinkSender("b", conn.sendall, shaper)
        last = None
        for off in range(0, nbytes, CHUNK):
            chunk = payload[: min(CHUNK, nbytes - off)]
            last = sender.submit(chunk, len(chunk))
        if last is not None:
            last.wait(60)
        sender.finish()
        sender.join(5)


if __name__ == "__main__":
    cmd, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if cmd == "recv":
        _recv(host, port)
    else:
        _send(host, port, int(sys.argv[4]), float(sys.argv[5]) if len(sys.argv) > 5 else None)


@dataclass
class NetnsStar:
    """n leaf namespaces on one bridge (inside a hub namespace), each leaf's link shaped."""

    hub: str
    leaves: list[str]
    addrs: list[str]

    def cmd(self, k: int, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.leaves[k], *argv]


@contextlib.contextmanager
def netns_star(n: int, rate_mbit: float, burst_kb: int = 32) -> Iterator[NetnsStar]:
    """Leaves 10.78.0.1..n on a bridge in a hub namespace; tbf at rate_mbit on both directions
    of every leaf's veth (its upload and its download). Everything is deleted on exit."""
    tag = f"mt{os.getpid()}s"
    star = NetnsStar(
        f"{tag}h", [f"{tag}{k}" for k in range(n)], [f"10.78.0.{k + 1}" for k in range(n)]
    )
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", "50ms"]
    try:
        _run("ip", "netns", "add", star.hub)
        _run("ip", "-n", star.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", star.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(star.leaves):
            leaf, port = f"{tag}v{k}", f"{tag}p{k}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", leaf, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", leaf, "netns", ns)
            _run("ip", "link", "set", port, "netns", star.hub)
            _run("ip", "-n", star.hub, "link", "set", port, "master", "br0")
            _run("ip", "-n", star.hub, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{star.addrs[k]}/24", "dev", leaf)
            _run("ip", "-n", ns, "link", "set", leaf, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", leaf, "root", *tbf)
            _run("ip", "netns", "exec", star.hub, "tc", "qdisc", "add", "dev", port, "root", *tbf)
        yield star
    finally:
        for ns in [*star.leaves, star.hub]:  # deleting a namespace deletes the veths inside
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
