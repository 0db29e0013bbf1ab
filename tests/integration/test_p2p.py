"""The hivemind backend (comms/p2p/transport.py, comms/means.py) with real processes on
127.0.0.1.

Each peer is a process (a fork of the cells' fork server) with its own P2PTransport (its own DHT
process and p2pd), driven over a pipe by the test; results are compared to one-process
references (codecs.roundtrip, the member-order mean of dequantized payloads). A killed peer is
killed alone (SIGKILL to its pid): its DHT process and p2pd must exit and remove their
/tmp/hivemind-*.sock files by themselves, which the fault tests check. Every test checks that the
p2pd daemons it started are gone (peers run in their own sessions, so a hung one is killed with
its whole group).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import helpers
import hivemind
import pytest
import torch
from p2p_procs import assert_gone, p2pd_descendants, process_tree, sockets_of, sweep_sockets

from comms import codecs, wire
from comms.codecs import Encoded
from comms.p2p.stream import STREAM_HEAD, STREAM_MAGIC, STREAM_VERSION, Ack
from comms.p2p.transport import LOOPBACK, P2PTransport
from comms.throttle import LinkProfile
from comms.transport import MeanStatus, mean_in_member_order
from comms.wire import Expect, Kind
from mesh.runtime.launch import cell_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


# ------------------------------------------------------------------ the peer process


def _peer_main(conn, name: str, run_id: str, initial_peers: list[str]) -> None:
    os.setsid()  # own process group: the test can kill this peer with its DHT and p2pd
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a cell's fork server ignores it
    t = P2PTransport(name, run_id=run_id, initial_peers=initial_peers, timeout_s=20.0)
    conn.send(("ready", t.visible_maddrs()))
    handles = {}
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "close":
                t.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", _COMMANDS[cmd](t, handles, *args)))
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            conn.send(("err", f"{type(e).__name__}: {e}"))


def _send(t, _h, to, tag, codec, x, step):
    h = t.send(to, tag, Kind.ACTIVATION, codecs.encode(x, codec), step)
    h.wait(30.0)
    return int(h.ack)


def _recv(t, _h, frm, tag, expect, timeout_s):
    return t.recv(frm, tag, expect, timeout_s).tensor()


def _mean_start(t, handles, key, group, members, round_id, values, codec, timeout_s):
    handle = t.start_mean(group, members, round_id, values, codec, timeout_s)
    handles[key] = (time.monotonic(), handle)


def _mean_result(_t, handles, key, timeout_s):
    t0, h = handles.pop(key)
    r = h.result(timeout_s)
    return str(r.status), r.mean, r.contributors, r.reason, time.monotonic() - t0


def _raw(t, _h, to, frame):
    """Deliver arbitrary frame bytes through our stream protocol (bypassing wire.pack)."""
    return int(t._run(t.streams.deliver(to, frame, time.monotonic() + 20.0), 30.0))


def _raw_stream(t, _h, to, head):
    """Open a stream and write an arbitrary header; return the peer's ack byte (or None)."""

    async def go():
        rec = await t.names.resolve(to, time.monotonic() + 10.0)
        _, r, w = await t._p2p.call_binary_stream_handler(rec.peer_id, t._handler_name)
        w.write(head)
        await w.drain()
        try:
            return (await r.readexactly(1))[0]
        finally:
            w.close()

    return t._run(go(), 30.0)


def _stats(t, _h):
    s = t.stats
    with s.lock:
        return dict(s.rejects), dict(s.rounds), dict(s.bytes_received), t.mailbox.pending()


_COMMANDS = {
    "send": _send,
    "recv": _recv,
    "mean_start": _mean_start,
    "mean_result": _mean_result,
    "raw": _raw,
    "raw_stream": _raw_stream,
    "stats": _stats,
}


