"""Group mean of a flat payload over hivemind: exact, and bit-identical on every member.

Role: `MeanService` runs `P2PTransport.start_mean` rounds in background threads. The result is
the mean of every contributor's DEQUANTIZED payload, summed in member order
(`mean_in_member_order`), computed by each member from the same verified bytes, so it is
bit-identical on every member and equal to a one-process reference. Two paths:

"averager" (default): hivemind's DecentralizedAverager. Its all-reduce cannot be bit-identical
by itself: a reducer sums its part in arrival order and sends `avg - part` back through the
codec, so each sender ends with its own `part + Q(avg - part)` while the reducer keeps an
unquantized copy. So the averager all-gathers instead (comms/p2p/carrier.py):
  1. each member packs its payload as a wire frame (`wire.pack` of the codec's `Encoded`: the
     FP8/BF16/FP32 bytes are what crosses) into its own slot of an n-slot carrier tensor;
  2. one averager round with power-of-two weights and a lossless carrier codec leaves every
     slot's carriers exact on every member;
  3. each member turns every slot back into bytes and runs `wire.unpack` (sizes, crc32,
     finiteness, name = this round and that slot): a slot that lost a part (dead peer, failed
     decode, wrong denominator after a ban) fails, and its member is left out.
  Partial rounds: the averager's section 2.6 hook records failed parts and banned senders (the
  reason string); the per-slot check decides the contributors: PARTIAL (named) or FAILED, never
  silent local values. A round is matched among exactly `members` (target and minimum group
  size n) in a DHT bucket derived from the round id. Cost: each payload byte crosses about n-1
  links, as in any all-gather.
"direct": each member sends its frame to every other member over the transport's streams: no
averager process, no matchmaking, same bytes, same mean. Used too when the transport shapes its
links (comms/throttle.py paces our streams; hivemind's own traffic cannot be paced from here).

imports: torch, hivemind, comms only (no mesh, no cli).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import re
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind.utils.timed_storage import get_dht_time

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import CodecError, PeerLost, PeerTimeout
from comms.p2p.carrier import (
    CARRIER,
    CheckedAverager,
    carriers_to_frame,
    frame_to_carriers,
    member_weights,
    slot_carriers,
)
from comms.p2p.mailbox import Mailbox
from comms.p2p.stream import Ack
from comms.transport import MeanResult, MeanStatus, TransportStats
from comms.wire import Expect, Kind, Message, Reject


class Sent(Protocol):
    """A send as the direct path reads it (comms.p2p.transport.SendResult)."""

    @property
    def ack(self) -> Ack | None: ...

    def error(self) -> BaseException | None: ...


class MeanHost(Protocol):
    """What a MeanService uses of the transport that owns it (comms.p2p.transport.P2PTransport):
    passed in, never imported, so the transport can import this module and not the other way."""

    me: str
    run_id: str
    mean_path: str
    shaped: bool
    client_mode: bool
    stats: TransportStats
    mailbox: Mailbox
    dht: Any  # hivemind.DHT: the averagers join it

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
        """OK with every payload; PARTIAL when the round ran with others and ours is among the
        verified ones (even if alone: theirs were rejected); FAILED otherwise."""
        who = tuple(m for m in self.members if m in got)
        if me not in got or not ran:
            return MeanResult(MeanStatus.FAILED, None, (), why or "no other member took part")
        mean = mean_in_member_order([got[m] for m in who]).reshape(self.shape)
        if len(who) == len(self.members):
            return MeanResult(MeanStatus.OK, mean, who)
        missing = [m for m in self.members if m not in got]
        return MeanResult(MeanStatus.PARTIAL, mean, who, f"missing {missing}; {why}".strip("; "))


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
    """Runs rounds for one P2PTransport; rounds of one group run one after another (an
    averager's tensor holds one round at a time)."""

    def __init__(
        self, transport: MeanHost, *, max_averagers: int = 4, chunk_timeout_s: float = 5.0
    ) -> None:
        self.t, self.max_averagers, self.chunk_timeout_s = transport, max_averagers, chunk_timeout_s
        self._averagers: OrderedDict[tuple[Any, ...], CheckedAverager] = OrderedDict()
        self._group_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._lock = threading.Lock()

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
        direct = self.t.mean_path == "direct" or self.t.shaped  # shaping paces our streams only
        target = self._direct if direct else self._via_averager
        name = f"mean-{group}-{round_id}"
        threading.Thread(target=self._run, args=(target, job, fut), daemon=True, name=name).start()
        return MeanHandle(fut, job)

    def close(self) -> None:
        with self._lock:
            averagers, self._averagers = list(self._averagers.values()), OrderedDict()
        for av in averagers:
            _shutdown(av)

    # ---------------------------------------------------------------- rounds

    def _check_members(self, members: list[str]) -> None:
        if self.t.me not in members or len(set(members)) != len(members):
            raise ValueError(f"members must be distinct and include {self.t.me!r}: {members}")

    def _run(self, target: Callable[..., None], job: _Round, fut: cf.Future[MeanResult]) -> None:
        try:
            if len(job.members) == 1:
                mine = {self.t.me: codecs.decode(job.enc)}
                self._deliver(fut, job.verdict(mine, True, self.t.me, ""))
            else:
                target(job, lambda res: self._deliver(fut, res))
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
        for m in others:
            if m not in got:  # its payload, if it comes now, is stale: dropped and counted
                self.t.mailbox.close_tag(m, job.name(m))
        # the round ran if another member took our payload or sent us theirs
        took = any(h.ack == Ack.OK for h in sends.values())
        deliver(job.verdict(got, took or len(got) > 1, me, "; ".join(why)))

    def _via_averager(self, job: _Round, deliver: Callable[[MeanResult], None]) -> None:
        """All-gather through a DecentralizedAverager round (see the module docstring)."""
        me, n = self.t.me, len(job.members)
        i, cap = job.members.index(me), slot_carriers(job.enc.numel, job.enc.codec)
        frame = wire.pack(job.name(me), Kind.AVERAGE, job.enc, job.round_id)
        weights = member_weights(n)
        own = frame_to_carriers(frame, cap) * float(sum(weights) // weights[i])
        with self._group_locks[job.group]:
            av = self._averager(job, cap)
            with av.get_tensors() as (buf,):
                buf.zero_()
                buf[i * cap : (i + 1) * cap] = own
            av.status.zero_()
            av.set_group_bits(_round_bits(job.round_id), wait=False).result(timeout=10.0)
            left = job.deadline - time.monotonic()
            if left < 0.5:  # spent waiting for this group's previous round
                deliver(MeanResult(MeanStatus.FAILED, None, (), "deadline (previous round)"))
                return
            ctl = av.step(
                gather=[me, job.round_id],
                weight=float(weights[i]),
                wait=False,
                scheduled_time=get_dht_time() + min(1.0, left / 4),
                timeout=0.75 * left,  # matchmaking; the rest of the budget is the all-reduce's
                allow_retries=False,  # a retry would re-average a half-updated tensor
            )
            why = ""
            try:
                ctl.result(timeout=max(0.0, job.deadline - time.monotonic()))
            except TimeoutError:
                deliver(MeanResult(MeanStatus.FAILED, None, (), "deadline"))
                ctl.cancel()
                self._settle(av, ctl)
                return
            except BaseException as e:  # noqa: BLE001 - hivemind failures become a reason
                why = f"{type(e).__name__}: {e}"[:300]
            with av.get_tensors() as (buf,):
                out = buf.clone()
            status = av.status.tolist()
        ran = status[av.ATTEMPTS] > 0
        if status[av.FAILED_VALUES] or status[av.BANNED]:
            why = (
                f"partial all-reduce: {status[av.FAILED_VALUES]} values failed, "
                f"{status[av.BANNED]} senders banned; {why}"
            )
        got: dict[str, torch.Tensor] = {}
        for j, m in enumerate(job.members):
            data = frame if m == me else carriers_to_frame(out[j * cap : (j + 1) * cap])
            res = wire.unpack(data, job.expect(m)) if data is not None else Reject("missing")
            if isinstance(res, Message):
                got[m] = res.tensor()
                if m != me:
                    self.t.stats.add_received(m, Kind.AVERAGE, len(data))
            elif m == me:
                why = f"own payload: {res.reason} {res.detail}; {why}"
            elif data is not None and ran:
                self.t.stats.add_reject(res.reason)
        if ran:  # "average" bytes = payload frames exchanged, as on every backend; the
            # carrier bytes our codec gave hivemind are counted apart
            for m in job.members:
                if m != me:
                    self.t.stats.add_sent(m, Kind.AVERAGE, len(frame))
            self.t.stats.add_sent(f"group:{job.group}", "average_hivemind", status[av.SENT])
            self.t.stats.add_received(f"group:{job.group}", "average_hivemind", status[av.RECEIVED])
        deliver(job.verdict(got, ran, me, why))

    def _averager(self, job: _Round, cap: int) -> CheckedAverager:
        key = (job.group, job.members, cap)
        with self._lock:
            if key in self._averagers:
                if self._averagers[key].is_alive():
                    self._averagers.move_to_end(key)
                    return self._averagers[key]
                del self._averagers[key]  # died (killed?): calls into it would block forever
        n, budget = len(job.members), max(1.0, job.deadline - time.monotonic())
        av = CheckedAverager(
            [torch.zeros(n * cap)],
            self.t.dht,
            start=False,
            prefix=_prefix(self.t.run_id, key),
            target_group_size=n,
            min_group_size=n,  # a round is between exactly these members (slots by member)
            initial_group_bits=_round_bits(job.round_id),
            min_matchmaking_time=1.0,
            request_timeout=0.5,
            allreduce_timeout=max(1.0, 0.8 * budget),  # hivemind gives up before our deadline
            # a peer silent this long is dropped from the round: short against the round's
            # budget (a dead peer's p2pd may hold streams open for a moment), but not so short
            # that a busy host's slow peer is banned
            next_chunk_timeout=min(self.chunk_timeout_s, max(1.0, budget / 4)),
            compression=CARRIER,
            part_size_bytes=1 << 20,
            allow_state_sharing=False,
            client_mode=self.t.client_mode,
        )
        av.start_quietly(budget)
        with self._lock:
            self._averagers[key] = av
            while len(self._averagers) > self.max_averagers:
                _shutdown(self._averagers.popitem(last=False)[1])
        return av

    def _settle(self, av: CheckedAverager, ctl: Any) -> None:
        """After a deadline: wait for the averager to let go of its tensor, or replace it."""
        try:
            ctl.result(timeout=av._allreduce_timeout + 5.0)
        except TimeoutError:
            with self._lock:
                for k, v in list(self._averagers.items()):
                    if v is av:
                        del self._averagers[k]
            _shutdown(av)
        except BaseException:  # noqa: BLE001 - a cancelled or failed step is settled too
            pass


def _round_bits(round_id: int) -> str:
    """Matchmaking bucket of a round: members of one round never group with another round."""
    return format(round_id % (1 << 16), "016b")


def _prefix(run_id: str, key: tuple[Any, ...]) -> str:
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"mt_{run_id[:24]}_{key[0][:24]}_{digest}")


def _shutdown(av: CheckedAverager) -> None:
    try:
        av.shutdown()
    except Exception:  # noqa: BLE001 - already gone
        pass
    av.join(5.0)
