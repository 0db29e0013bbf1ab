"""The mailbox both transports file messages in (comms/mailbox.py): bounds, eviction, closed
sessions, lost senders, waiting for room, and what a receiver expects."""

import threading
import time

import pytest
import torch

from comms import codecs, wire
from comms.errors import PeerLost, PeerTimeout
from comms.mailbox import Mailbox
from comms.wire import Expect, Kind, Message


def _msg(name: str, kind: Kind = Kind.ACTIVATION, numel: int = 4) -> Message:
    return Message(name, kind, 0, codecs.encode(torch.zeros(numel), "fp32"))


def _file(box: Mailbox, sender: str, msg: Message, nbytes: int = 16) -> bool:
    assert box.try_reserve(sender, nbytes)
    return box.put(sender, msg, nbytes)


def test_a_broken_sessions_messages_are_dropped_at_once_and_on_arrival():
    """close_prefix (a broken pipeline session, mesh/runtime/stage.py reset): waiting messages
    of that session go now, not after the mailbox's ttl; later ones go on arrival; other
    sessions' messages and rounds stay; the room is given back."""
    drops = []
    box = Mailbox(4, 1 << 20, on_drop=drops.append)
    for sender, name in [("s0r0", "17/act/3"), ("s2r0", "17/grad/2"), ("s0r0", "18/act/0")]:
        _file(box, sender, _msg(name))
    assert box.close_prefix("17/") == 2
    assert drops == ["stale", "stale"] and box.pending() == 1
    assert not _file(box, "s0r0", _msg("17/act/4"))  # a late message of the broken session
    assert drops == ["stale"] * 3 and box.pending() == 1
    assert box.take("s0r0", "18/act/0", time.monotonic() + 0.1) is not None
    for _ in range(4):  # every byte and slot was given back
        assert box.try_reserve("s2r0", 16)
    with pytest.raises(ValueError):
        box.close_prefix("")


def test_full_box_evicts_oldest_round_frames_not_pipeline_messages():
    drops = []
    box = Mailbox(3, 1 << 20, on_drop=drops.append)
    for name, kind in [("a", Kind.ACTIVATION), ("m1", Kind.AVERAGE), ("m2", Kind.AVERAGE)]:
        _file(box, "p", _msg(name, kind))
    assert box.try_reserve("p", 16)  # m1 evicted for it
    assert drops == ["evicted"]
    deadline = time.monotonic() + 0.1
    assert box.take("p", "a", deadline) is not None
    assert box.take("p", "m1", deadline) is None
    assert box.take("p", "m2", deadline) is not None


def test_a_lost_sender_raises_only_when_nothing_waits_and_until_it_is_back():
    heard = []
    box = Mailbox(8, 1 << 20)
    box.on_lost(lambda sender, why: heard.append((sender, why)))
    _file(box, "b", _msg("x"))
    box.mark_lost("b", "peer closed")
    box.mark_lost("b", "later reason")  # the first reason stands
    assert heard == [("b", "peer closed"), ("b", "later reason")] and box.lost("b") == "peer closed"
    assert box.take("b", "x", time.monotonic() + 30) is not None  # what arrived stays readable
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="peer closed"):
        box.take("b", "y", t0 + 30)
    assert time.monotonic() - t0 < 10  # at once, not at the deadline
    assert box.take("c", "y", time.monotonic()) is None  # another sender: not lost
    box.mark_lost("b", "lost: reset")
    _file(box, "b", _msg("z"))
    assert box.lost("b") == ""  # a valid message from it again


def test_reset_drops_what_the_last_incarnation_left():
    drops = []
    box = Mailbox(8, 1 << 20, on_drop=drops.append)
    _file(box, "b", _msg("x"))
    _file(box, "b", _msg("y"))
    box.mark_lost("b", "lost: gone")
    assert box.reset("b") == 2 and drops == ["stale", "stale"]
    assert box.lost("b") == "" and box.pending() == 0 and box.held_bytes() == 0


def test_wait_room_holds_the_sender_until_a_take_or_gives_up():
    """A link that cannot refuse a message waits for room (backpressure); it stops waiting
    when give_up names a reason."""
    box = Mailbox(1, 1 << 20)
    _file(box, "b", _msg("first"))
    got = []
    waiter = threading.Thread(target=lambda: got.append(box.wait_room("b", 16, lambda: "")))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # no room while the first waits
    assert box.take("b", "first", time.monotonic()) is not None
    waiter.join(10)
    assert got == [""] and box.put("b", _msg("second"), 16)
    assert box.wait_room("b", 16, lambda: "stale") == "stale"
    assert box.pending("b") == 1


def test_receive_checks_what_the_caller_expects():
    drops = []
    box = Mailbox(8, 1 << 20, on_drop=drops.append)
    _file(box, "a", _msg("t", numel=3))
    _file(box, "a", _msg("t", numel=4))
    got = box.receive("a", "t", Expect(shape=(4,)), 5.0)
    assert got.encoded.shape == (4,) and drops == ["unexpected_shape"]
    _file(box, "a", _msg("epoch/2/act/7"))
    assert box.receive_prefix("a", "epoch/2/", Expect(), 5.0).name == "epoch/2/act/7"
    with pytest.raises(PeerTimeout, match="within 0.05s"):
        box.receive("a", "t", Expect(), 0.05)


def test_a_rejected_frames_label_is_still_readable():
    """What a receiver that refused a frame's body can say about it: its kind and name."""
    frame = wire.pack("mean/stage1/7/1", Kind.AVERAGE, codecs.encode(torch.ones(4), "fp32"), 3)
    assert wire.frame_label(frame[: wire.MAX_HEADER_BYTES]) == (Kind.AVERAGE, "mean/stage1/7/1")
    assert wire.frame_label(b"\x00garbage") is None
