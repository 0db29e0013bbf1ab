"""The averaging round of both transports (comms/means.py, comms/group_means.py) over in-process
links: every verdict, the early and late frames, the cut, the deadline, lost and refused members,
the round clock, voided rounds, lingering sends. The real links run it in
tests/integration/test_transport_suite.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import PeerLost
from comms.group_means import LINGER_ROUNDS, THREAD_NAME, GroupMeans
from comms.mailbox import Mailbox
from comms.means import REFUSED, Contribution, FrameId, alone, verdict
from comms.transport import MeanStatus, TransportStats, mean_in_member_order

OK, PARTIAL, FAILED = MeanStatus.OK, MeanStatus.PARTIAL, MeanStatus.FAILED
ROUND_S = 120.0  # a round's deadline, unless a test says otherwise
WAIT_S = 30.0  # how long a test waits for a result: one that comes ended by itself, not at
# its deadline (which the wait would report as FAILED "deadline")


class FakeSent:
    """A frame in flight on a FakeLink: done once the net delivers (or fails) it."""

    def __init__(self) -> None:
        self._done, self._error, self._taken = threading.Event(), None, None
        self._callbacks: list = []
        self.cancelled = False

    def finish(self, taken: bool | None, error: BaseException | None = None) -> None:
        self._error, self._taken = error, taken
        self._done.set()
        for fn in self._callbacks:
            fn()

    def done(self) -> bool:
        return self._done.is_set()

    def error(self) -> BaseException | None:
        return self._error

    def taken(self) -> bool | None:
        return self._taken

    def on_done(self, fn) -> None:
        if self.done():
            fn()
        else:
            self._callbacks.append(fn)

    def cancel(self) -> None:
        self.cancelled = True


class FakeLink:
    """One member's link (comms.means.RoundLink): its frames wait in `net` until delivered."""

    def __init__(self, net: Net, me: str) -> None:
        self.net, self.me, self.stats = net, me, TransportStats()

    def send_frame(self, to: str, frame: bytes) -> FakeSent:
        sent = FakeSent()
        if to in self.net.down:
            sent.finish(None, PeerLost(f"link to {to!r} lost"))
        else:
            self.net.queue.append((self.me, to, frame, sent))
        return sent


class Net:
    """Members' round engines joined by FakeLinks. `acks`: whether a link says a frame was
    taken (hivemind's links do, torch's do not)."""

    def __init__(self, names: list[str], acks: bool = True, groups: dict | None = None) -> None:
        self.acks, self.queue, self.down = acks, [], set()
        self.links = {n: FakeLink(self, n) for n in names}
        self.boxes = {n: Mailbox(8, 1 << 20, on_drop=self.links[n].stats.add_reject) for n in names}
        self.means = {n: GroupMeans(self.links[n], self.boxes[n], groups) for n in names}

    def deliver(self, to: str | None = None) -> None:
        """Deliver the frames waiting (those for `to` only, if given), as a transport would."""
        keep = []
        for frm, dst, frame, sent in self.queue:
            if to is not None and dst != to:
                keep.append((frm, dst, frame, sent))
                continue
            got = wire.unpack(frame)
            if isinstance(got, wire.Reject):
                self.links[dst].stats.add_reject(got.reason)
                self.means[dst].refused(frm, wire.frame_label(frame)[1], got.reason)
                sent.finish(False if self.acks else None)
            else:
                kept = self.means[dst].file(frm, got)
                sent.finish(kept if self.acks else None)
        self.queue = keep

    def start(
        self, name, round_id, values, codec="fp32", timeout_s=ROUND_S, group="g", abstain=False
    ):
        members = list(self.links)
        mine = Contribution.of(values, codec, abstain)
        return self.means[name].start(group, members, round_id, mine, timeout_s)

    def close(self) -> None:
        for m in self.means.values():
            m.close()


