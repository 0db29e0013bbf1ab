"""Group mean of a flat payload over hivemind: exact, and bit-identical on every member.

Role: `MeanService` runs `P2PTransport.start_mean` rounds, all of them on one thread (a thread
per round in flight made a peer's thread count follow its rounds: 23-48 through the soak). The
thread sleeps until something a round waits for happens (its payload from a member filed in the
mailbox, that member lost, an ack of ours, a cut, its deadline; or a new round), then advances
those rounds only, without blocking: a fast grid has hundreds of rounds in flight, and looking
at every one on every filed message starved the training thread. The result is
the mean of every contributor's DEQUANTIZED payload, summed in member order
(`mean_in_member_order`), computed by each member from the same verified bytes, so it is
bit-identical on every member and equal to a one-process reference. Each member sends its wire
frame (the codec's FP8/BF16/FP32 bytes) to every other member over the transport's streams and
takes theirs (`wire.unpack` checks sizes, crc32, finiteness, and the name = this round and that
member's slot): an all-gather, so each payload byte crosses n-1 links. A member whose payload
does not arrive by the deadline (or by a cut) is left out: the round is PARTIAL over named
contributors, or FAILED, never silent local values. Our sends of a round that ended may still
be on their way (to a slow member, until the transport's timeout); those of the last
LINGER_ROUNDS ended rounds are left to finish, older ones are cancelled, so what a frozen
member costs stays bounded however many rounds run past it.

imports: torch, hivemind (through the transport), comms only (no mesh, no cli).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import CodecError, PeerLost, PeerTimeout
from comms.p2p.mailbox import Mailbox
from comms.p2p.stream import Ack
from comms.transport import MeanResult, MeanStatus, TransportStats, mean_in_member_order
from comms.wire import Expect, Kind, Message


class Sent(Protocol):
    """A send as the direct path reads it (comms.p2p.transport.SendResult)."""

    def done(self) -> bool: ...

    @property
    def ack(self) -> Ack | None: ...

    def error(self) -> BaseException | None: ...

    def on_done(self, fn: Callable[[], None]) -> None: ...

    def cancel(self) -> None: ...


class MeanHost(Protocol):
    """What a MeanService uses of the transport that owns it (comms.p2p.transport.P2PTransport):
    passed in, never imported, so the transport can import this module and not the other way."""

    me: str
    run_id: str
    stats: TransportStats
    mailbox: Mailbox

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> Sent: ...

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message: ...


def frame_name(group: str, round_id: int, index: int) -> str:
    """Wire name of member `index`'s payload in a round (checked by unpack, so payloads cannot
    land in another round or slot; same length for every member of a group of <= 10)."""
    name = f"mean/{group}/{round_id}/{index}"
    if len(name.encode()) > wire.MAX_NAME_BYTES:
        raise ValueError(f"group name too long for a wire name: {group[:60]!r}...")
    return name


def parse_frame_name(name: str) -> tuple[str, int] | None:
    """(group, round id) of a payload's wire name; None for any other message's."""
    if not name.startswith("mean/"):
        return None
    group, rid, index = (name[5:].rsplit("/", 2) + ["", ""])[:3]
    if not (group and rid.isdigit() and index.isdigit()):
        return None
    return group, int(rid)


def frame_bytes(group: str, round_id: int, index: int, enc: Encoded) -> int:
    """Bytes of one member's payload frame: what stats count per other member, both ways."""
    return len(wire.pack(frame_name(group, round_id, index), Kind.AVERAGE, enc, round_id))


@dataclass(eq=False)
class _Round:
    group: str
    members: tuple[str, ...]
    round_id: int
    enc: Encoded
    shape: tuple[int, ...]
    deadline: float
    fut: cf.Future[MeanResult] = field(default_factory=cf.Future)
    cut: threading.Event = field(default_factory=threading.Event)  # stop waiting for others
    # the round thread's progress: our sends (made on its first visit), the payloads taken,
    # why members were given up on
    sends: dict[str, Sent] | None = None
    got: dict[str, torch.Tensor] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)
    gave_up: set[str] = field(default_factory=set)
    lingered: bool = False  # its unfinished sends were handed to MeanService._linger

    def name(self, member: str) -> str:
        return frame_name(self.group, self.round_id, self.members.index(member))

    def expect(self, member: str) -> Expect:
        return Expect(
            name=self.name(member),
            kind=Kind.AVERAGE,
            shape=(self.enc.numel,),
            codecs=frozenset({self.enc.codec}),
            max_body_bytes=self.enc.nbytes,
        )

    def verdict(self, got: dict[str, torch.Tensor], ran: bool, me: str, why: str) -> MeanResult:
        """OK with every payload; PARTIAL when the round ran (another member took ours) and ours
        is among the verified ones (even if alone: theirs were rejected); FAILED otherwise."""
        who = tuple(m for m in self.members if m in got)
        if me not in got or not ran:
            return MeanResult(MeanStatus.FAILED, None, (), why or "no other member took part")
        parts = tuple(got[m].reshape(-1) for m in who)
        mean = mean_in_member_order(parts).reshape(self.shape)
        if len(who) == len(self.members):
            return MeanResult(MeanStatus.OK, mean, who, parts=parts)
        missing = [m for m in self.members if m not in got]
        why = f"missing {missing}; {why}".strip("; ")
        return MeanResult(MeanStatus.PARTIAL, mean, who, why, parts)