class Peer:
    def __init__(self, name: str, run_id: str, initial_peers: list[str]) -> None:
        self.name = name
        ctx = cell_context()  # torch and the transport imported once, in its fork server
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, name, run_id, initial_peers))
        self.proc.start()

    def ready(self, timeout_s: float = 90.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            assert self.proc.is_alive(), f"{self.name} died while starting"
            assert time.monotonic() < deadline, f"{self.name} did not start"
        tag, maddrs = self.conn.recv()
        assert tag == "ready"
        return maddrs

    def call(self, cmd: str, *args, timeout_s: float = 60.0):
        self.conn.send((cmd, args))
        assert self.conn.poll(timeout_s), f"{self.name}: {cmd} did not answer in {timeout_s}s"
        status, value = self.conn.recv()
        assert status == "ok", f"{self.name}: {cmd}: {value}"
        return value

    def kill(self) -> None:
        """SIGKILL the peer process alone: its DHT and p2pd must notice, exit, and
        remove their socket files."""
        tree = process_tree(self.proc.pid)
        socks = sockets_of(tree)
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert_gone(tree[1:], socks)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                if not self.conn.poll(0):  # Cluster.close may have sent "close" already
                    self.conn.send(("close", ()))
                self.conn.poll(30.0)
            except OSError:
                pass
            self.proc.join(15)
            if self.proc.is_alive():  # hung: kill its process group (it called setsid)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.join(5)


class Cluster:
    """n peer processes bootstrapped from a DHT in this process (like the suite's harness)."""

    def __init__(self, names: list[str], run_id: str) -> None:
        self.boot = helpers.BootNode()
        maddrs = [str(m) for m in self.boot.get_visible_maddrs()]
        self.peers = {n: Peer(n, run_id, maddrs) for n in names}
        for p in self.peers.values():
            p.ready()

    def __getitem__(self, name: str) -> Peer:
        return self.peers[name]

    def mean(self, members, round_id, payloads, codec, timeout_s=20.0, group="g"):
        for m in members:
            self[m].conn.send(
                ("mean_start", (round_id, group, members, round_id, payloads[m], codec, timeout_s))
            )
        for m in members:
            assert self[m].conn.recv()[0] == "ok"
        return {m: self[m].call("mean_result", round_id, timeout_s + 10) for m in members}

    def close(self) -> None:
        for p in self.peers.values():  # ask all first: peers exit in parallel
            if p.proc.is_alive():
                p.conn.send(("close", ()))
        for p in self.peers.values():
            p.close()
        self.boot.shutdown()
        self.boot.join(10)


@pytest.fixture(autouse=True)
def hygiene():
    """After each test: no p2pd started by it is left, and the sockets of killed peers are gone."""
    before, socks = p2pd_descendants(), set(Path("/tmp").glob("hivemind-*.sock"))
    yield
    deadline = time.monotonic() + 15
    while p2pd_descendants() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    sweep_sockets(socks)
    assert not p2pd_descendants() - before, "p2pd daemons left running"


@pytest.fixture(scope="module")
def four():
    before = p2pd_descendants()
    c = Cluster(["r0", "r1", "r2", "r3"], run_id="t4")
    try:
        yield c
    finally:
        c.close()
        deadline = time.monotonic() + 15
        while p2pd_descendants() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not p2pd_descendants() - before, "p2pd daemons left running"


# ------------------------------------------------------------------ point to point


def test_roundtrip_every_codec(four):
    x = torch.randn(3, 257, generator=torch.Generator().manual_seed(1)) * 3
    for codec in codecs.CODECS:
        assert four["r0"].call("send", "r1", f"x/{codec}", codec, x, 5) == Ack.OK
        expect = Expect(name=f"x/{codec}", kind=Kind.ACTIVATION, shape=(3, 257))
        got = four["r1"].call("recv", "r0", f"x/{codec}", expect, 20.0)
        assert torch.equal(got, codecs.roundtrip(x, codec)), codec


def test_16mib_tensor_through_chunked_stream(four):
    x = torch.randn(4 << 20, generator=torch.Generator().manual_seed(2))  # 16 MiB of fp32
    # bounded by the send's and recv's own deadlines; its speed is a `bench comms` number
    assert four["r2"].call("send", "r3", "big", "fp32", x, 0) == Ack.OK
    got = four["r3"].call("recv", "r2", "big", Expect(name="big", shape=(4 << 20,)), 30.0)
    assert torch.equal(got, x)


# ------------------------------------------------------------------ group means


@pytest.mark.parametrize("codec", ["fp32", "bf16", "fp8_e4m3"])
def test_group_mean_matches_reference_and_is_bit_identical(four, codec):
    gen = torch.Generator().manual_seed(3)
    round_base = 200 + 10 * codecs.CODECS.index(codec)
    for k, members in enumerate((["r0", "r1"], ["r0", "r1", "r2", "r3"])):
        payloads = {m: torch.randn(20_000, generator=gen) * (1 + i) for i, m in enumerate(members)}
        out = four.mean(members, round_base + k, payloads, codec)
        ref = mean_in_member_order([codecs.roundtrip(payloads[m], codec) for m in members])
        # OK means within the round's deadline (its time is a `bench comms` number)
        for m, (status, mean, who, reason, _elapsed) in out.items():
            assert status == MeanStatus.OK, (m, reason)
            assert who == tuple(members)
            assert torch.equal(mean, ref), m  # bit-identical to the reference, hence to each other


# ------------------------------------------------------------------ bad input


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_bad_input_is_rejected_counted_and_harmless(four, tmp_path):
    a, b = four["r0"], four["r1"]
    rejects0 = b.call("stats")[0]
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Marker(str(marker)))
    good = wire.pack("ok", Kind.ACTIVATION, codecs.encode(torch.ones(4), "fp32"), 1)
    nan = Encoded("fp32", (4,), torch.tensor([1.0, float("nan"), 0.0, 2.0]), None)
    huge = bytearray(good)  # same frame, data_len field patched to 2**40
    tail = len(good) - 16 - 20
    struct.pack_into("<Q", huge, tail, 1 << 40)
    pickle_body = blob + b"\0" * (-len(blob) % 4)
    pickle_frame = wire.pack(
        "pk",
        Kind.ACTIVATION,
        Encoded(
            "fp32",
            (len(pickle_body) // 4,),
            torch.frombuffer(bytearray(pickle_body), dtype=torch.float32),
            None,
        ),
        1,
    )
    assert a.call("raw", "r1", os.urandom(100)) == Ack.REJECTED
    assert a.call("raw", "r1", wire.pack("nan", Kind.ACTIVATION, nan, 1)) == Ack.REJECTED
    assert a.call("raw", "r1", bytes(huge)) == Ack.REJECTED
    assert a.call("raw", "r1", blob) == Ack.REJECTED
    a.call("raw", "r1", pickle_frame)  # floats if finite, else rejected: never unpickled
    # a stream header declaring a 2**40-byte body is refused before any body byte is read
    me = b"r0"
    head = STREAM_HEAD.pack(STREAM_MAGIC, STREAM_VERSION, len(me), 1 << 40) + me
    assert a.call("raw_stream", "r1", head) == Ack.TOO_LARGE
    spoof = b"r2"  # r0 claiming to be r2: the name does not resolve to r0's PeerID
    head = STREAM_HEAD.pack(STREAM_MAGIC, STREAM_VERSION, len(spoof), len(good)) + spoof
    assert a.call("raw_stream", "r1", head) == Ack.BAD_SENDER
    rejects = b.call("stats")[0]
    gained = {k: rejects.get(k, 0) - rejects0.get(k, 0) for k in rejects}
    assert gained.get("bad_magic", 0) >= 2 and gained.get("not_finite", 0) >= 1, gained
    assert gained.get("too_large", 0) >= 2 and gained.get("bad_sender", 0) >= 1, gained
    assert not marker.exists()
    # the peer keeps working, and nothing bad sits in its mailbox
    x = torch.arange(6.0)
    assert a.call("send", "r1", "after", "fp32", x, 2) == Ack.OK
    assert torch.equal(b.call("recv", "r0", "after", Expect(), 10.0), x)
    with pytest.raises(AssertionError, match="PeerTimeout"):
        b.call("recv", "r0", "nan", Expect(), 0.5)


# ------------------------------------------------------------------ bootstrap


def _pair_roundtrip(initial_peers: list[str], run_id: str) -> None:
    a = P2PTransport("a", run_id=run_id, initial_peers=initial_peers, timeout_s=20.0)
    b = P2PTransport("b", run_id=run_id, initial_peers=initial_peers, timeout_s=20.0)
    try:
        x = torch.randn(1000)
        a.send("b", "hi", Kind.CONTROL, codecs.encode(x, "bf16"), 0).wait(20.0)
        assert torch.equal(
            b.recv("a", "hi", Expect(kind=Kind.CONTROL), 20.0).tensor(), codecs.roundtrip(x, "bf16")
        )
        # the group mean resolves its members through the bootstrap DHT too
        ha = a.start_mean("g", ["a", "b"], 1, torch.ones(100), "fp32", 20.0)
        hb = b.start_mean("g", ["a", "b"], 1, torch.zeros(100), "fp32", 20.0)
        ra, rb = ha.result(30.0), hb.result(30.0)
        assert ra.status == rb.status == MeanStatus.OK, (ra.reason, rb.reason)
        assert torch.equal(ra.mean, torch.full((100,), 0.5)) and torch.equal(rb.mean, ra.mean)
    finally:
        a.close()
        b.close()


def test_bootstrap_from_hivemind_dht_cli():
    proc = subprocess.Popen(
        ["hivemind-dht", "--host_maddrs", LOOPBACK],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        maddrs, deadline = [], time.monotonic() + 60
        while not maddrs and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "hivemind-dht exited early"
            maddrs = re.findall(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", line)
        assert maddrs, "hivemind-dht printed no multiaddr"
        _pair_roundtrip(maddrs[:1], "cli")
    finally:
        proc.send_signal(signal.SIGTERM)  # its handler shuts the DHT (and its p2pd) down
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_bootstrap_from_plain_hivemind_dht():
    dht = hivemind.DHT(start=True, host_maddrs=[LOOPBACK])
    try:
        _pair_roundtrip([str(m) for m in dht.get_visible_maddrs()], "plain")
    finally:
        dht.shutdown()
        dht.join(10)


def test_shaped_link_and_stable_identity(tmp_path):
    """A LinkProfile on a->b holds each message for its transmit time + latency; a peer that
    restarts with the same identity_path keeps its PeerID."""
    dht = helpers.BootNode()
    boot = [str(m) for m in dht.get_visible_maddrs()]
    key, profile = str(tmp_path / "a.key"), LinkProfile(bandwidth_mbps=40.0, latency_ms=30.0)
    try:
        a = P2PTransport(
            "a", run_id="shape", initial_peers=boot, identity_path=key, shaping={"b": profile}
        )
        b = P2PTransport("b", run_id="shape", initial_peers=boot)
        try:
            enc = codecs.encode(torch.randn(250_000), "fp32")  # 1 MB: 0.2 s at 40 Mbit/s
            a.send("b", "warm", Kind.ACTIVATION, codecs.encode(torch.ones(1), "fp32"), 0).wait(20)
            t0 = time.monotonic()
            a.send("b", "x", Kind.ACTIVATION, enc, 1).wait(20)
            took = time.monotonic() - t0
            model = profile.transmit_s(len(wire.pack("x", Kind.ACTIVATION, enc, 1))) + 0.030
            assert model <= took, (took, model)  # never faster than the link (how close: bench)
            assert b.recv("a", "x", Expect(), 5).tensor().shape == (250_000,)
            first_id = a.peer_id
        finally:
            a.close()
            b.close()
        a = P2PTransport("a", run_id="shape", initial_peers=boot, identity_path=key)
        try:
            assert a.peer_id == first_id
        finally:
            a.close()
    finally:
        dht.shutdown()
        dht.join(10)


# ------------------------------------------------------------------ faults


def test_peer_killed_during_mean():
    c = Cluster(["a", "b", "c"], run_id="kill-direct")
    try:
        members, timeout_s = ["a", "b", "c"], 8.0
        gen = torch.Generator().manual_seed(4)
        payloads = {m: torch.randn(2_000_000, generator=gen) for m in members}
        args = {m: (1, "g", members, 1, payloads[m], "fp32", timeout_s) for m in members}
        for m in ("a", "b"):
            c[m].conn.send(("mean_start", args[m]))
        c["c"].kill()  # before its payload leaves (once sent, the round would rightly complete)
        for m in ("a", "b"):
            assert c[m].conn.recv()[0] == "ok"
        for m in ("a", "b"):  # waited for far past the deadline: a round that hangs shows
            status, mean, who, reason, elapsed = c[m].call("mean_result", 1, 90, timeout_s=120)
            print(f"{m}: {status} after {elapsed:.2f}s: {reason}")
            assert status in (MeanStatus.FAILED, MeanStatus.PARTIAL), (m, status)
            # it ended by itself at its deadline (room for a loaded 2-core box), not at our 90 s
            assert elapsed < timeout_s + 30, (m, elapsed, reason)
            if status == MeanStatus.PARTIAL:  # named contributors (c's payload may have made it)
                assert m in who and set(who) < set(members)
                ref = mean_in_member_order([payloads[w] for w in who])
                assert torch.equal(mean, ref)
        c["c"].proc.join(10)
        assert c["c"].proc.exitcode == -signal.SIGKILL
        # survivors keep working: a new round among themselves, and a plain message
        small = {m: torch.full((1000,), float(i)) for i, m in enumerate(("a", "b"))}
        out = c.mean(["a", "b"], 2, small, "fp32", timeout_s=10.0)
        for status, mean, _who, reason, _ in out.values():
            assert status == MeanStatus.OK, reason
            assert torch.equal(mean, torch.full((1000,), 0.5))
        assert c["a"].call("send", "b", "alive", "fp32", torch.ones(3), 0) == Ack.OK
    finally:
        c.close()


def test_cut_round_ends_at_once_over_the_payloads_it_has():
    """A member that never contributes is dropped when the caller cuts the round (the runtime
    does so max_round_lag_steps updates after the round was due), long before its deadline."""

    boot = helpers.BootNode()
    peers = [str(a) for a in boot.get_visible_maddrs()]
    a = P2PTransport("a", initial_peers=peers, peers=["b"])
    b = P2PTransport("b", initial_peers=peers, peers=["a"])
    try:
        a.wait_for_peers(["b"], 30)
        handle = a.start_mean("g", ["a", "b"], 7, torch.ones(64), "fp32", timeout_s=60)
        time.sleep(0.5)
        assert not handle.done()  # b is alive but silent: the round waits for it
        handle.cut()
        # ended by the cut: without it the round waits for b until its 60 s deadline, past this
        # 30 s wait (which then reports FAILED)
        res = handle.result(30)
        assert res.status is MeanStatus.PARTIAL and res.contributors == ("a",), res
    finally:
        a.close()
        b.close()
        boot.shutdown()


def test_rounds_in_flight_share_one_thread_and_match_the_reference():
    """Rounds run on one thread however many are in flight (a thread per round made a peer's
    threads follow its rounds: 23-48 in the soak): 24 rounds wait at once for a member that
    contributes late, and each ends OK with the reference mean, the same on both members."""
    import threading

    boot = helpers.BootNode()
    peers = [str(a) for a in boot.get_visible_maddrs()]
    a = P2PTransport("a", initial_peers=peers, peers=["b"])
    b = P2PTransport("b", initial_peers=peers, peers=["a"])
    n = 24
    xs = {
        m: [
            torch.randn(500, generator=torch.Generator().manual_seed(i + 100 * k)) for i in range(n)
        ]
        for k, m in enumerate("ab")
    }
    try:
        a.wait_for_peers(["b"], 30)
        on_a = [a.start_mean("g", ["a", "b"], i, xs["a"][i], "fp32", 60.0) for i in range(n)]
        time.sleep(0.3)
        assert not any(h.done() for h in on_a)  # all 24 wait for b
        # the old code: a thread per round ("mean-g-<round>"), 24 here
        assert [t.name for t in threading.enumerate() if t.name.startswith("mean")] == [
            "mean-rounds"
        ]
        on_b = [b.start_mean("g", ["a", "b"], i, xs["b"][i], "fp32", 60.0) for i in range(n)]
        for i in range(n):
            ra, rb = on_a[i].result(60.0), on_b[i].result(60.0)
            assert ra.status == rb.status == MeanStatus.OK, (i, ra.reason, rb.reason)
            want = mean_in_member_order([xs["a"][i], xs["b"][i]])
            assert torch.equal(ra.mean, want) and torch.equal(rb.mean, want), i
        names = [t.name for t in threading.enumerate()]
        assert names.count("mean-rounds") == 2 and not any(x.startswith("mean-g") for x in names)
    finally:
        a.close()
        b.close()
        boot.shutdown()


def test_sends_to_an_absent_peer_share_one_lookup_a_second():
    """Many sends waiting for a peer that is not in the DHT yet (an averaging round goes to a
    replica's whole column, formed or not) look its name up together, backing off to once a
    second:
    each polled 5x a second on its own before, ~100 DHT gets/s per cell in `bench scale`."""
    from comms.errors import PeerLost, PeerTimeout
    from comms.p2p.dht import DHT_COUNTS

    boot = helpers.BootNode()
    peers = [str(a) for a in boot.get_visible_maddrs()]
    a = P2PTransport("a", initial_peers=peers, timeout_s=4.0)
    try:
        gets = DHT_COUNTS.gets
        enc = codecs.encode(torch.ones(8), "fp32")
        sends = [a.send("ghost", f"t{i}", Kind.CONTROL, enc, i) for i in range(20)]
        for h in sends:
            with pytest.raises((PeerLost, PeerTimeout)):  # not found by the send's deadline
                h.wait(30.0)
        looked = DHT_COUNTS.gets - gets
        # 4 s of waiting: lookups 0.2, 0.3, 0.45, 0.68, then 1 s apart: ~8 (the old code:
        # 20 sends x 20 polls, about 400)
        assert 1 <= looked <= 12, looked
    finally:
        a.close()
        boot.shutdown()


async def _serves_dht(_dht, node) -> bool:
    return not node.protocol.client_mode


def test_a_dht_client_peer_serves_no_dht_and_is_still_dialed_directly():
    """transport.dht_mode = "client": the peer's DHT node answers no DHT request, yet its
    records are in the DHT (through the server) and a peer sends to it over a direct link."""
    from comms.p2p.dht import DhtClient

    boot = helpers.BootNode()
    peers = [str(a) for a in boot.get_visible_maddrs()]
    a = P2PTransport("a", initial_peers=peers, dht_client=True, peers=["b"])
    b = P2PTransport("b", initial_peers=peers, peers=["a"])
    try:
        assert a.dht.run_coroutine(_serves_dht) is False
        assert b.dht.run_coroutine(_serves_dht) is True
        assert a.dht_store("cells.r0", "s0r0/a", {"v": 1}, 30)
        reader = DhtClient(peers, "meshtrain", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            assert reader.dht_get("cells.r0") == {"s0r0/a": {"v": 1}}
        finally:
            reader.close()
        x = torch.randn(64)
        b.send("a", "hi", Kind.CONTROL, codecs.encode(x, "fp32"), 0).wait(20.0)
        assert torch.equal(a.recv("b", "hi", Expect(kind=Kind.CONTROL), 20.0).tensor(), x)
    finally:
        a.close()
        b.close()
        boot.shutdown()


def _handed_over_by_a_dead_process() -> None:
    raise EOFError  # what multiprocessing's resource sharer raises when the sender is gone


class _UnreadableRequest:
    """A request argument that cannot be unpickled, like a pipe end whose sender (our peer
    process) was killed while handing it over to the DHT process."""

    def __reduce__(self):
        return (_handed_over_by_a_dead_process, ())


def test_dht_process_skips_a_request_it_cannot_read():
    """It logs one line and serves on (it used to die with a traceback, and its peer process's
    later requests hung)."""
    from comms.p2p.dht import get_records, start_dht, store_record

    dht = start_dht([], 30, host_maddrs=[LOOPBACK])
    try:
        dht._outer_pipe.send(("_get", [], {"key": _UnreadableRequest()}))
        # requests are served in order: these answer only if the DHT process went on
        assert store_record(dht, "k", "s", 1, 30, 20)
        assert get_records(dht, "k", 20) == {"s": 1}
        assert dht.is_alive()
    finally:
        dht.shutdown()
        dht.join(10)


def test_a_transport_that_cannot_start_in_time_says_at_which_step_and_leaves_no_p2pd():
    """A start past its deadline (a loaded machine) is one line naming the step and the key to
    raise, not a bare TimeoutError, and its DHT process and p2pd are gone. With 1 ms no DHT
    process is ready in time: that wait keeps the transport's deadline too (it waited at least
    10 s, and a DHT not ready then raised hivemind's bare TimeoutError)."""
    from comms.errors import StartTimeout

    before = p2pd_descendants()
    with pytest.raises(StartTimeout) as caught:
        P2PTransport("a", run_id="slow-start", startup_timeout_s=0.001)
    assert str(caught.value) == (
        "'a': the hivemind transport did not start within 0.001 s (it was starting its DHT "
        "process); on a loaded machine raise transport.start_timeout_s"
    )
    left = p2pd_descendants() - before
    assert_gone(sorted(left), set())


def test_a_transport_whose_address_the_dht_never_takes_stops_at_its_deadline():
    """A loaded DHT that takes none of our address's stores: the start retries them until its
    deadline and then fails as a start (StartTimeout, the step named: the launcher stops the
    grid at once), not as a lost neighbour (which had it wait out elastic.rejoin_timeout_s);
    nothing of it is left. The refusal is injected (every publish answers False): a real DHT
    refuses a store only now and then."""
    from comms.errors import StartTimeout

    tries: list[float] = []

    class Refused(P2PTransport):
        async def _publish(self) -> bool:
            tries.append(time.monotonic())
            return False

    before = p2pd_descendants()
    with pytest.raises(StartTimeout) as caught:
        Refused("a", run_id="refused", startup_timeout_s=45)
    assert "(it was publishing its address in the DHT)" in str(caught.value), caught.value
    assert len(tries) >= 2, tries  # tried again, not given up at the first refusal
    assert_gone(sorted(p2pd_descendants() - before), set())