@pytest.fixture
def nets():
    made: list[Net] = []

    def make(*args, **kwargs) -> Net:
        made.append(Net(*args, **kwargs))
        return made[-1]

    yield make
    for net in made:
        net.close()


def vals(k: int, n: int = 64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(k))


# ------------------------------------------------------------------ the verdict, pure


def test_verdict_every_outcome():
    a, b, c = torch.ones(2), torch.zeros(2), torch.full((2,), 4.0)
    members = ["a", "b", "c"]
    res = verdict(members, "a", {"a": a, "b": b, "c": c}, {}, True, (2,))
    assert res.status is OK and res.contributors == ("a", "b", "c")
    assert torch.equal(res.mean, mean_in_member_order([a, b, c]))
    res = verdict(members, "a", {"a": a, "c": c}, {"b": "lost: reset"}, None, (2,))
    assert res.status is PARTIAL and res.contributors == ("a", "c") and "b: lost" in res.reason
    assert torch.equal(res.mean, mean_in_member_order([a, c])) and len(res.parts) == 2
    res = verdict(members, "a", {"b": b, "c": c}, {"a": "own payload: NaN"}, True, (2,))
    assert res.status is FAILED and res.mean is None and res.reason == "own payload: NaN"
    # every payload here, but nobody took ours: a member frozen through the round
    res = verdict(members, "a", {"a": a, "b": b, "c": c}, {}, False, (2,))
    assert res.status is FAILED and "no other member took our payload" in res.reason
    # alone is not a mean: FAILED, unless another member took ours or its payload was refused
    res = verdict(members, "a", {"a": a}, {}, None, (2,))
    assert res.status is FAILED and res.reason == "no other member's payload in time"
    res = verdict(members, "a", {"a": a}, {"b": REFUSED + "not_finite"}, None, (2,))
    assert res.status is PARTIAL and res.contributors == ("a",) and "not_finite" in res.reason
    res = verdict(members, "a", {"a": a}, {}, True, (1, 2))
    assert res.status is PARTIAL and res.mean.shape == (1, 2)


def test_verdict_with_a_member_that_sat_out():
    """An abstainer (stale weights) is no contributor and not missing: the round is OK over the
    others everywhere, the abstainer's own included; with no contributor it is FAILED."""
    b, c = torch.zeros(2), torch.full((2,), 4.0)
    members = ["a", "b", "c"]
    for me in members:
        res = verdict(members, me, {"b": b, "c": c}, {}, True, (2,), abstained={"a"})
        assert res.status is OK and res.contributors == ("b", "c") and res.abstained == ("a",)
        assert torch.equal(res.mean, mean_in_member_order([b, c]))
    res = verdict(members, "a", {"b": b}, {"c": "lost: reset"}, True, (2,), abstained={"a"})
    assert res.status is PARTIAL and res.contributors == ("b",) and "c: lost" in res.reason
    res = verdict(members, "a", {}, {}, True, (2,), abstained={"a", "b", "c"})
    assert res.status is FAILED and res.reason == "no contributor"


def test_alone():
    assert alone(["a"], "a") and alone([], "a") and not alone(["a", "b"], "a")


def test_frame_names():
    fid = FrameId("stage1", 7, 2)
    assert fid.name == "mean/stage1/7/2" and FrameId.parse(fid.name) == fid
    assert FrameId.parse("stage1/7/2") is None and FrameId.parse("mean/stage1/x/2") is None


# ------------------------------------------------------------------ rounds over fake links


@pytest.mark.parametrize("acks", [True, False])
def test_every_member_in_time_is_ok_and_bit_identical(nets, acks):
    net = nets(["a", "b", "c"], acks=acks)
    x = {n: vals(k) for k, n in enumerate(net.links)}
    handles = {n: net.start(n, 0, x[n], "fp8_e4m3") for n in net.links}
    net.deliver()
    ref = mean_in_member_order([codecs.roundtrip(x[n], "fp8_e4m3") for n in net.links])
    for n, h in handles.items():
        res = h.result(WAIT_S)
        assert res.status is OK and torch.equal(res.mean, ref), (n, res.reason)
        assert dict(net.links[n].stats.rounds) == {"ok": 1}
    assert sum(t.name == THREAD_NAME for t in threading.enumerate()) >= 3  # one per engine


