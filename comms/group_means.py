"""The rounds of one transport (`GroupMeans`), an all-gather of frames over its links, on one
thread; what a round is and how it ends: comms/means.py.

Links. A round sends its frame to every other member through the transport
(`RoundLink.send_frame`: bytes out, each through the link's shaping) and takes theirs as the
transport files them (`GroupMeans.file`; `refused` for a frame refused on arrival).

Early and late. A frame of a round not started here (a replica ahead of this one) waits in the
transport's mailbox (comms/mailbox.py: bounded per sender; a full box evicts the oldest round
frames first) until its round starts. Launches are strictly increasing per group (the round
clock's own_next): a round id at or below the newest one launched here (or voided: `void`) and
no longer open is over, and its frames are late: dropped on arrival and counted, and the link
tells the sender where it can (hivemind's ack). The highest round id each member's frames carry
is the round clock (`newest`): a trailing replica jumps to the rounds its partners launch
(mesh/algo/round_clock.py).

End. A round ends when every member's payload is here or given up on and our frames are off
(delivered, or their link failed), at its deadline, or when cut (`MeanRound.cut`: the runtime
gives up on a late member). A member is given up on when its link is lost (the mailbox's
notice), our frame to it failed, or its frame was refused (on arrival: crc, finiteness; here:
name, shape, codec, size). One thread runs every round of a transport, woken by each of these
events and by deadlines, never polling.

Lingering. Our frames of a round that ended may still be on their way to a slow member; those
of the last LINGER_ROUNDS ended rounds are left to finish, older ones are cancelled, so what a
frozen member costs stays bounded however many rounds run past it.

imports: torch, comms only.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from comms import wire
from comms.errors import CodecError, PeerLost, WireError
from comms.mailbox import Mailbox
from comms.means import (
    MAX_GROUP_BYTES,
    REFUSED,
    Contribution,
    FrameId,
    MeanResult,
    MeanRound,
    MeanStatus,
    RoundLink,
    Sent,
    verdict,
)
from comms.wire import Kind, Message, Reject

NEWEST_KEYS = 4096  # (group, sender) pairs whose round clock is kept: a column's few, with room
PEER_GROUPS = 256  # groups known only from peers' frames whose refusals are kept
REFUSED_ROUNDS = 64  # rounds per group, not started here, whose refused frames are remembered
LINGER_ROUNDS = 8  # ended rounds whose sends may still finish (see the module docstring)
THREAD_NAME = "mean-rounds"


@dataclass(eq=False)
class _Group:
    members: tuple[str, ...] | None  # None: known only from peers' frames
    launched: int = -1  # the highest round id started (or voided) here
    open: dict[int, MeanRound] = field(default_factory=dict)
    # frames refused on arrival for rounds not started here: round id -> member -> reason
    refused: dict[int, dict[str, str]] = field(default_factory=dict)


class GroupMeans:
    """Every round of one transport, on one thread (see the module docstring).

    Args:
        link: the transport's side of its rounds (RoundLink).
        mailbox: where frames of rounds not started yet wait; its lost marks end waits.
        groups: fixed groups (name -> members, this member in each): frames of any other are
            refused ("unexpected"); None learns groups from the rounds started.
    """

    def __init__(
        self,
        link: RoundLink,
        mailbox: Mailbox,
        groups: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.link, self.mailbox = link, mailbox
        self._fixed = groups is not None
        self._lock = threading.RLock()  # the groups and their rounds
        self._groups = {g: _Group(tuple(ms)) for g, ms in (groups or {}).items()}
        self._newest: dict[tuple[str, str], int] = {}  # (group, sender) -> highest round id
        self._closed = False
        # the round thread's queue (never held while taking another lock): rounds to look at,
        # and every open round's deadline
        self._wake_cond = threading.Condition(threading.Lock())
        self._ready: dict[MeanRound, None] = {}
        self._deadlines: list[tuple[float, int, MeanRound]] = []  # a heap
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._lingering: deque[list[Sent]] = deque()  # round thread only
        mailbox.on_lost(self._lost)

    # ---------------------------------------------------------------- the transport's side

    def start(
        self,
        group: str,
        members: Sequence[str],
        round_id: int,
        mine: Contribution,
        timeout_s: float,
    ) -> MeanRound:
        """Start a round without blocking (every member calls it with the same group, members
        and round_id); its frames go out now."""
        me, members = self.link.me, tuple(members)
        if me not in members or len(set(members)) != len(members):
            raise ValueError(f"members must be distinct and include {me!r}: {list(members)}")
        if len(group.encode()) > MAX_GROUP_BYTES:
            raise ValueError(f"group name over {MAX_GROUP_BYTES} bytes: {group[:60]!r}...")
        r = MeanRound(group, round_id, members, time.monotonic() + timeout_s, self._look)
        r.mine = mine
        frame = self._own_frame(r)
        with self._lock:
            g = self._group(group, members)
            if self._closed:
                self._deliver(r, MeanResult(MeanStatus.FAILED, None, (), "transport closed"))
                return r
            if round_id <= g.launched or round_id in g.open:
                if round_id in g.open:  # the same round twice: the second is refused, a value
                    why = f"round {round_id} of {group!r} is open already"
                    self._deliver(r, MeanResult(MeanStatus.FAILED, None, (), why))
                    return r
                # the cell's round clock went back (its state was replaced by an older one):
                # its rounds start over from here, as the members' clocks will meet it again
                g.launched = round_id - 1
            g.launched, g.members = round_id, members
            g.open[round_id] = r
            lost = self._take_early(g, r)
            for m in members:
                if m != me and m not in lost and frame:  # a refused member still takes ours
                    r.sends[m] = self.link.send_frame(m, frame)
                    r.sends[m].on_done(lambda: self._look(r))
            with self._wake_cond:
                self._seq += 1
                heapq.heappush(self._deadlines, (r.deadline, self._seq, r))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name=THREAD_NAME, daemon=True
                    )
                    self._thread.start()
        self._look(r)
        return r

    def file(self, sender: str, msg: Message) -> bool:
        """A valid AVERAGE frame from sender: into its open round, into the mailbox until its
        round starts, or dropped (late, duplicate, unexpected, no room). True when kept."""
        fid = FrameId.parse(msg.name)
        with self._lock:
            g = self._groups.get(fid.group) if fid is not None else None
            if (
                fid is None
                or self._fixed
                and (g is None or sender not in (g.members or ()) or sender == self.link.me)
            ):
                return self._reject("unexpected")
            self._clock(fid.group, sender, fid.round_id)
            r = g.open.get(fid.round_id) if g is not None else None
            if r is not None:
                if sender not in r.members or sender == self.link.me:
                    return self._reject("unexpected")
                if sender in r.got or sender in r.gone:
                    return self._reject("duplicate" if sender in r.got else "late")
                if time.monotonic() > r.deadline:  # its round is over, only not ended yet
                    r.gone[sender] = "late"
                    return self._reject("late")
                self._take(r, sender, msg)  # (or refused against it: its round took part)
                if r.gathered():
                    self._look(r)
                return True
            if g is not None and fid.round_id <= g.launched:
                return self._reject("late")  # its round is over here
            if not self.mailbox.try_reserve(sender, msg.held_bytes):
                return self._reject("mailbox_full")
            return self.mailbox.put(sender, msg, msg.held_bytes)

    def refused(self, sender: str, name: str, reason: str) -> None:
        """sender's frame `name` was refused on arrival (crc, finiteness): its round counts it
        refused (PARTIAL without it, at once), not missing."""
        fid = FrameId.parse(name)
        if fid is None:
            return
        with self._lock:
            g = self._groups.get(fid.group)
            if g is None and not self._fixed and len(self._groups) < PEER_GROUPS:
                g = self._groups[fid.group] = _Group(None)
            if g is None or g.members is not None and sender not in g.members:
                return
            r = g.open.get(fid.round_id)
            if r is not None:
                if sender not in r.got and sender not in r.gone:
                    r.gone[sender] = REFUSED + reason
                    if r.gathered():
                        self._look(r)
            elif fid.round_id > g.launched:  # its round has not started here yet
                g.refused.setdefault(fid.round_id, {}).setdefault(sender, reason)
                while len(g.refused) > REFUSED_ROUNDS:
                    g.refused.pop(min(g.refused))

    def newest(self, group: str, members: Sequence[str]) -> int:
        """The highest round id of `group` another of `members` launched, of those whose frames
        reached this member (-1: none): the column's round clock."""
        with self._lock:
            if self._fixed:
                self._group(group, tuple(members))
            me = self.link.me
            return max((self._newest.get((group, m), -1) for m in members if m != me), default=-1)

    def void(self, group: str, members: Sequence[str], round_ids: range) -> int:
        """This member will never run these rounds: the frames waiting for them are dropped
        and later ones are late (counted "late"). Returns how many were waiting."""
        if not round_ids:
            return 0
        with self._lock:
            g = self._group(group, tuple(members))
            g.launched = max(g.launched, max(round_ids))
            for round_id in [x for x in g.refused if x in round_ids]:
                del g.refused[round_id]

            def voided(tag: str) -> bool:
                fid = FrameId.parse(tag)
                return fid is not None and fid.group == group and fid.round_id in round_ids

            others = [m for m in members if m != self.link.me]
            return sum(self.mailbox.drop_tags(m, voided, "late") for m in others)

    def lingering_sends(self) -> int:
        """Sends of ended rounds not finished yet (at most LINGER_ROUNDS rounds' worth)."""
        return sum(not s.done() for sends in list(self._lingering) for s in sends)

    def health(self) -> dict[str, int]:
        with self._lock:
            return {"rounds_open": sum(len(g.open) for g in self._groups.values())}

    def close(self) -> None:
        """Rounds still open end now (FAILED "transport closed" unless every payload is here);
        the round thread ends; a round started later fails at once."""
        with self._lock:
            self._closed = True
            left = [r for g in self._groups.values() for r in g.open.values()]
            if self._fixed:
                self._groups = {}  # start after close: "not in a group"
        with self._wake_cond:
            self._wake_cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        for r in left:
            self._end(r)

    # ---------------------------------------------------------------- internals

    def _group(self, group: str, members: tuple[str, ...]) -> _Group:
        """Under _lock: the group's state (a fixed group must exist with these members)."""
        g = self._groups.get(group)
        if self._fixed:
            if g is None:
                me = self.link.me
                raise ValueError(f"{me!r} is not in a group {group!r} (closed: {self._closed})")
            if members != g.members:
                raise ValueError(
                    f"group {group!r} members are {list(g.members or ())}, got {list(members)}"
                )
        elif g is None:
            g = self._groups[group] = _Group(members)
        return g

    def _own_frame(self, r: MeanRound) -> bytes:
        """Our frame (b"" when we have no payload) and our payload, read back from it."""
        me, mine = self.link.me, r.mine
        if mine.enc is None:
            r.gone[me] = mine.why or "no own payload"
            return b""
        try:
            frame = wire.pack(r.frame(me).name, Kind.AVERAGE, mine.enc, r.round_id)
        except (WireError, CodecError) as e:
            r.gone[me] = f"own payload: {e}"
            return b""
        if mine.abstain:  # our weights are stale: we take the others' mean
            r.abstained.add(me)
            return frame
        own = wire.unpack(memoryview(frame), r.expect(me))
        if isinstance(own, Reject):  # unchecked (Contribution.encoded): still sent, and refused
            r.gone[me] = f"own payload rejected: {own.reason}"
        else:
            r.got[me] = own.tensor().reshape(-1)
        return frame

    def _take_early(self, g: _Group, r: MeanRound) -> set[str]:
        """Under _lock, at a round's start: the frames that waited for it, the refusals and
        lost links known already (returned); the frames of rounds skipped here go ("late")."""
        refused = g.refused.pop(r.round_id, {})
        for round_id in [x for x in g.refused if x < r.round_id]:
            del g.refused[round_id]

        def skipped(tag: str) -> bool:
            fid = FrameId.parse(tag)
            return fid is not None and fid.group == r.group and fid.round_id < r.round_id

        lost = set()
        for m in r.members:
            if m == self.link.me:
                continue
            self.mailbox.drop_tags(m, skipped, "late")
            name = r.frame(m).name
            try:
                msg = self.mailbox.take(m, name, 0.0)
            except PeerLost as e:
                r.gone[m] = str(e)
                lost.add(m)
                continue
            if msg is not None:
                self._take(r, m, msg)
                self.mailbox.drop_tags(m, lambda t, name=name: t == name, "duplicate")
            elif m in refused:
                r.gone[m] = REFUSED + refused[m]
        return lost

    def _take(self, r: MeanRound, member: str, msg: Message) -> None:
        if msg.encoded.numel == 0 and wire.expect_reject(msg, r.abstention(member)) is None:
            r.abstained.add(member)  # it sits the mean out
            return
        bad = wire.expect_reject(msg, r.expect(member))
        if bad is not None:
            self._reject(bad.reason)
            r.gone[member] = REFUSED + bad.reason
        else:
            r.got[member] = msg.tensor().reshape(-1)

    def _clock(self, group: str, sender: str, round_id: int) -> None:
        key = (group, sender)
        if key in self._newest or len(self._newest) < NEWEST_KEYS:
            self._newest[key] = max(self._newest.get(key, -1), round_id)

    def _reject(self, reason: str) -> bool:
        self.link.stats.add_reject(reason)
        return False

    def _lost(self, member: str, why: str) -> None:
        """The mailbox marked member's link lost: the open rounds stop waiting for it."""
        with self._lock:
            for g in self._groups.values():
                for r in g.open.values():
                    if member in r.members and member not in r.got and member not in r.gone:
                        r.gone[member] = why
                        self._look(r)

    def _look(self, r: MeanRound) -> None:
        """Have the round thread look at r (something it waits for happened)."""
        with self._wake_cond:
            self._ready[r] = None
            self._wake_cond.notify()

    def _loop(self) -> None:
        """Look at the rounds something happened to and those past their deadline, each time
        the thread is woken, until close. One Condition over a deadline heap rather than
        `sched`: its run() sleeps to the next event without waking for one pushed earlier from
        another thread, and rounds are also woken by arrivals, not only by time."""
        while True:
            with self._wake_cond:
                while True:
                    now = time.monotonic()
                    ready, self._ready = list(self._ready), {}
                    while self._deadlines and (
                        self._deadlines[0][0] <= now or self._deadlines[0][2].done()
                    ):
                        ready.append(heapq.heappop(self._deadlines)[2])
                    if ready or self._closed:
                        break
                    wait = self._deadlines[0][0] - now if self._deadlines else None
                    self._wake_cond.wait(wait)
                closed = self._closed
            if closed:
                for sends in self._lingering:
                    for s in sends:
                        s.cancel()
                return
            for r in dict.fromkeys(ready):
                if not r.done() and self._over(r):
                    self._end(r)

    def _over(self, r: MeanRound) -> bool:
        """Whether the round ends now: nothing left to wait for, its deadline, or its cut."""
        with self._lock:
            for m, s in r.sends.items():
                if m not in r.got and m not in r.gone and s.done():
                    error = s.error()
                    if error is not None:  # its link is gone: do not wait for its payload
                        r.gone[m] = str(error)
            if time.monotonic() >= r.deadline or r.cut_asked or self._closed:
                return True
            return r.gathered() and r.sent()

    def _end(self, r: MeanRound) -> None:
        """The round's verdict, delivered once; its later frames are late."""
        with self._lock:
            g = self._groups.get(r.group)
            if g is not None and g.open.get(r.round_id) is r:
                del g.open[r.round_id]
            taken = r.taken()
        if self._closed and not r.gathered():
            result = MeanResult(MeanStatus.FAILED, None, (), "transport closed")
        else:
            try:
                result = verdict(
                    r.members, self.link.me, r.got, r.gone, taken, r.mine.shape, r.abstained
                )
            except Exception as e:  # noqa: BLE001 - a round's fault is a value, never a crash
                result = MeanResult(MeanStatus.FAILED, None, (), f"{type(e).__name__}: {e}")
        self._deliver(r, result)
        if threading.current_thread() is self._thread:
            self._linger(r)

    def _deliver(self, r: MeanRound, result: MeanResult) -> None:
        if r.finish(result):
            with self.link.stats.lock:
                self.link.stats.rounds[result.status.value] += 1

    def _linger(self, r: MeanRound) -> None:
        """Keep an ended round's unfinished sends; cancel the oldest past LINGER_ROUNDS."""
        left = [s for s in r.sends.values() if not s.done()]
        kept = [sends for sends in self._lingering if not all(s.done() for s in sends)]
        self._lingering = deque(kept + ([left] if left else []))
        while len(self._lingering) > LINGER_ROUNDS:
            for s in self._lingering.popleft():
                s.cancel()
