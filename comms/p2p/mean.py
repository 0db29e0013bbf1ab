"""Group mean of a flat payload over hivemind: exact, and bit-identical on every member.

Role: `MeanService` runs `P2PTransport.start_mean` rounds in background threads. The result is
the mean of every contributor's DEQUANTIZED payload, summed in member order
(`mean_in_member_order`), computed by each member from the same verified bytes, so it is
bit-identical on every member and equal to a one-process reference. Each member sends its wire
frame (the codec's FP8/BF16/FP32 bytes) to every other member over the transport's streams and
takes theirs (`wire.unpack` checks sizes, crc32, finiteness, and the name = this round and that
member's slot): an all-gather, so each payload byte crosses n-1 links. A member whose payload
does not arrive by the deadline (or by a cut) is left out: the round is PARTIAL over named
contributors, or FAILED, never silent local values. (hivemind's DecentralizedAverager was a
second path until issue 16: flaky under load, "could not find a group", and unused by the
runtime.)

imports: torch, hivemind (through the transport), comms only (no mesh, no cli).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import CodecError, PeerLost, PeerTimeout
from comms.p2p.mailbox import Mailbox
from comms.p2p.stream import Ack
from comms.transport import MeanResult, MeanStatus, TransportStats
from comms.wire import Expect, Kind, Message


class Sent(Protocol):
    """A send as the direct path reads it (comms.p2p.transport.SendResult)."""

    def done(self) -> bool: ...

    @property
    def ack(self) -> Ack | None: ...

    def error(self) -> BaseException | None: ...


class MeanHost(Protocol):
    """What a MeanService uses of the transport that owns it (comms.p2p.transport.P2PTransport):
    passed in, never imported, so the transport can import this module and not the other way."""

    me: str
    run_id: str
    stats: TransportStats
    mailbox: Mailbox

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> Sent: ...

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message: ...


def mean_in_member_order(payloads: list[torch.Tensor]) -> torch.Tensor:
    """sum in the given order, then / count: the one formula every member and reference uses."""
    acc = payloads[0].to(torch.float32).clone()
    for p in payloads[1:]:
        acc += p
    return acc.div_(len(payloads))


def frame_name(group: str, round_id: int, index: int) -> str:
    """Wire name of member `index`'s payload in a round (checked by unpack, so payloads cannot
    land in another round or slot; same length for every member of a group of <= 10)."""
    name = f"mean/{group}/{round_id}/{index}"
    if len(name.encode()) > wire.MAX_NAME_BYTES:
        raise ValueError(f"group name too long for a wire name: {group[:60]!r}...")
    return name


def frame_bytes(group: str, round_id: int, index: int, enc: Encoded) -> int:
    """Bytes of one member's payload frame: what stats count per other member, both ways."""
    return len(wire.pack(frame_name(group, round_id, index), Kind.AVERAGE, enc, round_id))


@dataclass(frozen=True, eq=False)
class _Round:
    group: str
    members: tuple[str, ...]
    round_id: int
    enc: Encoded
    shape: tuple[int, ...]
    deadline: float
    cut: threading.Event = field(default_factory=threading.Event)  # stop waiting for others

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
        mean = mean_in_member_order(list(parts)).reshape(self.shape)
        if len(who) == len(self.members):
            return MeanResult(MeanStatus.OK, mean, who, parts=parts)
        missing = [m for m in self.members if m not in got]
        why = f"missing {missing}; {why}".strip("; ")
        return MeanResult(MeanStatus.PARTIAL, mean, who, why, parts)


class MeanHandle:
    """comms.transport.MeanHandle of one round."""

    def __init__(self, fut: cf.Future[MeanResult], job: _Round | None = None) -> None:
        self._fut, self._job = fut, job

    def cut(self) -> None:
        """Stop waiting for members that have not contributed yet (direct path): the round
        ends at once over the payloads it has (PARTIAL), as at its deadline."""
        if self._job is not None:
            self._job.cut.set()

    def done(self) -> bool:
        return self._fut.done()

    def result(self, timeout_s: float) -> MeanResult:
        try:
            return self._fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            return MeanResult(MeanStatus.FAILED, None, (), "deadline")


class MeanService:
    """Runs rounds for one P2PTransport, each in its own thread."""

    def __init__(self, transport: MeanHost) -> None:
        self.t = transport

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
        fut: cf.Future[MeanResult] = cf.Future()
        deadline = time.monotonic() + timeout_s
        job = _Round(group, tuple(members), round_id, enc, shape or (enc.numel,), deadline)
        name = f"mean-{group}-{round_id}"
        threading.Thread(target=self._run, args=(job, fut), daemon=True, name=name).start()
        return MeanHandle(fut, job)

    def close(self) -> None:
        """Nothing to stop: a round's thread ends at its deadline."""

    # ---------------------------------------------------------------- rounds

    def _check_members(self, members: list[str]) -> None:
        if self.t.me not in members or len(set(members)) != len(members):
            raise ValueError(f"members must be distinct and include {self.t.me!r}: {members}")

    def _run(self, job: _Round, fut: cf.Future[MeanResult]) -> None:
        try:
            if len(job.members) == 1:
                mine = {self.t.me: codecs.decode(job.enc)}
                self._deliver(fut, job.verdict(mine, True, self.t.me, ""))
            else:
                self._direct(job, lambda res: self._deliver(fut, res))
        except Exception as e:  # noqa: BLE001 - a round's fault is a value, never a crash
            self._deliver(fut, MeanResult(MeanStatus.FAILED, None, (), f"{type(e).__name__}: {e}"))

    def _deliver(self, fut: cf.Future[MeanResult], res: MeanResult) -> None:
        if not fut.done():
            with self.t.stats.lock:
                self.t.stats.rounds[str(res.status)] += 1
            fut.set_result(res)

    def _direct(self, job: _Round, deliver: Callable[[MeanResult], None]) -> None:
        """All-gather over the transport's streams: send ours to everyone, take theirs."""
        me, why = self.t.me, []
        others = [m for m in job.members if m != me]
        sends = {
            m: self.t.send(m, job.name(me), Kind.AVERAGE, job.enc, job.round_id) for m in others
        }
        got: dict[str, torch.Tensor] = {}
        try:
            got[me] = codecs.decode(job.enc)
        except CodecError as e:
            why.append(f"own payload: {e}")
        for m in others:
            while time.monotonic() < job.deadline and not job.cut.is_set():
                try:
                    left = min(0.2, job.deadline - time.monotonic())
                    got[m] = self.t.recv(m, job.name(m), job.expect(m), left).tensor()
                    break
                except (PeerTimeout, PeerLost) as e:
                    lost = e if isinstance(e, PeerLost) else sends[m].error()
                    if lost is not None:
                        why.append(f"{m}: {lost}")
                        break  # its link is gone: do not wait for its payload
        for h in sends.values():  # their acks: whether ours was taken (and the byte counts)
            while not h.done() and time.monotonic() < job.deadline and not job.cut.is_set():
                time.sleep(0.005)
        for m in others:
            if m not in got:  # its payload, if it comes now, is stale: dropped and counted
                self.t.mailbox.close_tag(m, job.name(m))
        # the round ran only if another member took our payload (filed it: not DROPPED as
        # late). Theirs alone is not enough: a peer frozen through the round finds the others'
        # payloads buffered by its p2pd when it resumes, after they ended the round without it
        took = any(h.ack == Ack.OK for h in sends.values())
        deliver(job.verdict(got, took, me, "; ".join(why)))