def test_a_frame_that_comes_early_waits_in_the_mailbox_and_is_taken_at_start(nets):
    net = nets(["a", "b"])
    hb = net.start("b", 3, vals(1))
    net.deliver("a")  # b's frame reaches a, which has not started round 3
    assert net.boxes["a"].pending("b") == 1
    assert net.means["a"].newest("g", ["a", "b"]) == 3  # the round clock: b launched round 3
    ha = net.start("a", 3, vals(0))
    assert net.boxes["a"].pending() == 0
    net.deliver("b")
    assert ha.result(WAIT_S).status is OK and hb.result(WAIT_S).status is OK


def test_a_late_frame_is_dropped_and_its_sender_told(nets):
    """a's round ends at its cut without b; b's frame of it, and of any earlier round, is late
    there: dropped, counted, and (on a link that acks) b's round fails: nobody took its
    payload, so it is no mean of the group."""
    net = nets(["a", "b"])
    ha = net.start("a", 5, vals(0))
    net.deliver("b")  # a's frame waits at b, early
    ha.cut()
    res = ha.result(WAIT_S)  # b took a's frame: a partial of a alone
    assert res.status is PARTIAL and res.contributors == ("a",)
    hb = net.start("b", 5, vals(1))
    net.deliver("a")
    assert net.links["a"].stats.rejects["late"] == 1
    rb = hb.result(WAIT_S)
    assert rb.status is FAILED and "no other member took our payload" in rb.reason
    frame = wire.pack(FrameId("g", 4, 1).name, wire.Kind.AVERAGE, codecs.encode(vals(2), "fp32"), 4)
    assert not net.means["a"].file("b", wire.unpack(frame))  # an older round: late too
    assert net.links["a"].stats.rejects["late"] == 2


def test_the_cut_ends_a_round_at_once_over_what_it_has(nets):
    net = nets(["a", "b", "c"], acks=False)
    ha = net.start("a", 0, vals(0))
    hb = net.start("b", 0, vals(1))
    net.deliver("a")
    assert not ha.done()  # c's payload is missing: the round waits (until its deadline)
    assert ha.cut() is True
    res = ha.result(WAIT_S)
    assert res.status is PARTIAL and res.contributors == ("a", "b") and "c:" in res.reason
    # cut alone (no link acks, nobody's payload here): no mean
    hc = nets(["a", "b"], acks=False).start("a", 0, vals(0))
    hc.cut()
    assert hc.result(WAIT_S).reason == "no other member's payload in time"
    hb.cut()


def test_the_deadline_ends_a_round_by_itself(nets):
    net = nets(["a", "b"])
    h = net.start("a", 0, vals(0), timeout_s=0.2)
    net.deliver()  # b takes a's frame (early there) but never starts its round
    res = h.result(WAIT_S)  # returns at the round's 0.2 s deadline, not this wait's
    assert res.status is PARTIAL and res.contributors == ("a",)
    assert "b: not here by the deadline" in res.reason


def test_a_refused_frame_ends_the_wait_for_its_member_before_and_after_the_start(nets):
    net = nets(["a", "b", "c"], acks=False)
    bad = Encoded("fp32", (64,), torch.full((64,), float("nan")), None)
    hb = net.means["b"].start("g", ["a", "b", "c"], 0, Contribution.encoded(bad), ROUND_S)
    net.deliver("a")  # refused at a (not finite) before a's round 0 starts
    hc = net.start("c", 0, vals(2))
    ha = net.start("a", 0, vals(0))
    net.deliver()
    res = ha.result(WAIT_S)
    assert res.status is PARTIAL and res.contributors == ("a", "c"), res
    assert "b: rejected: not_finite" in res.reason
    assert hb.result(WAIT_S).reason == "own payload rejected: not_finite"  # by itself
    # refused after the start: a's round 1 waits for b until b's frame is refused
    ha = net.start("a", 1, vals(0))
    hb = net.means["b"].start("g", ["a", "b", "c"], 1, Contribution.encoded(bad), ROUND_S)
    hc = net.start("c", 1, vals(2))
    net.deliver()
    assert ha.result(WAIT_S).contributors == ("a", "c")
    for h in (hb, hc):
        h.cut()


