"""Scenarios of the shared transport suite: each runs inside one peer process (see harness.py).

A scenario is `fn(transport, peer, **kwargs) -> dict` (JSON-able). It computes its own
one-process reference (every peer can regenerate every other peer's tensors from the seeds), so
the test only compares numbers. Tensors are seeded by (purpose, index, member position).

Backends provide, besides the Transport protocol, what `bad_input`'s misbehaving peer uses:
`send_frame(to, data)` (comms.means.RoundLink: bytes as one frame, unchecked) and `means`
(comms.group_means.GroupMeans, whose `start` takes a payload encoded already, unchecked); and
an entry in WIRE_BYTES below (how many bytes a message and a mean contribution put on the wire,
so byte counters are checked exactly) and in ANNOUNCE below (a frame header that lies about
its length, written under the link's own framing).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable

import torch

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import PeerLost, PeerTimeout
from comms.means import Contribution, FrameId
from comms.wire import Expect, Kind

P2P_CODECS = codecs.CODECS
MEAN_CODECS = ("fp32", "bf16", "fp8_e4m3")
# how long mean_fault waits for a round's result: far past any round's deadline, so a round that
# does not end by itself stands out in its time (the handle would report "deadline" either way)
ROUND_WAIT_S = 60.0


# ---- per-backend wire accounting: a new backend adds its entry here ----
def _round_frame(group: str, round_id: int, enc: Encoded) -> bytes:
    """A member's frame in a round (the same length for every slot of a group of <= 10)."""
    return wire.pack(FrameId(group, round_id, 0).name, Kind.AVERAGE, enc, round_id)


def _torch_p2p_bytes(frame: bytes) -> int:
    return 8 + len(frame)  # int64 length tensor + frame


def _torch_mean_bytes(group: str, round_id: int, enc: Encoded) -> int:
    return _torch_p2p_bytes(_round_frame(group, round_id, enc))  # per other member


def _hivemind_p2p_bytes(frame: bytes) -> int:
    return len(frame)  # the wire frame (our stream header and libp2p framing are not counted)


def _hivemind_mean_bytes(group: str, round_id: int, enc: Encoded) -> int:
    return _hivemind_p2p_bytes(_round_frame(group, round_id, enc))  # per other member


WIRE_BYTES: dict[str, tuple[Callable[[bytes], int], Callable[[str, int, Encoded], int]]] = {
    "torch": (_torch_p2p_bytes, _torch_mean_bytes),
    "hivemind": (_hivemind_p2p_bytes, _hivemind_mean_bytes),
}
# ---- end of per-backend wire accounting ----


# ---- per-backend lying length: a frame header announcing nbytes, and no body ----
def _torch_announce(t, to: str, nbytes: int) -> None:
    t._submit(t._link(to), b"", "raw", nbytes)  # the int64 length says nbytes; no rest follows


def _hivemind_announce(t, to: str, nbytes: int) -> None:
    """A stream header (comms/p2p/stream.py) announcing nbytes; waits for the answer."""
    from comms.p2p.stream import STREAM_HEAD, STREAM_MAGIC, STREAM_VERSION

    async def announce() -> None:
        rec = await t.names.resolve(to, time.monotonic() + t.timeout_s)
        _, reader, writer = await t._p2p.call_binary_stream_handler(rec.peer_id, t._handler_name)
        me = t.me.encode()
        writer.write(STREAM_HEAD.pack(STREAM_MAGIC, STREAM_VERSION, len(me), nbytes) + me)
        await writer.drain()
        try:
            await reader.readexactly(1)
        finally:
            writer.close()

    t._run(announce(), 2 * t.timeout_s)


ANNOUNCE: dict[str, Callable[..., None]] = {
    "torch": _torch_announce,
    "hivemind": _hivemind_announce,
}
# ---- end of per-backend lying length ----