class MeanHandle:
    """comms.transport.MeanHandle of one round."""

    def __init__(
        self,
        fut: cf.Future[MeanResult],
        job: _Round | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self._fut, self._job, self._wake = fut, job, wake

    def cut(self) -> bool:
        """Stop waiting for members that have not contributed yet (direct path): the round
        ends at once over the payloads it has (PARTIAL), as at its deadline."""
        if self._job is None:
            return True  # a round that failed at its start: it has ended already
        self._job.cut.set()
        if self._wake is not None:
            self._wake()
        return True

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout_s: float) -> MeanResult:
        try:
            return self._fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            return MeanResult(MeanStatus.FAILED, None, (), "deadline")


NEWEST_KEYS = 4096  # (group, sender) pairs whose round clock is kept: a column's few, with room
IDLE_WAIT_S = 1.0  # the round thread's longest sleep (it is woken for everything it waits on)
LINGER_ROUNDS = 8  # ended rounds whose sends may still finish (see the module docstring)


class MeanService:
    """Runs the rounds of one P2PTransport on one thread (started with the first round)."""

    def __init__(self, transport: MeanHost) -> None:
        self.t = transport
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._ready: dict[_Round, None] = {}  # rounds to look at (insertion-ordered set)
        self._waits: dict[tuple[str, str], _Round] = {}  # (member, frame name) -> its round
        # (group, sender) -> the highest round id of a payload it filed: the round clock a
        # trailing member catches up with (mesh/algo/round_clock.py)
        self._newest: dict[tuple[str, str], int] = {}
        # the unfinished sends of ended rounds, oldest first (round thread only)
        self._lingering: deque[list[Sent]] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None
        transport.mailbox.on_put(self._filed)

    def start(
        self,
        group: str,
        members: list[str],
        round_id: int,
        values: torch.Tensor,
        codec: str,
        timeout_s: float,
    ) -> MeanHandle:
        """Encode `values` now (the caller keeps training on them) and run the round."""
        try:
            enc = codecs.encode(values.detach().reshape(-1), codec)
        except CodecError as e:
            self._check_members(members)
            fut: cf.Future[MeanResult] = cf.Future()
            self._deliver(fut, MeanResult(MeanStatus.FAILED, None, (), f"own payload: {e}"))
            return MeanHandle(fut)
        return self.start_encoded(group, members, round_id, enc, timeout_s, tuple(values.shape))

    def start_encoded(
        self,
        group: str,
        members: list[str],
        round_id: int,
        enc: Encoded,
        timeout_s: float,
        shape: tuple[int, ...] | None = None,
    ) -> MeanHandle:
        """start() with a ready Encoded (not checked here: a misbehaving peer in tests)."""
        self._check_members(members)
        deadline = time.monotonic() + timeout_s
        job = _Round(group, tuple(members), round_id, enc, shape or (enc.numel,), deadline)
        if len(members) == 1:
            self._finish_alone(job)
            return MeanHandle(job.fut, job)
        with self._lock:
            if self._closed:
                self._deliver(job.fut, MeanResult(MeanStatus.FAILED, None, (), "closed"))
                return MeanHandle(job.fut, job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="mean-rounds")
                self._thread.start()
        self._look(job)
        return MeanHandle(job.fut, job, lambda: self._look(job))

    def close(self) -> None:
        """Stop the round thread; rounds still in flight end FAILED ("closed")."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    # ---------------------------------------------------------------- rounds

    def _check_members(self, members: list[str]) -> None:
        if self.t.me not in members or len(set(members)) != len(members):
            raise ValueError(f"members must be distinct and include {self.t.me!r}: {members}")

    def _finish_alone(self, job: _Round) -> None:
        try:
            mine = {self.t.me: codecs.decode(job.enc)}
            self._deliver(job.fut, job.verdict(mine, True, self.t.me, ""))
        except Exception as e:  # noqa: BLE001 - a round's fault is a value, never a crash
            why = f"{type(e).__name__}: {e}"
            self._deliver(job.fut, MeanResult(MeanStatus.FAILED, None, (), why))

    def _look(self, job: _Round) -> None:
        """Have the round thread look at `job` (something it waits for happened)."""
        with self._lock:
            self._ready[job] = None
        self._wake.set()

    def newest(self, group: str, members: list[str]) -> int:
        """The highest round id of `group` whose payload one of `members` (other than us)
        filed here; -1 when none did."""
        with self._lock:
            return max(
                (self._newest.get((group, m), -1) for m in members if m != self.t.me), default=-1
            )

    def _filed(self, sender: str, tag: str | None) -> None:
        """The mailbox filed `tag` from `sender` (None: marked it lost): wake its round(s)."""
        clock = parse_frame_name(tag) if tag is not None else None
        with self._lock:
            if clock is not None:
                key = (clock[0], sender)
                if key in self._newest or len(self._newest) < NEWEST_KEYS:
                    self._newest[key] = max(self._newest.get(key, -1), clock[1])
            if tag is not None:
                jobs = [self._waits[(sender, tag)]] if (sender, tag) in self._waits else []
            else:
                jobs = [j for (m, _), j in self._waits.items() if m == sender]
            for job in jobs:
                self._ready[job] = None
        if jobs:
            self._wake.set()

    def _deliver(self, fut: cf.Future[MeanResult], res: MeanResult) -> None:
        if not fut.done():
            with self.t.stats.lock:
                self.t.stats.rounds[str(res.status)] += 1
            fut.set_result(res)

    def _loop(self) -> None:
        """Advance the rounds something happened to (and those past their deadline) each time
        the thread is woken. The event is cleared before the ready set is taken, so what
        happens while rounds are looked at is never slept through."""
        active: dict[_Round, None] = {}
        while True:
            wait_s = IDLE_WAIT_S
            if active:
                wait_s = min(wait_s, max(0.0, min(j.deadline for j in active) - time.monotonic()))
            self._wake.wait(wait_s)
            self._wake.clear()
            with self._lock:
                ready, self._ready = self._ready, {}
                closed = self._closed
            if closed:
                for job in [*active, *ready]:
                    self._deliver(job.fut, MeanResult(MeanStatus.FAILED, None, (), "closed"))
                for sends in self._lingering:
                    for h in sends:
                        h.cancel()
                return
            now = time.monotonic()
            ready.update((j, None) for j in active if j.deadline <= now)
            for job in ready:
                try:
                    over = self._advance(job)
                except Exception as e:  # noqa: BLE001 - a round's fault is a value, never a crash
                    why = f"{type(e).__name__}: {e}"
                    self._deliver(job.fut, MeanResult(MeanStatus.FAILED, None, (), why))
                    over = True
                if over:
                    active.pop(job, None)
                    self._forget(job)
                    self._linger(job)
                else:
                    active[job] = None

    def lingering_sends(self) -> int:
        """Sends of ended rounds not finished yet (at most LINGER_ROUNDS rounds' worth)."""
        return sum(not h.done() for sends in list(self._lingering) for h in sends)

    def _linger(self, job: _Round) -> None:
        """Keep an ended round's unfinished sends; cancel the oldest past LINGER_ROUNDS."""
        if job.lingered or not job.sends:
            return
        job.lingered = True
        left = [h for h in job.sends.values() if not h.done()]
        kept = [sends for sends in self._lingering if not all(h.done() for h in sends)]
        self._lingering = deque(kept + ([left] if left else []))
        while len(self._lingering) > LINGER_ROUNDS:
            for h in self._lingering.popleft():
                h.cancel()

    def _forget(self, job: _Round) -> None:
        with self._lock:
            for m in job.members:
                if self._waits.get((m, job.name(m))) is job:
                    del self._waits[(m, job.name(m))]

    def _advance(self, job: _Round) -> bool:
        """One non-blocking look at a round (an all-gather over the transport's streams: send
        ours to everyone, take theirs); whether it is over (its result delivered)."""
        if job.fut.done():  # a late ack or payload of a round already over
            return True
        me = self.t.me
        others = [m for m in job.members if m != me]
        if job.sends is None:  # first visit: wait on their payloads, send ours, decode ours
            with self._lock:  # before the first look at the mailbox: nothing filed is missed
                self._waits.update({(m, job.name(m)): job for m in others})
            job.sends = {}
            for m in others:
                job.sends[m] = self.t.send(m, job.name(me), Kind.AVERAGE, job.enc, job.round_id)
                job.sends[m].on_done(lambda: self._look(job))
            try:
                job.got[me] = codecs.decode(job.enc)
            except CodecError as e:
                job.why.append(f"own payload: {e}")
        for m in others:
            if m in job.got or m in job.gave_up:
                continue
            try:
                job.got[m] = self.t.recv(m, job.name(m), job.expect(m), 0.0).tensor()
            except (PeerTimeout, PeerLost) as e:
                lost = e if isinstance(e, PeerLost) else job.sends[m].error()
                if lost is not None:
                    job.why.append(f"{m}: {lost}")
                    job.gave_up.add(m)  # its link is gone: do not wait for its payload
        gathered = all(m in job.got or m in job.gave_up for m in others)
        acked = all(h.done() for h in job.sends.values())
        over = time.monotonic() >= job.deadline or job.cut.is_set()
        if not over and not (gathered and acked):
            return False
        for m in others:
            if m not in job.got:  # its payload, if it comes now, is stale: dropped and counted
                self.t.mailbox.close_tag(m, job.name(m))
        # the round ran only if another member took our payload (filed it: not DROPPED as
        # late). Theirs alone is not enough: a peer frozen through the round finds the others'
        # payloads buffered by its p2pd when it resumes, after they ended the round without it
        took = any(h.ack == Ack.OK for h in job.sends.values())
        self._deliver(job.fut, job.verdict(job.got, took, me, "; ".join(job.why)))
        return True