def test_a_frame_that_does_not_fit_the_round_is_refused(nets):
    net = nets(["a", "b"])
    ha = net.start("a", 0, vals(0, 64))
    hb = net.start("b", 0, vals(1, 32))  # another size
    net.deliver()
    res = ha.result(WAIT_S)
    assert res.status is PARTIAL and "rejected: unexpected_shape" in res.reason, res
    assert net.links["a"].stats.rejects["unexpected_shape"] == 1
    hb.cut()


def test_a_lost_link_ends_the_wait_for_its_member(nets):
    net = nets(["a", "b", "c"])
    ha = net.start("a", 0, vals(0))
    hb = net.start("b", 0, vals(1))
    net.deliver()
    assert not ha.done()
    net.boxes["a"].mark_lost("c", "lost: reset by peer")  # what a transport does on a reset
    res = ha.result(WAIT_S)
    assert res.status is PARTIAL and res.contributors == ("a", "b")
    assert "c: lost: reset by peer" in res.reason
    # known lost at the start: not waited for, nothing sent to it
    h2 = net.start("a", 1, vals(0))
    assert set(h2.sends) == {"b"}
    net.start("b", 1, vals(1))
    net.deliver()
    assert h2.result(WAIT_S).contributors == ("a", "b")
    hb.cut()


def test_a_failed_send_gives_its_member_up(nets):
    net = nets(["a", "b"])
    net.down.add("b")
    res = net.start("a", 0, vals(0)).result(WAIT_S)
    assert res.status is FAILED and res.reason == "no other member's payload in time"


def test_own_payload_not_finite_fails_here_but_still_takes_the_others(nets):
    """A member without a payload of its own still takes the others' frames (they count it a
    member that took part), and its own round fails."""
    net = nets(["a", "b"])
    ha = net.start("a", 0, torch.full((64,), float("nan")))
    hb = net.start("b", 0, vals(1))
    assert "b" not in ha.sends  # no frame of ours to send
    net.deliver()
    ra = ha.result(WAIT_S)
    assert ra.status is FAILED and ra.reason.startswith("own payload")
    hb.cut()
    rb = hb.result(WAIT_S)
    assert rb.status is PARTIAL and rb.contributors == ("b",)  # a took b's frame


def test_voided_rounds_drop_their_frames_now_and_on_arrival(nets):
    net = nets(["a", "b"])
    for round_id in (5, 6, 7):
        net.start("b", round_id, vals(round_id), timeout_s=0.01)
    net.deliver("a")
    assert net.boxes["a"].pending("b") == 3
    assert net.means["a"].void("g", ["a", "b"], range(5, 9)) == 3
    assert net.boxes["a"].pending() == 0 and net.links["a"].stats.rejects["late"] == 3
    net.start("b", 8, vals(8), timeout_s=0.01)
    net.deliver("a")
    assert net.links["a"].stats.rejects["late"] == 4
    # a round id not above the last launched (a clock that went back) starts over, never
    # raises: its partner's frame was dropped as late, so it ends alone, FAILED
    back = net.start("a", 8, vals(0), timeout_s=0.01).result(WAIT_S)
    assert back.status is MeanStatus.FAILED
    ha, hb = net.start("a", 9, vals(0)), net.start("b", 9, vals(9))
    net.deliver()
    assert ha.result(WAIT_S).status is OK and hb.result(WAIT_S).status is OK


