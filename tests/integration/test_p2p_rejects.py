"""Messages a hivemind peer must not use, with real P2PTransports on 127.0.0.1: a broken
pipeline session's (dropped when the session breaks, not when the mailbox's ttl runs out).

Each test closes the transports it started (their DHT processes reap their p2pd).
"""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import wait_for

from comms import codecs
from comms.p2p.stream import Ack
from comms.p2p.transport import P2PTransport
from comms.wire import Expect, Kind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def pair():
    boot = helpers.BootNode()
    peers = [str(m) for m in boot.get_visible_maddrs()]
    a = P2PTransport("s0r0", run_id="stale", initial_peers=peers, peers=["s1r0"])
    b = P2PTransport("s1r0", run_id="stale", initial_peers=peers, peers=["s0r0"])
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        boot.shutdown()
        boot.join(10)


def test_a_broken_sessions_messages_are_dropped_when_it_breaks(pair):
    """What mesh/runtime/stage.py's reset does on a broken session (drop_tags of the session's
    prefix): the activations of session 17 waiting at the next stage go at once, one still in
    flight goes on arrival, both counted "stale"; session 18's message is taken."""
    a, b = pair
    enc = codecs.encode(torch.ones(2, 8), "fp32")
    for tag in ("17/act/0", "17/act/1"):
        a.send("s1r0", tag, Kind.ACTIVATION, enc, 0).wait(30.0)
    wait_for(lambda: b.mailbox.pending("s0r0") == 2, 30, "both activations filed")
    assert b.drop_tags("17/") == 2
    assert b.mailbox.pending() == 0 and b.stats.rejects["stale"] == 2
    late = a.send("s1r0", "17/act/2", Kind.ACTIVATION, enc, 0)  # its sender had not noticed
    late.wait(30.0)
    assert late.ack == Ack.DROPPED  # valid, but dropped there: the sender is told
    wait_for(lambda: b.stats.rejects["stale"] == 3, 30, "the late activation dropped")
    assert b.mailbox.pending() == 0
    a.send("s1r0", "18/act/0", Kind.ACTIVATION, enc, 0).wait(30.0)
    got = b.recv("s0r0", "18/act/0", Expect(kind=Kind.ACTIVATION, shape=(2, 8)), 30.0)
    assert torch.equal(got.tensor(), torch.ones(2, 8))


def test_rounds_a_state_download_skipped_are_voided_now_and_on_arrival(pair):
    """What mesh/runtime/stage.py's drop_rounds does after a download moved a cell's step on
    (void_rounds over the skipped rounds): the other replica's payloads for them, waiting in
    the mailbox, go at once (they held it until the ttl: the soak's ~160 per re-formed
    replica), one that arrives later goes on arrival, all counted "late"; a later round that
    the cell runs is averaged."""
    a, b = pair
    members = ["s0r0", "s1r0"]
    for rid in (5, 6, 7):  # b never runs these: a's payloads wait in b's mailbox
        a.start_mean("g", members, rid, torch.full((4,), float(rid)), "fp32", 1.0)
    wait_for(lambda: b.mailbox.pending("s0r0") == 3, 30, "a's payloads filed")
    assert b.void_rounds("g", members, range(5, 9)) == 3
    assert b.mailbox.pending() == 0 and b.stats.rejects["late"] == 3
    a.start_mean("g", members, 8, torch.ones(4), "fp32", 1.0)  # skipped too: dropped there
    wait_for(lambda: b.stats.rejects["late"] == 4, 30, "the late payload dropped")
    assert b.mailbox.pending() == 0
    mine = b.start_mean("g", members, 9, torch.zeros(4), "fp32", 30.0)
    theirs = a.start_mean("g", members, 9, torch.full((4,), 2.0), "fp32", 30.0)
    assert torch.equal(mine.result(40.0).mean, torch.ones(4))
    assert torch.equal(theirs.result(40.0).mean, torch.ones(4))
