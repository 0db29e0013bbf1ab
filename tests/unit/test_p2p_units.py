"""Membership tokens and the mailbox's handling of stale rounds (pure parts of the p2p side)."""

import time

import pytest
import torch
from hivemind.p2p import PeerID

from comms import codecs
from comms.p2p.auth import Auth
from comms.p2p.dht import pick_record
from comms.p2p.mailbox import Mailbox
from comms.wire import Kind, Message


def test_token_binds_key_context_and_peer():
    auth = Auth.of("secret", "fp1")
    t = auth.token("QmA", "[owner:a]")
    assert auth.valid("QmA", "[owner:a]", t)
    assert not auth.valid("QmB", "[owner:a]", t)  # copied to another PeerID
    assert not auth.valid("QmA", "[owner:b]", t)  # copied into a record signed by another key
    assert not Auth.of("other", "fp1").valid("QmA", "[owner:a]", t)  # another key
    assert not Auth.of("secret", "fp2").valid("QmA", "[owner:a]", t)  # another config
    assert not auth.valid("QmA", "[owner:a]", None) and not auth.valid("QmA", "[owner:a]", 5)
    assert Auth.of(None, "fp").key_check != Auth.of("k", "fp").key_check


def _msg(name: str, kind: Kind) -> Message:
    return Message(name, kind, 0, codecs.encode(torch.zeros(4), "fp32"))


def test_late_payload_of_a_closed_round_is_dropped_and_counted():
    drops = []
    box = Mailbox(8, 1 << 20, on_drop=drops.append)
    box.close_tag("s1r1", "mean/stage1/7/1")
    assert box.try_reserve("s1r1", 16)
    assert not box.put("s1r1", _msg("mean/stage1/7/1", Kind.AVERAGE), 16)
    assert box.pending() == 0 and drops == ["late"]
    assert box.try_reserve("s1r1", 16)  # its room was given back


def test_a_refused_round_payload_ends_the_wait_for_it_at_once():
    """An averaging payload refused on arrival (NaN, bad crc) is never sent again: a take of
    its tag says so (PeerLost naming the reason) instead of waiting out the round's deadline,
    the waiting round is woken, and other tags of the sender are untouched."""
    from comms import wire
    from comms.errors import PeerLost

    box = Mailbox(8, 1 << 20)
    woken = []
    box.on_put(lambda sender, tag: woken.append((sender, tag)))
    box.refuse("s1r1", "mean/stage1/7/1", "not_finite")
    assert woken == [("s1r1", "mean/stage1/7/1")]
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="refused: not_finite"):
        box.take("s1r1", "mean/stage1/7/1", t0 + 30)
    assert time.monotonic() - t0 < 10  # not the deadline's 30 s
    assert box.take("s1r1", "mean/stage1/8/1", time.monotonic()) is None  # another round
    # what the receiver reads off a frame whose body it refused
    frame = wire.pack("mean/stage1/7/1", Kind.AVERAGE, codecs.encode(torch.ones(4), "fp32"), 3)
    assert wire.frame_label(frame[: wire.MAX_HEADER_BYTES]) == (Kind.AVERAGE, "mean/stage1/7/1")
    assert wire.frame_label(b"\x00garbage") is None


def test_a_broken_sessions_messages_are_dropped_at_once_and_on_arrival():
    """close_prefix (a broken pipeline session, mesh/runtime/stage.py reset): waiting messages
    of that session go now, not after the mailbox's ttl; later ones go on arrival; other
    sessions' messages and rounds stay; the room is given back."""
    drops = []
    box = Mailbox(4, 1 << 20, on_drop=drops.append)
    for sender, name in [("s0r0", "17/act/3"), ("s2r0", "17/grad/2"), ("s0r0", "18/act/0")]:
        assert box.try_reserve(sender, 16)
        box.put(sender, _msg(name, Kind.ACTIVATION), 16)
    assert box.close_prefix("17/") == 2
    assert drops == ["stale", "stale"] and box.pending() == 1
    assert box.try_reserve("s0r0", 16)  # a late message of the broken session: dropped too
    assert not box.put("s0r0", _msg("17/act/4", Kind.ACTIVATION), 16)
    assert drops == ["stale"] * 3 and box.pending() == 1
    assert box.take("s0r0", "18/act/0", time.monotonic() + 0.1) is not None
    for _ in range(4):  # every byte and slot was given back
        assert box.try_reserve("s2r0", 16)
    with pytest.raises(ValueError):
        box.close_prefix("")


def test_full_box_evicts_oldest_round_payloads_not_pipeline_messages():
    drops = []
    box = Mailbox(3, 1 << 20, on_drop=drops.append)
    for name, kind in [("a", Kind.ACTIVATION), ("m1", Kind.AVERAGE), ("m2", Kind.AVERAGE)]:
        assert box.try_reserve("p", 16)
        box.put("p", _msg(name, kind), 16)
    assert box.try_reserve("p", 16)  # m1 evicted for it
    assert drops == ["evicted"]
    deadline = time.monotonic() + 0.1
    assert box.take("p", "a", deadline) is not None
    assert box.take("p", "m1", deadline) is None
    assert box.take("p", "m2", deadline) is not None


A_ID = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
B_ID = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def test_a_name_resolves_to_its_newest_member_record_not_an_outsiders():
    auth = Auth.of("secret", "fp")

    def record(pid, signer, t, key_holder=True):
        token = (auth if key_holder else Auth.of("guess", "fp")).token(pid, signer)
        return f"{pid}{signer}", {"v": 1, "peer_id": pid, "maddrs": [], "t": t, "auth": token}

    def admits(r):
        return auth.valid(r.peer_id.to_base58(), r.signer, r.auth)

    old = record(A_ID, "[owner:a]", 5.0)
    new = record(B_ID, "[owner:b]", 10.0)  # the name's process restarted with a new identity
    outsider = record(B_ID, "[owner:x]", 99.0, key_holder=False)  # newer, without the key
    copied = (f"{B_ID}[owner:x]", {**new[1]})  # a member's token copied under another signer
    misfiled = (f"{B_ID}[owner:a]", {**old[1], "t": 50.0})  # A's record under a key naming B
    found = dict([old, new, outsider, copied, misfiled, ("junk", [1, 2])])
    picked = pick_record(found, admits)
    assert (picked.peer_id.to_base58(), picked.signer, picked.t) == (B_ID, "[owner:b]", 10.0)
    assert pick_record(dict([old]), admits).t == 5.0
    # the newest could not be reached (dead, or its publisher's clock runs ahead): the next one
    dead = PeerID.from_base58(B_ID)
    assert pick_record(found, admits, avoid=dead).peer_id.to_base58() == A_ID
    assert pick_record(dict([new]), admits, avoid=dead).peer_id == dead  # nothing else: still it
    alone = pick_record(dict([outsider]), admits)  # only an outsider: returned, and refused
    assert alone is not None and not admits(alone)
    assert pick_record({}, admits) is None