def test_frames_of_rounds_skipped_here_go_at_the_next_start(nets):
    net = nets(["a", "b"])
    for round_id in (1, 2):
        net.start("b", round_id, vals(round_id), timeout_s=0.01)
    net.deliver("a")
    net.start("a", 2, vals(0))  # a jumps to round 2: round 1's frame is of no use
    assert net.links["a"].stats.rejects["late"] == 1 and net.boxes["a"].pending() == 0


def test_unfinished_sends_of_ended_rounds_are_bounded(nets):
    net = nets(["a", "b"])
    handles = [net.start("a", r, vals(r), timeout_s=0.01) for r in range(3 * LINGER_ROUNDS)]
    assert all(h.result(WAIT_S).status is FAILED for h in handles)  # b never answers
    sends = [s for _, _, _, s in net.queue]
    assert sum(not s.cancelled for s in sends) <= LINGER_ROUNDS + 1
    assert net.means["a"].lingering_sends() <= LINGER_ROUNDS


def test_fixed_groups_refuse_strangers(nets):
    net = nets(["a", "b"], groups={"g": ["a", "b"]})
    frame = wire.pack(FrameId("h", 0, 1).name, wire.Kind.AVERAGE, codecs.encode(vals(0), "fp32"), 0)
    assert not net.means["a"].file("b", wire.unpack(frame))
    assert not net.means["a"].file("z", wire.unpack(frame.replace(b"mean/h", b"mean/g")))
    assert net.links["a"].stats.rejects["unexpected"] == 2
    with pytest.raises(ValueError, match="not in a group"):
        net.start("a", 0, vals(0), group="h")
    with pytest.raises(ValueError, match="members"):
        net.means["a"].start("g", ["a"], 0, Contribution.of(vals(0), "fp32"), 1.0)


def test_close_fails_open_rounds_and_later_ones(nets):
    net = nets(["a", "b"])
    h = net.start("a", 0, vals(0))
    net.means["a"].close()
    assert h.result(WAIT_S).reason == "transport closed"
    assert net.start("a", 1, vals(0)).result(WAIT_S).reason == "transport closed"


def test_one_member_is_its_own_mean(nets):
    net = nets(["a"])
    x = vals(0)
    res = net.start("a", 0, x, "bf16").result(WAIT_S)
    assert res.status is OK and torch.equal(res.mean, codecs.roundtrip(x, "bf16"))


@pytest.mark.parametrize("acks", [True, False])
def test_a_member_with_stale_weights_sits_the_mean_out_and_takes_the_others(nets, acks):
    """a abstains (its frame: the round's name over an empty payload): every member, a
    included, ends at once (no deadline) with the mean of b and c, bit-identical, and counts
    it ok; a's abstention costs the others a frame header, not its payload's bytes."""
    net = nets(["a", "b", "c"], acks=acks)
    x = {n: vals(k) for k, n in enumerate(net.links)}
    handles = {n: net.start(n, 0, x[n], "fp8_e4m3", abstain=n == "a") for n in net.links}
    sizes = {frm: len(frame) for frm, _, frame, _ in net.queue}
    assert sizes["a"] < 128 < sizes["b"]
    net.deliver()
    ref = mean_in_member_order([codecs.roundtrip(x[n], "fp8_e4m3") for n in ("b", "c")])
    for n, h in handles.items():
        res = h.result(WAIT_S)
        assert res.status is OK and res.contributors == ("b", "c"), (n, res.reason)
        assert res.abstained == ("a",) and torch.equal(res.mean, ref), n
        assert dict(net.links[n].stats.rounds) == {"ok": 1}
    # an abstention that came early waits for its round like any frame
    hb = net.start("b", 1, vals(5), abstain=True)
    net.deliver("a")
    ha, hc = net.start("a", 1, vals(6)), net.start("c", 1, vals(7))
    net.deliver()
    assert hb.result(WAIT_S).contributors == ("a", "c") == ha.result(WAIT_S).contributors
    assert hc.result(WAIT_S).abstained == ("b",)
