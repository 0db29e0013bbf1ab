"""One averaging round, whatever link carries it: what it is, what each member puts in, how it ends.

Identity. A round is (group, round_id); a member's frame in it is named by its slot, the
member's index in the group (`FrameId`: the wire name `mean/{group}/{round_id}/{slot}`, checked
by wire.unpack, so a payload cannot land in another round or slot).

Payload. Each member packs its payload once (`Contribution`: the codec's bytes) and sends the
frame to every other member. The result is the mean of every contributor's DEQUANTIZED payload,
its own read back from its own frame, summed in member order (`mean_in_member_order`): with
every member in time it is bit-identical on every member and equal to a one-process reference.

Abstention. A member whose weights are stale (a cell whose last update had no gradient) sits the
mean out: its frame is the round's name over an empty payload, and it takes the others' mean.
An abstainer is neither a contributor nor missing.

Verdict (`verdict`): OK with every payload but abstentions; PARTIAL over named contributors;
FAILED without our own payload (unless we abstained), with no contributor, or when no other
member took part, since one member alone is no mean (`alone`). A
member took part when it took our frame, where the link acknowledges frames (hivemind: a member
frozen through a round finds the others' frames waiting when it resumes, after they ended the
round without it, so theirs arriving proves nothing), and otherwise when its frame reached us,
even refused.

How rounds run over a transport's links: comms/group_means.py.

imports: torch, comms only.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch

from comms import codecs
from comms.codecs import Encoded
from comms.errors import CodecError
from comms.stats import TransportStats
from comms.wire import Expect, Kind

ROUND_PREFIX = "mean/"
MAX_GROUP_BYTES = 200  # a frame name (prefix, group, i64 round id, slot) fits wire.MAX_NAME_BYTES
REFUSED = "rejected: "  # how a refused member's reason starts


class MeanStatus(StrEnum):
    OK = "ok"  # every member contributed; the mean is over all of them
    PARTIAL = "partial"  # some members missing; the mean is over `contributors` only
    FAILED = "failed"  # no usable mean (deadline passed, group broken, or own payload lost)


@dataclass(frozen=True)
class MeanResult:
    status: MeanStatus
    mean: torch.Tensor | None  # float32, same shape as the payload; None when FAILED
    contributors: tuple[str, ...]  # peer names whose dequantized payloads were averaged
    reason: str = ""  # why not OK
    # the contributors' dequantized payloads (flat, in contributor order): what a caller that
    # combines them another way (a robust mean, a deviation bound) starts from
    parts: tuple[torch.Tensor, ...] = ()
    abstained: tuple[str, ...] = ()  # members that sat the mean out (stale weights)


def mean_in_member_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group mean: float32, summed strictly left to right in member order, then divided by
    the count. The one formula of both transports, the simulator and the robust aggregates, so a
    mean has the same bits on every member and in a one-process reference."""
    acc = parts[0].to(torch.float32).clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc.div_(len(parts))


class MeanHandle(Protocol):
    def done(self) -> bool: ...

    def result(self, timeout_s: float) -> MeanResult:
        """The round's outcome; FAILED with reason 'deadline' if not done in time."""

    def cut(self) -> bool:
        """Stop waiting for members that have not contributed: True when the round now ends
        over the payloads it has (PARTIAL, as at its deadline), False when this transport's
        rounds cannot end without every member (a collective: it ends at its deadline)."""


@dataclass(frozen=True)
class FrameId:
    """One member's frame in one round: its typed identity and its wire name."""

    group: str
    round_id: int
    slot: int  # the member's index in the group

    @property
    def name(self) -> str:
        return f"{ROUND_PREFIX}{self.group}/{self.round_id}/{self.slot}"

    @classmethod
    def parse(cls, name: str) -> FrameId | None:
        """The FrameId a wire name spells; None for any other message's name."""
        if not name.startswith(ROUND_PREFIX):
            return None
        group, round_id, slot = (name[len(ROUND_PREFIX) :].rsplit("/", 2) + ["", ""])[:3]
        digits = (round_id, slot)
        if not group or not all(d.isascii() and d.isdigit() for d in digits):
            return None
        return cls(group, int(round_id), int(slot))


def alone(contributors: Sequence[str], me: str) -> bool:
    """No member but `me` among the contributors: what is left is not a mean of a group."""
    return all(c == me for c in contributors)


def verdict(
    members: Sequence[str],
    me: str,
    got: Mapping[str, torch.Tensor],
    gone: Mapping[str, str],
    taken: bool | None,
    shape: tuple[int, ...],
    abstained: Collection[str] = (),
) -> MeanResult:
    """A round's outcome from the payloads it has (`got`, flat), why the others are missing
    (`gone`), who sat it out (`abstained`) and whether another member took our frame (`taken`;
    None: the link cannot tell). See the module docstring."""
    if me not in got and me not in abstained:
        return MeanResult(MeanStatus.FAILED, None, (), gone.get(me, "own payload missing"))
    out = tuple(m for m in members if m in abstained)
    missing = [
        f"{m}: {gone.get(m, 'not here by the deadline')}"
        for m in members
        if m not in got and m not in abstained
    ]
    if taken is False:
        why = "; ".join(["no other member took our payload", *missing])
        return MeanResult(MeanStatus.FAILED, None, (), why)
    who = tuple(m for m in members if m in got)
    if not who:  # every member that answered sat the mean out
        return MeanResult(MeanStatus.FAILED, None, (), "no contributor", abstained=out)
    refused = any(why.startswith(REFUSED) for m, why in gone.items() if m != me)
    if missing and taken is None and alone(who, me) and not refused:
        return MeanResult(MeanStatus.FAILED, None, (), "no other member's payload in time")
    parts = tuple(got[m] for m in who)
    mean = mean_in_member_order(parts).reshape(shape)
    if not missing:
        return MeanResult(MeanStatus.OK, mean, who, parts=parts, abstained=out)
    why = "missing " + "; ".join(missing)
    return MeanResult(MeanStatus.PARTIAL, mean, who, why, parts, out)


