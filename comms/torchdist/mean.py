"""Group means of TorchTransport (comms/torchdist/transport.py): an all-gather over its links.

A round sends this member's wire frame, `wire.pack(f"{group}#{round_id}", AVERAGE, encoded
payload)`, to every other member over the transport's point-to-point links (each through that
link's sender, so shaped links cost what they would) and takes theirs as they arrive. The
result is the mean of every contributor's DEQUANTIZED payload (own included, read back from its
own frame), summed in member order (`mean_in_member_order`): with every member in time it is
bit-identical on every member and equal to a one-process reference. A member whose frame is not
here by the deadline, whose link is lost, or whose frame fails the round's checks (name, shape,
codec, size: `wire.expect_reject`; crc and finiteness were checked on arrival) is left out: the
round is PARTIAL over named contributors, or FAILED (own payload not finite), never silent local
values. A round can be cut (`cut()`: end now with what arrived), like the hivemind path's.

Why not a gloo collective (the design until this one): a collective that misses its deadline
closes every pair of its group, so the first late round turned averaging off for the rest of
the run, and a group cannot drop a dead member. Here a late round costs that round only: its
frames, when they come, are dropped on arrival ("late"), the next round starts clean, and a
dead member's rounds are partial over the survivors at once.

Frames of a round this member has not started yet (a replica ahead of this one) wait in a
bounded per-group buffer (EARLY_ROUNDS rounds, mailbox_bytes) until it starts that round, and
the highest round id seen from each group is the column's round clock (`newest_round`): a
trailing replica jumps to the rounds its partners launch (mesh/algo/round_clock.py). A round
id at or below the newest one this member launched and no longer open is over: its frames are
late. Launches are strictly increasing per group (the round clock's `own_next`).

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import NotFiniteError
from comms.throttle import Delivery
from comms.transport import MeanResult, MeanStatus, TransportStats, mean_in_member_order
from comms.wire import Expect, Kind, Message, Reject

MAX_GROUP_NAME = 200  # f"{group}#{round_id}" must fit wire.MAX_NAME_BYTES
EARLY_ROUNDS = 64  # rounds per group whose frames may wait for this member to start them


def round_tag(group: str, round_id: int) -> str:
    return f"{group}#{round_id}"


def parse_round_tag(name: str) -> tuple[str, int] | None:
    group, sep, rid = name.rpartition("#")
    if not sep or not rid.isdigit():
        return None
    return group, int(rid)


@dataclass(eq=False)
class MeanGroup:
    name: str
    members: tuple[str, ...]
    newest_seen: int = -1  # the highest round id another member's frame carried
    launched: int = -1  # the highest round id started here
    open: dict[int, MeanRound] = field(default_factory=dict)
    early: dict[int, dict[str, Message]] = field(default_factory=dict)  # not started here yet
    early_bytes: int = 0
    # frames refused on arrival (crc, finiteness) for rounds not started here yet: member ->
    # reason, so the round, once started, counts them refused rather than waits for them
    refused: dict[int, dict[str, str]] = field(default_factory=dict)


class MeanRound:
    """One group-mean round: a comms.transport.MeanHandle."""

    def __init__(
        self, group: str, round_id: int, members: tuple[str, ...], deadline: float
    ) -> None:
        self.group, self.round_id, self.members, self.deadline = group, round_id, members, deadline
        self.expect = Expect()
        self.shape: tuple[int, ...] = ()
        self.got: dict[str, torch.Tensor] = {}  # member -> dequantized flat payload
        self.gone: dict[str, str] = {}  # member -> why it will not contribute
        self.cut_asked = False
        self.sends: list[Delivery] = []  # our frame to each other member
        self._event = threading.Event()
        self._result: MeanResult | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def cut(self) -> bool:
        """End the round now with the payloads that arrived (the runtime knows a member is
        gone, or the round has stayed open long enough). True: this transport can."""
        self.cut_asked = True
        return True

    def result(self, timeout_s: float) -> MeanResult:
        if not self._event.wait(max(0.0, timeout_s)) or self._result is None:
            return MeanResult(MeanStatus.FAILED, None, (), "deadline")
        return self._result

    def gathered(self) -> bool:
        return all(m in self.got or m in self.gone for m in self.members)

    def sent(self) -> bool:
        """Our frame is off to every member it went to (delivered, or its link failed): a
        round ends only then, so its bytes are counted by the time its result is read."""
        return all(d.done() for d in self.sends)

    def verdict(self, me: str) -> MeanResult:
        if me not in self.got:
            why = self.gone.get(me, "own payload missing")
            return MeanResult(MeanStatus.FAILED, None, (), why)
        who = tuple(m for m in self.members if m in self.got)
        parts = tuple(self.got[m] for m in who)
        mean = mean_in_member_order(parts).reshape(self.shape)
        if len(who) == len(self.members):
            return MeanResult(MeanStatus.OK, mean, who, parts=parts)
        if len(who) == 1 and not any(w.startswith("rejected") for w in self.gone.values()):
            # no other member's payload in time and none refused: no mean of a group, and
            # never own values passed off as one (a member frozen through the round)
            return MeanResult(MeanStatus.FAILED, None, (), "no other member's payload in time")
        missing = [
            f"{m}: {self.gone.get(m, 'not here by the deadline')}"
            for m in self.members
            if m not in self.got
        ]
        return MeanResult(MeanStatus.PARTIAL, mean, who, "missing " + "; ".join(missing), parts)

    def _finish(self, result: MeanResult) -> bool:
        if self._event.is_set():
            return False
        self._result = result
        self._event.set()
        return True


class GroupMeans:
    """TorchTransport's start_mean and its rounds (a mixin: needs the attributes below and
    `_submit_to(name, frame, kind) -> Delivery` / `_link_lost(name)`; calls `_file_mean` on
    arrival)."""

    me: str
    stats: TransportStats
    mailbox_bytes: int
    _closed: bool
    _groups: dict[str, MeanGroup]

    def _init_means(self) -> None:
        self._mean_cond = threading.Condition()
        self._ready: list[MeanRound] = []
        self._deadlines: list[tuple[float, int, MeanRound]] = []  # a heap
        self._mean_seq = 0
        self._mean_thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the MeanHandle side

    def start_mean(
        self,
        group: str,
        members: list[str],
        round_id: int,
        values: torch.Tensor,
        codec: str,
        timeout_s: float,
    ) -> MeanRound:
        """Start the mean of a float payload over the group (see the module docstring)."""
        flat = values.detach().reshape(-1)
        try:
            enc: Encoded | None = codecs.encode(flat, codec)
        except NotFiniteError:  # own values not finite: no payload; the others go on without
            enc = None
        return self._start_round(
            group, members, round_id, enc, flat.numel(), codec, timeout_s, tuple(values.shape)
        )

    def newest_round(self, group: str, members: Sequence[str]) -> int:
        """The highest round id another member of `group` launched, of those whose frames
        reached this member (-1: none): the column's round clock."""
        g = self._group(group, list(members))
        with self._mean_cond:
            return g.newest_seen

    def void_rounds(self, group: str, members: Sequence[str], round_ids: range) -> int:
        """Drop the waiting frames of rounds this member will never start (a state download
        moved it past them); later frames of those rounds are late."""
        g = self._group(group, list(members))
        dropped = 0
        with self._mean_cond:
            for rid in [r for r in g.early if r in round_ids]:
                dropped += self._drop_early(g, rid, "late")
            if round_ids:
                g.launched = max(g.launched, round_ids[-1])
        return dropped

    # ---------------------------------------------------------------- test hook (bad peers)

    def _start_mean_encoded(
        self, group: str, members: list[str], round_id: int, enc: Encoded, timeout_s: float
    ) -> MeanRound:
        """start_mean with a ready Encoded, skipping the sender-side finiteness check."""
        return self._start_round(
            group, members, round_id, enc, enc.numel, enc.codec, timeout_s, (enc.numel,)
        )

    # ---------------------------------------------------------------- internals

    def _group(self, group: str, members: list[str]) -> MeanGroup:
        g = self._groups.get(group)
        if g is None:
            raise ValueError(f"{self.me!r} is not in a group {group!r} (closed: {self._closed})")
        if tuple(members) != g.members:
            raise ValueError(f"group {group!r} members are {list(g.members)}, got {members}")
        return g

    def _start_round(
        self,
        group: str,
        members: list[str],
        round_id: int,
        enc: Encoded | None,
        numel: int,
        codec: str,
        timeout_s: float,
        shape: tuple[int, ...],
    ) -> MeanRound:
        g = self._group(group, members)
        name = round_tag(group, round_id)
        r = MeanRound(group, round_id, g.members, time.monotonic() + timeout_s)
        r.shape = shape
        frame = b""
        if enc is None:
            r.gone[self.me] = "own payload not finite"
        else:
            frame = wire.pack(name, Kind.AVERAGE, enc, round_id)
            r.expect = Expect(name, Kind.AVERAGE, (numel,), frozenset({codec}), enc.nbytes)
            own = wire.unpack(memoryview(frame), r.expect)
            if isinstance(own, Reject):  # the sender-side check was skipped (a test's bad peer)
                r.gone[self.me] = f"own payload rejected: {own.reason}"
            else:
                r.got[self.me] = own.tensor().reshape(-1)
        if not r.expect.name:  # no own frame: still check theirs by name, kind and shape
            r.expect = Expect(name, Kind.AVERAGE, (numel,), frozenset({codec}))
        with self._mean_cond:
            if self._closed:
                r.gone[self.me] = "transport closed"
                self._conclude(r)
                return r
            if round_id <= g.launched:
                raise ValueError(
                    f"round {round_id} of {group!r} started after round {g.launched}: "
                    "round ids must increase"
                )
            g.launched = round_id
            for rid in [x for x in g.early if x < round_id]:  # rounds this member skipped
                self._drop_early(g, rid, "late")
            for member, msg in self._pop_early(g, round_id).items():
                self._take_frame(r, member, msg)
            for rid in [x for x in g.refused if x < round_id]:
                del g.refused[rid]
            for member, reason in g.refused.pop(round_id, {}).items():
                if member not in r.got:
                    r.gone.setdefault(member, f"rejected: {reason}")
            for member in g.members:
                if member != self.me and member not in r.got:
                    why = self._link_lost(member)
                    if why:
                        r.gone.setdefault(member, why)
            g.open[round_id] = r
            self._mean_seq += 1
            heapq.heappush(self._deadlines, (r.deadline, self._mean_seq, r))
            if r.gathered() or self.me in r.gone:  # nothing to wait for, or no use waiting
                self._ready.append(r)
            if self._mean_thread is None:
                self._mean_thread = threading.Thread(
                    target=self._mean_loop, name="means", daemon=True
                )
                self._mean_thread.start()
            self._mean_cond.notify_all()
        if frame:
            r.sends = [
                self._submit_to(member, frame, "average")
                for member in g.members
                if member != self.me and member not in r.gone
            ]
        return r

    def _file_mean(self, sender: str, msg: Message) -> None:
        """Receiver side: a frame of a round (see the module docstring); never blocks."""
        parsed = parse_round_tag(msg.name)
        g = self._groups.get(parsed[0]) if parsed is not None else None
        if g is None or sender not in g.members or sender == self.me:
            self.stats.add_reject("unexpected")
            return
        rid = parsed[1]
        with self._mean_cond:
            g.newest_seen = max(g.newest_seen, rid)
            r = g.open.get(rid)
            if r is not None:
                if sender in r.got or sender in r.gone:
                    self.stats.add_reject("duplicate" if sender in r.got else "late")
                    return
                if time.monotonic() > r.deadline:  # its round is over, only not concluded yet
                    self.stats.add_reject("late")
                    r.gone[sender] = "late"
                    return
                self._take_frame(r, sender, msg)
                if r.gathered():
                    self._ready.append(r)
                    self._mean_cond.notify_all()
                return
            if rid <= g.launched:
                self.stats.add_reject("late")  # its round is over here
                return
            slot = g.early.setdefault(rid, {})
            if sender in slot:
                self.stats.add_reject("duplicate")
                return
            slot[sender] = msg
            g.early_bytes += msg.held_bytes
            while len(g.early) > EARLY_ROUNDS or g.early_bytes > self.mailbox_bytes:
                self._drop_early(g, min(g.early), "early_overflow")

    def _mean_rejected(self, sender: str, name: str, reason: str) -> None:
        """A frame of sender's refused on arrival (crc, finiteness): its open round takes it
        as refused (a PARTIAL without it), not as missing."""
        parsed = parse_round_tag(name)
        g = self._groups.get(parsed[0]) if parsed is not None else None
        if g is None or sender not in g.members:
            return
        with self._mean_cond:
            r = g.open.get(parsed[1])
            if r is None and parsed[1] > g.launched:  # its round has not started here yet
                g.refused.setdefault(parsed[1], {}).setdefault(sender, reason)
                while len(g.refused) > EARLY_ROUNDS:
                    g.refused.pop(min(g.refused))
                return
            if r is not None and sender not in r.got and sender not in r.gone:
                r.gone[sender] = f"rejected: {reason}"
                if r.gathered():
                    self._ready.append(r)
                    self._mean_cond.notify_all()

    def _member_lost(self, member: str, why: str) -> None:
        """A member's link is gone: its open rounds stop waiting for it."""
        with self._mean_cond:
            for g in self._groups.values():
                if member not in g.members:
                    continue
                for r in g.open.values():
                    if member not in r.got and member not in r.gone:
                        r.gone[member] = why
                        if r.gathered():
                            self._ready.append(r)
            self._mean_cond.notify_all()

    def _take_frame(self, r: MeanRound, member: str, msg: Message) -> None:
        bad = wire.expect_reject(msg, r.expect)
        if bad is not None:
            self.stats.add_reject(bad.reason)
            r.gone[member] = f"rejected: {bad.reason}"
            return
        r.got[member] = msg.tensor().reshape(-1)

    def _pop_early(self, g: MeanGroup, rid: int) -> dict[str, Message]:
        slot = g.early.pop(rid, {})
        g.early_bytes -= sum(m.held_bytes for m in slot.values())
        return slot

    def _drop_early(self, g: MeanGroup, rid: int, reason: str) -> int:
        slot = self._pop_early(g, rid)
        for _ in slot:
            self.stats.add_reject(reason)
        return len(slot)

    def _mean_loop(self) -> None:
        """The one thread that ends rounds: gathered or cut ones at once, the rest at their
        deadline. Sleeps until a frame completes a round, a cut, a deadline or close."""
        while True:
            with self._mean_cond:
                while True:
                    now = time.monotonic()
                    ready = [(r, r.sent()) for r in self._ready if not r.done()]
                    due = [r for r, sent in ready if sent]
                    self._ready[:] = [r for r, sent in ready if not sent]  # our sends still out
                    while self._deadlines and (
                        self._deadlines[0][0] <= now or self._deadlines[0][2].done()
                    ):
                        due.append(heapq.heappop(self._deadlines)[2])
                    due += [r for _, _, r in self._deadlines if r.cut_asked and not r.done()]
                    if due or self._closed:
                        break
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    # cuts are asked, and our sends end, without a notify: look again soon
                    # while any round is open
                    self._mean_cond.wait(None if wait is None else min(wait, 0.05))
                if self._closed:
                    due += [r for _, _, r in self._deadlines]
                    self._deadlines.clear()
                for r in due:
                    if not r.done():
                        self._conclude(r)
                if self._closed:
                    return

    def _conclude(self, r: MeanRound) -> None:
        """Under _mean_cond: the round's verdict, delivered once; its later frames are late."""
        g = self._groups.get(r.group)
        if g is not None and g.open.get(r.round_id) is r:
            del g.open[r.round_id]
        if self._closed and not r.gathered():
            result = MeanResult(MeanStatus.FAILED, None, (), "transport closed")
        else:
            try:
                result = r.verdict(self.me)
            except Exception as e:  # noqa: BLE001 - a round's fault is a value, never a crash
                result = MeanResult(MeanStatus.FAILED, None, (), f"{type(e).__name__}: {e}")
        if r._finish(result):
            with self.stats.lock:
                self.stats.rounds[result.status.value] += 1

    def _close_means(self) -> None:
        with self._mean_cond:
            self._mean_cond.notify_all()
        thread = self._mean_thread
        if thread is not None:
            thread.join(2.0)
        with self._mean_cond:  # rounds started after the thread ended
            for _, _, r in self._deadlines:
                if not r.done():
                    self._conclude(r)
            self._deadlines.clear()