def tensor(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic test values with a spread of magnitudes (exercises block scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x * torch.exp(torch.randn(shape, generator=g))


def reference_mean(parts: list[torch.Tensor]) -> torch.Tensor:
    """Mean of the dequantized payloads, added left to right in member order."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc.div_(len(parts))


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest()


def pingpong(t, peer, shape: tuple[int, ...] = (64, 33), codec_list=P2P_CODECS) -> dict:
    """Activations a -> b and gradients b -> a in every codec, tag matching out of order, a
    recv deadline; received == codecs.roundtrip(sent) and exact byte counters."""
    a, b = peer.names[:2]
    me, other = peer.name, (b if peer.name == a else a)
    p2p_bytes = WIRE_BYTES[peer.backend][0]
    expect_sent: Counter[str] = Counter()
    expect_recv: Counter[str] = Counter()
    equal = {}
    wait = peer.timeout_s

    def send(tag: str, kind: Kind, x: torch.Tensor, codec: str, step: int):
        enc = codecs.encode(x, codec)
        expect_sent[kind.name.lower()] += p2p_bytes(wire.pack(tag, kind, enc, step))
        return t.send(other, tag, kind, enc, step)

    def expect_from(tag: str, kind: Kind, x: torch.Tensor, codec: str, step: int) -> None:
        frame = wire.pack(tag, kind, codecs.encode(x, codec), step)
        expect_recv[kind.name.lower()] += p2p_bytes(frame)

    for i, codec in enumerate(codec_list):
        x, g = tensor(100 + i, shape), tensor(200 + i, shape)
        want = Expect(shape=shape, codecs=frozenset({codec}))
        if me == a:
            h = send(f"act/{i}", Kind.ACTIVATION, x, codec, i)
            msg = t.recv(other, f"grad/{i}", want, wait)
            expect_from(f"grad/{i}", Kind.GRADIENT, g, codec, i)
            equal[codec] = bool(torch.equal(msg.tensor(), codecs.roundtrip(g, codec)))
            equal[codec] &= msg.kind == Kind.GRADIENT and msg.sender_step == i
            h.wait(wait)
        else:
            msg = t.recv(other, f"act/{i}", want, wait)
            expect_from(f"act/{i}", Kind.ACTIVATION, x, codec, i)
            equal[codec] = bool(torch.equal(msg.tensor(), codecs.roundtrip(x, codec)))
            equal[codec] &= msg.kind == Kind.ACTIVATION and msg.sender_step == i
            send(f"grad/{i}", Kind.GRADIENT, g, codec, i).wait(wait)

    # one tag, frames alternating large (> 64 KiB: a second gloo message for torch) and small:
    # taken in the order sent
    mix = [tensor(400 + i, (300, 300) if i % 2 == 0 else (8,)) for i in range(4)]
    if me == a:
        for i, y in enumerate(mix):
            h = send("mix", Kind.ACTIVATION, y, "fp32", i)
        h.wait(wait)
        in_order = True
    else:
        got = [t.recv(other, "mix", Expect(), wait) for _ in mix]
        for i, y in enumerate(mix):
            expect_from("mix", Kind.ACTIVATION, y, "fp32", i)
        in_order = all(torch.equal(m.tensor(), y) for m, y in zip(got, mix, strict=True))

    t0 = time.monotonic()
    try:
        t.recv(other, "never", Expect(), 0.3)
        timeout_raised = False
    except PeerTimeout:
        timeout_raised = True
    timeout_elapsed = time.monotonic() - t0

    # two tags sent in order 1, 2 and taken in order 2, 1
    y1, y2 = tensor(301, (8,)), tensor(302, (8,))
    if me == a:
        send("o/1", Kind.ACTIVATION, y1, "fp32", 1)
        send("o/2", Kind.ACTIVATION, y2, "fp32", 2).wait(wait)
        out_of_order = True
    else:
        m2 = t.recv(other, "o/2", Expect(), wait)
        m1 = t.recv(other, "o/1", Expect(), wait)
        expect_from("o/1", Kind.ACTIVATION, y1, "fp32", 1)
        expect_from("o/2", Kind.ACTIVATION, y2, "fp32", 2)
        out_of_order = torch.equal(m1.tensor(), y1) and torch.equal(m2.tensor(), y2)
    # a receiver that cannot know the tag (a stage pool's cell): the oldest under a prefix,
    # its name read from the message; nothing waiting under it is a timeout at once. Then b
    # says done (CONTROL, not counted below), so a does not close while b still talks to it.
    # Frames of different tags may overtake each other on the wire (hivemind sends them on
    # streams of their own): p/7/x is acked, so filed, before p/3/y leaves
    if me == a:
        send("q/9/a", Kind.ACTIVATION, y2, "fp32", 3)
        send("p/7/x", Kind.ACTIVATION, y1, "fp32", 4).wait(wait)
        send("p/3/y", Kind.ACTIVATION, y2, "fp32", 5).wait(wait)
        t.recv(other, "done", Expect(kind=Kind.CONTROL), wait)
    else:
        first = t.recv_prefix(other, "p/", Expect(), wait)
        second = t.recv_prefix(other, "p/", Expect(), wait)
        try:
            t.recv_prefix(other, "p/", Expect(), 0.0)
            out_of_order = False  # nothing was left under p/
        except PeerTimeout:
            pass
        q = t.recv(other, "q/9/a", Expect(), wait)
        for tag, y, step in (("q/9/a", y2, 3), ("p/7/x", y1, 4), ("p/3/y", y2, 5)):
            expect_from(tag, Kind.ACTIVATION, y, "fp32", step)
        out_of_order &= (first.name, second.name) == ("p/7/x", "p/3/y")
        out_of_order &= torch.equal(first.tensor(), y1) and torch.equal(q.tensor(), y2)
        t.send(other, "done", Kind.CONTROL, codecs.encode(torch.zeros(1), "fp32"), 0).wait(wait)

    kinds = ("activation", "gradient")
    return {
        "equal": equal,
        "in_order": in_order,
        "out_of_order": out_of_order,
        "timeout_raised": timeout_raised,
        "timeout_elapsed_s": timeout_elapsed,
        "sent": _by_kind(t.stats.bytes_sent, other, kinds),
        "expected_sent": dict(expect_sent),
        "received": _by_kind(t.stats.bytes_received, other, kinds),
        "expected_received": dict(expect_recv),
        "rejects": dict(t.stats.rejects),
    }


def group_mean(t, peer, numel: int = 10_000, codec_list=MEAN_CODECS) -> dict:
    """Every group this peer is in (sorted by name), every codec: the mean must equal the
    one-process reference mean of the dequantized payloads; exact byte counters."""
    mean_bytes = WIRE_BYTES[peer.backend][1]
    out: dict = {"rounds": {}, "expected_average_bytes": {}}
    expected: Counter[str] = Counter()
    for group in sorted(g for g, ms in peer.groups.items() if peer.name in ms):
        members = peer.groups[group]
        for i, codec in enumerate(codec_list):
            seed = 1000 * i + len(group)
            vals = {m: tensor(seed + 10 * k, (numel,)) for k, m in enumerate(members)}
            t0 = time.monotonic()
            h = t.start_mean(group, members, i, vals[peer.name], codec, peer.timeout_s)
            start_s = time.monotonic() - t0
            res = h.result(peer.timeout_s + 2)
            ref = reference_mean([codecs.roundtrip(vals[m], codec) for m in members])
            ok = res.mean is not None
            out["rounds"][f"{group}/{codec}"] = {
                "status": res.status.value,
                "reason": res.reason,
                "contributors": list(res.contributors),
                "members": members,
                "start_s": start_s,
                "round_s": time.monotonic() - t0,
                "equal_ref": ok and bool(torch.equal(res.mean, ref)),
                "max_abs_diff": float((res.mean - ref).abs().max()) if ok else None,
                "digest": digest(res.mean) if ok else None,
            }
            for m in members:
                if m != peer.name:
                    expected[m] += mean_bytes(group, i, codecs.encode(vals[peer.name], codec))
    # a frame is counted once its send finished, on the link's sender thread, which may still be
    # at the last frame when this peer's last round ended (the others' frames end a round, not
    # ours): wait for the counters to settle, at most the transport's deadline
    deadline = time.monotonic() + peer.timeout_s

    def sent() -> dict[str, int]:
        with t.stats.lock:
            return {p: n for (p, k), n in t.stats.bytes_sent.items() if k == "average"}

    while sent() != dict(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["average_sent"] = sent()
    out["average_received"] = {
        p: n for (p, k), n in t.stats.bytes_received.items() if k == "average"
    }
    out["expected_average_bytes"] = dict(expected)
    out["rounds_by_status"] = dict(t.stats.rounds)
    return out


def abstained_mean(t, peer, numel: int = 10_000, codec: str = "fp8_e4m3") -> dict:
    """Three members, the first of which sits the mean out (stale weights: its frame is the
    round's name over an empty payload): every member's result is the others' mean, at once."""
    members = sorted(peer.groups["g"])
    vals = {m: tensor(77 + k, (numel,)) for k, m in enumerate(members)}
    t0 = time.monotonic()
    abstain = peer.name == members[0]
    res = t.start_mean("g", members, 0, vals[peer.name], codec, peer.timeout_s, abstain=abstain)
    res = res.result(peer.timeout_s + 2)
    ref = reference_mean([codecs.roundtrip(vals[m], codec) for m in members[1:]])
    return {
        "status": res.status.value,
        "reason": res.reason,
        "contributors": list(res.contributors),
        "abstained": list(res.abstained),
        "equal_ref": res.mean is not None and bool(torch.equal(res.mean, ref)),
        "round_s": time.monotonic() - t0,
        "rejects": dict(t.stats.rejects),
    }


def link_end(t, other: str, wait_s: float) -> str:
    """How a receive from `other` of a message it never sends ends: "lost" (its link is
    known gone), "timeout" (the deadline passed) or "no" (something arrived)."""
    try:
        t.recv(other, "never", Expect(), wait_s)
    except PeerLost:
        return "lost"
    except PeerTimeout:
        return "timeout"
    return "no"


def bad_input(t, peer, marker: str, numel: int = 256) -> dict:
    """names[0] misbehaves, names[1] receives: a NaN payload, a garbage frame, a pickle blob, a
    wrong shape, a NaN mean contribution and finally a 2^40-byte declared length. Everything is
    rejected and counted, and the receiver keeps working."""
    a, b = peer.names[:2]
    members = peer.groups["g"]
    wait = peer.timeout_s
    x = tensor(7, (16,))
    good = {m: tensor(500 + k, (numel,)) for k, m in enumerate(members)}
    if peer.name == a:
        nan = torch.full((16,), float("nan"))
        t.send(b, "nan", Kind.ACTIVATION, Encoded("fp32", (16,), nan, None), 0)
        t.send_frame(b, b"\x00garbage frame, not a message" * 3)
        t.send_frame(b, _pickle_blob(marker))
        t.send(b, "shape", Kind.ACTIVATION, codecs.encode(x[:4], "fp32"), 1)
        t.send(b, "shape", Kind.ACTIVATION, codecs.encode(x, "fp32"), 2)
        t.send(b, "good", Kind.ACTIVATION, codecs.encode(x, "fp32"), 3).wait(wait)
        bad_enc = Encoded("fp32", (numel,), torch.full((numel,), float("nan")), None)
        bad = Contribution.encoded(bad_enc)  # a NaN contribution: unchecked, sent as it is
        r0 = t.means.start("g", members, 0, bad, wait).result(wait + 2)
        r1 = t.start_mean("g", members, 1, good[a], "fp32", wait).result(wait + 2)
        ANNOUNCE[peer.backend](t, b, 1 << 40)
        after = t.recv(b, "after", Expect(), wait)
        return {
            "mean0": r0.status.value,
            "mean1": r1.status.value,
            "after_ok": bool(torch.equal(after.tensor(), x)),
        }
    got = {}
    good_msg = t.recv(a, "good", Expect(kind=Kind.ACTIVATION), wait)
    shape_msg = t.recv(a, "shape", Expect(shape=(16,)), wait)
    got["good_ok"] = bool(torch.equal(good_msg.tensor(), x))
    got["shape_ok"] = shape_msg.sender_step == 2
    try:
        t.recv(a, "nan", Expect(), 0.0)
        got["nan_delivered"] = True
    except PeerTimeout:
        got["nan_delivered"] = False
    # a's NaN contribution refused on arrival before round 0 starts here: the order that once
    # failed the round (torch) or held it to its deadline (hivemind), past a's round 1
    deadline = time.monotonic() + wait
    while t.stats.rejects["not_finite"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    r0 = t.start_mean("g", members, 0, good[b], "fp32", wait).result(wait + 2)
    r1 = t.start_mean("g", members, 1, good[b], "fp32", wait).result(wait + 2)
    got["mean0"] = r0.status.value
    got["mean0_contributors"] = list(r0.contributors)
    got["mean0_reason"] = r0.reason
    got["mean0_is_own"] = r0.mean is not None and bool(torch.equal(r0.mean, good[b]))
    got["mean1"] = r1.status.value
    ref1 = reference_mean([good[m] for m in members])
    got["mean1_ok"] = r1.mean is not None and bool(torch.equal(r1.mean, ref1))
    got["cut_off"] = link_end(t, a, wait)
    t.send(a, "after", Kind.ACTIVATION, codecs.encode(x, "fp32"), 9).wait(wait)
    got["rejects"] = dict(t.stats.rejects)
    return got


def mean_fault(t, peer, victim: str, numel: int = 20_000, codec: str = "fp8_e4m3") -> dict:
    """The victim stops at checkpoint "before_mean" (the parent kills or freezes it there); the
    survivors' round must fail within its deadline, the next round fail fast, and p2p among
    survivors keep working."""
    members = peer.groups["g"]
    deadline = peer.timeout_s
    vals = tensor(900 + members.index(peer.name), (numel,))
    if peer.name == victim:
        peer.checkpoint("before_mean")  # killed here, or frozen and later resumed
        res = t.start_mean("g", members, 0, vals, codec, deadline).result(deadline + 2)
        return {"resumed": True, "status": res.status.value, "reason": res.reason}
    t0 = time.monotonic()
    res = t.start_mean("g", members, 0, vals, codec, deadline).result(ROUND_WAIT_S)
    first_s = time.monotonic() - t0
    t0 = time.monotonic()
    res2 = t.start_mean("g", members, 1, vals, codec, deadline).result(ROUND_WAIT_S)
    second_s = time.monotonic() - t0
    survivors = [n for n in peer.names if n != victim]
    k = survivors.index(peer.name)
    nxt, prv = survivors[(k + 1) % len(survivors)], survivors[k - 1]
    x = tensor(950 + k, (32,))
    h = t.send(nxt, "after", Kind.ACTIVATION, codecs.encode(x, "bf16"), 1)
    # prv may still be in its rounds (each ends by its deadline; a busy host is slow)
    msg = t.recv(prv, "after", Expect(), 60.0)
    h.wait(60.0)
    want = codecs.roundtrip(tensor(950 + survivors.index(prv), (32,)), "bf16")
    return {
        "status": res.status.value,
        "reason": res.reason,
        "no_silent_mean": (res.status.value == "failed" and res.mean is None)
        or (res.status.value == "partial" and victim not in res.contributors),
        "first_s": first_s,
        "contributors": list(res.contributors),
        "status2": res2.status.value,
        "reason2": res2.reason,
        "contributors2": list(res2.contributors),
        "second_s": second_s,
        "p2p_after_ok": bool(torch.equal(msg.tensor(), want)),
        "rounds_by_status": dict(t.stats.rounds),
    }


def shaped(t, peer, latency_ms: float, mbps: float, nbytes: int = 100_000) -> dict:
    """Links shaped by the transport (build={"shaping": LinkProfile(...)}): a ping-pong, a
    2-member mean and a stream of 4 messages; the test compares with the link model."""
    a, b = peer.names[:2]
    wait = peer.timeout_s
    small = codecs.encode(torch.zeros(4), "fp32")
    big = codecs.encode(torch.zeros(nbytes // 4), "fp32")
    out: dict = {}
    # one exchange first: the first message to a peer also pays for its stream and name lookup
    # (DHT, a signed-record check), which is not what the link model describes
    if peer.name == a:
        t.send(b, "hello", Kind.CONTROL, small, 0)
        t.recv(b, "hello-back", Expect(), wait)
    else:
        t.recv(a, "hello", Expect(), wait)
        t.send(a, "hello-back", Kind.CONTROL, small, 0).wait(wait)
    if peer.name == a:
        t0 = time.monotonic()
        t.send(b, "ping", Kind.CONTROL, small, 0)
        t.recv(b, "pong", Expect(), wait)
        out["rtt_s"] = time.monotonic() - t0
    else:
        t.recv(a, "ping", Expect(), wait)
        t.send(a, "pong", Kind.CONTROL, small, 0).wait(wait)
    t0 = time.monotonic()
    res = t.start_mean("g", peer.groups["g"], 0, torch.ones(nbytes // 40), "fp32", wait)
    res = res.result(wait + 2)
    out["mean_s"], out["mean_status"] = time.monotonic() - t0, res.status.value
    if peer.name == a:
        for i in range(4):
            t.send(b, f"s{i}", Kind.ACTIVATION, big, i)
        t.recv(b, "done", Expect(), wait)
    else:
        arrivals = []
        for i in range(4):
            t.recv(a, f"s{i}", Expect(), wait)
            arrivals.append(time.monotonic())
        out["stream_gap_s"] = (arrivals[-1] - arrivals[0]) / 3
        t.send(a, "done", Kind.CONTROL, small, 0).wait(wait)
    return out


def shared_uplink(t, peer, nbytes: int = 100_000) -> dict:
    """names[0] sends 4 frames to each of names[1] and names[2], alternating, over links that
    share one uplink (build={"shaping": {dest: LinkProfile(..., uplink=...)}}); it reports when
    it began sending, the receivers their arrival times (one machine: one monotonic clock)."""
    a, b, c = peer.names[:3]
    wait = peer.timeout_s
    small = codecs.encode(torch.zeros(4), "fp32")
    big = codecs.encode(torch.zeros(nbytes // 4), "fp32")
    if peer.name == a:  # a first exchange opens the streams (not what the link model times)
        for other in (b, c):
            t.send(other, "hello", Kind.CONTROL, small, 0)
        for other in (b, c):
            t.recv(other, "ready", Expect(), wait)
        start = time.monotonic()
        for i in range(4):
            for other in (b, c):
                t.send(other, f"s{i}", Kind.ACTIVATION, big, i)
        for other in (b, c):
            t.recv(other, "done", Expect(), wait)
        return {"start": start}
    t.recv(a, "hello", Expect(), wait)
    t.send(a, "ready", Kind.CONTROL, small, 0).wait(wait)
    arrivals = []
    for i in range(4):
        t.recv(a, f"s{i}", Expect(), 4 * wait)
        arrivals.append(time.monotonic())
    t.send(a, "done", Kind.CONTROL, small, 0).wait(wait)
    return {"arrivals": arrivals}


def _by_kind(counter: Counter, peer: str, kinds: tuple[str, ...]) -> dict[str, int]:
    return {k: n for (p, k), n in counter.items() if p == peer and k in kinds}


def _pickle_blob(marker: str) -> bytes:
    """A pickle that would create `marker` if anyone unpickled it (nobody must)."""
    path = marker.encode()
    return b"c__builtin__\nopen\n(V" + path + b"\nVw\ntR."


def held_bytes(t, peer, numel: int) -> dict:
    """names[0] sends two fp8 messages whose frames fit names[1]'s mailbox bound together but
    whose decoded copies do not: the box must hold one at a time (torch: the second waits,
    backpressure; hivemind: its room is refused, "mailbox_full")."""
    a, b = peer.names[:2]
    wait = peer.timeout_s
    x = tensor(11, (numel,))
    enc = codecs.encode(x, "fp8_e4m3")
    if peer.name == a:
        outcome = []
        for i in range(2):  # one after the other: on hivemind two sends in flight take two
            # streams, and the second could take the room before the first
            h = t.send(b, f"held/{i}", Kind.ACTIVATION, enc, i)
            try:
                h.wait(4 * wait)
                outcome.append(str(getattr(h, "ack", "sent")))
            except (PeerLost, PeerTimeout) as e:
                outcome.append(type(e).__name__)
        t.recv(b, "done", Expect(), 4 * wait)
        return {"outcome": outcome}
    frame = len(wire.pack("held/0", Kind.ACTIVATION, enc, 0))
    deadline = time.monotonic() + 4 * wait
    if peer.backend == "torch":  # the second frame is off the wire once both are counted

        def arrived() -> bool:
            return t.stats.bytes_received[(a, "activation")] >= 2 * (8 + frame)
    else:  # the second message's room was refused

        def arrived() -> bool:
            return t.stats.rejects["mailbox_full"] >= 1 or t.mailbox.pending(a) >= 2

    while not arrived() and time.monotonic() < deadline:
        time.sleep(0.01)
    held = t.mailbox.pending(a)
    first = t.recv(a, "held/0", Expect(), wait)
    try:
        second = t.recv(a, "held/1", Expect(), wait) is not None
    except PeerTimeout:
        second = False
    t.send(a, "done", Kind.CONTROL, codecs.encode(torch.zeros(1), "fp32"), 0).wait(wait)
    return {
        "frame_bytes": frame,
        "held_at_once": held,
        "first_ok": bool(torch.equal(first.tensor(), codecs.decode(enc))),
        "first_held_bytes": first.held_bytes,
        "second_delivered": second,
        "rejects": dict(t.stats.rejects),
    }


def stage_round(t, peer, numel: int, fraction: float = 0.05, rounds: int = 2) -> dict:
    """A llama-1b stage's averaging at its real size: each peer's flat fp32 stage of `numel`
    values (a deterministic function of the peer's index, so any peer can build another's), the
    runtime's keyed subset of round r, its values in fp8 through start_mean, the result against
    the one-process reference mean; peak RSS so a copy of the stage per round would show."""
    import resource

    from mesh.algo.sparse import subset_indices

    members = peer.groups["stage"]

    def stage_of(k: int) -> torch.Tensor:
        x = torch.arange(numel, dtype=torch.float32)
        return x.mul_(1e-7 * (k + 1)).sin_().mul_(0.02)  # ~N(0, 0.02)-sized, no second copy

    mine = stage_of(members.index(peer.name))
    out: dict = {"rounds": []}
    for r in range(rounds):
        idx = subset_indices(7, 1, 0, r, numel, fraction)
        t0 = time.monotonic()
        h = t.start_mean("stage", members, r, mine[idx], "fp8_e4m3", peer.timeout_s)
        res = h.result(peer.timeout_s + 30)
        round_s = time.monotonic() - t0
        parts = [codecs.roundtrip(stage_of(k)[idx], "fp8_e4m3") for k in range(len(members))]
        ref = reference_mean(parts)
        ok = res.mean is not None
        out["rounds"].append(
            {
                "status": res.status.value,
                "values": idx.numel(),
                "round_s": round_s,
                "equal_ref": ok and bool(torch.equal(res.mean, ref)),
            }
        )
        del parts, ref
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["rejects"] = dict(t.stats.rejects)
    return out