@dataclass(frozen=True)
class Contribution:
    """This member's part of a round: its encoded payload, or why it has none, and the size and
    codec every member's payload must have."""

    numel: int
    codec: str
    shape: tuple[int, ...]  # of the mean handed back
    enc: Encoded | None
    why: str = ""  # why enc is None
    abstain: bool = False  # enc is the empty payload of a member that sits the mean out

    @classmethod
    def of(cls, values: torch.Tensor, codec: str, abstain: bool = False) -> Contribution:
        """`values` encoded now (a snapshot: the caller keeps training on them); abstain: an
        empty payload of their codec instead (the member takes the others' mean)."""
        flat = values.detach().reshape(-1)
        shape = tuple(values.shape)
        try:
            enc = codecs.encode(flat[:0] if abstain else flat, codec)
            return cls(flat.numel(), codec, shape, enc, abstain=abstain)
        except CodecError as e:  # e.g. own values not finite: the others go on without ours
            return cls(flat.numel(), codec, shape, None, f"own payload: {e}")

    @classmethod
    def encoded(cls, enc: Encoded) -> Contribution:
        """A payload encoded already, unchecked (what a broken member would send)."""
        return cls(enc.numel, enc.codec, (enc.numel,), enc)

    def body_bytes(self) -> int:
        """A member's payload's bytes in this round (ours, or its size when we have none)."""
        if self.enc is not None and not self.abstain:
            return self.enc.nbytes
        return codecs.encoded_nbytes(self.numel, self.codec)


class Sent(Protocol):
    """A frame on its way to one member (what RoundLink.send_frame returns)."""

    def done(self) -> bool: ...

    def error(self) -> BaseException | None:
        """Why the frame will not arrive, once done; None otherwise."""

    def taken(self) -> bool | None:
        """Whether the member took the frame into a round (None: the link cannot tell)."""

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call fn() once done (at once if it is), on any thread: keep it cheap."""

    def cancel(self) -> None:
        """Give up on the frame (its round is long over)."""


class RoundLink(Protocol):
    """What a round needs of a transport: its name, its counters, and bytes to a member. The
    transport files the frames it receives (`GroupMeans.file`, `.refused`) and marks lost
    links in its mailbox (`Mailbox.mark_lost`)."""

    me: str
    stats: TransportStats

    def send_frame(self, to: str, frame: bytes) -> Sent:
        """Queue one frame for `to`; returns at once."""


class MeanRound:
    """One round (a comms.transport.MeanHandle): what it has, what it waits for, its result."""

    def __init__(
        self,
        group: str,
        round_id: int,
        members: tuple[str, ...],
        deadline: float,
        wake: Callable[[MeanRound], None] | None = None,
    ) -> None:
        self.group, self.round_id, self.members, self.deadline = group, round_id, members, deadline
        self.mine = Contribution(0, "fp32", (0,), None, "not started")
        self.got: dict[str, torch.Tensor] = {}  # member -> its dequantized flat payload
        self.gone: dict[str, str] = {}  # member -> why it will not contribute
        self.abstained: set[str] = set()  # members that sat the mean out
        self.sends: dict[str, Sent] = {}  # our frame to each other member
        self.cut_asked = False
        self._wake = wake
        self._outcome: cf.Future[MeanResult] = cf.Future()

    def done(self) -> bool:
        return self._outcome.done()

    def cut(self) -> bool:
        """End the round now over the payloads that arrived (PARTIAL, as at its deadline)."""
        self.cut_asked = True
        if self._wake is not None:
            self._wake(self)
        return True

    def result(self, timeout_s: float) -> MeanResult:
        try:
            return self._outcome.result(max(0.0, timeout_s))
        except cf.TimeoutError:
            return MeanResult(MeanStatus.FAILED, None, (), "deadline")

    def frame(self, member: str) -> FrameId:
        return FrameId(self.group, self.round_id, self.members.index(member))

    def expect(self, member: str) -> Expect:
        mine = self.mine
        return Expect(
            self.frame(member).name,
            Kind.AVERAGE,
            (mine.numel,),
            frozenset({mine.codec}),
            mine.body_bytes(),
        )

    def abstention(self, member: str) -> Expect:
        """What a member's frame is when it sits the mean out: the round's name, no payload."""
        return Expect(self.frame(member).name, Kind.AVERAGE, (0,), frozenset({self.mine.codec}), 0)

    def gathered(self) -> bool:
        return all(m in self.got or m in self.gone or m in self.abstained for m in self.members)

    def sent(self) -> bool:
        return all(s.done() for s in self.sends.values())

    def taken(self) -> bool | None:
        answers = [s.taken() for s in self.sends.values()]
        return None if not answers or None in answers else any(answers)

    def finish(self, result: MeanResult) -> bool:
        """Deliver the result; False when it was delivered already."""
        try:
            self._outcome.set_result(result)
        except cf.InvalidStateError:
            return False
        return True
