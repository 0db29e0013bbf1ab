"""Membership tokens and the mailbox's handling of stale rounds (pure parts of the p2p side)."""

import time

import torch

from comms import codecs
from comms.p2p_auth import Auth
from comms.p2p_mailbox import Mailbox
from comms.wire import Kind, Message


def test_token_binds_key_context_and_peer():
    auth = Auth.of("secret", "fp1")
    t = auth.token("QmA")
    assert auth.valid("QmA", t)
    assert not auth.valid("QmB", t)  # copied to another PeerID
    assert not Auth.of("other", "fp1").valid("QmA", t)  # another key
    assert not Auth.of("secret", "fp2").valid("QmA", t)  # another config
    assert not auth.valid("QmA", None) and not auth.valid("QmA", 5)
    assert Auth.of(None, "fp").key_check != Auth.of("k", "fp").key_check


def _msg(name: str, kind: Kind) -> Message:
    return Message(name, kind, 0, codecs.encode(torch.zeros(4), "fp32"))


def test_late_payload_of_a_closed_round_is_dropped_and_counted():
    drops = []
    box = Mailbox(8, 1 << 20, on_drop=drops.append)
    box.close_tag("s1r1", "mean/stage1/7/1")
    assert box.try_reserve("s1r1", 16)
    box.put("s1r1", _msg("mean/stage1/7/1", Kind.AVERAGE), 16)
    assert box.pending() == 0 and drops == ["late"]
    assert box.try_reserve("s1r1", 16)  # its room was given back


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
