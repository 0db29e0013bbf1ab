"""Group means of TorchTransport (comms/torchdist/transport.py): a polled all-gather per round.

One process group per averaging group, created at init by its members in sorted
group-name order (a total order, so overlapping groups cannot deadlock the rendezvous). A round
all-gathers every member's contribution: one fixed-size frame `wire.pack(f"{group}#{round_id}",
AVERAGE, encoded payload)` (a member whose own values are not finite sends zeros of that size,
which every receiver rejects). Every member then validates all frames with `wire.unpack` and
sums the accepted dequantized payloads in member order, then divides by their count, so the
mean is bit-identical on every member. Rejected frames -> PARTIAL without that member (never
local values in its place); own frame rejected -> FAILED. The all-gather is asynchronous, with a
per-operation gloo timeout equal to the round deadline (gloo's worker is free by then); a
per-group waiter thread polls it (collectives, unlike p2p, can be polled) until the deadline.
A dead peer fails the round in ~ms (connection reset), a frozen one at the deadline. Either way
the group is then marked broken and later rounds fail at once, without a collective (a gloo
group cannot shrink, and a half-finished collective leaves it unusable; re-forming groups is out
of scope: a new transport is). With CUDA the collective runs on NCCL instead (payload bytes moved
to the GPU; a failed round aborts the NCCL group); untested here (no GPU), p2p stays on gloo.

imports: torch, comms only (no mesh, no cli).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from comms import codecs, wire
from comms.codecs import Encoded
from comms.errors import NotFiniteError
from comms.throttle import LinkShapers
from comms.transport import MeanResult, MeanStatus, TransportStats, mean_in_member_order
from comms.wire import Expect, Kind, Reject

FOREVER = timedelta(days=30)  # waits that must not time out: a timed-out gloo op kills the pair
MAX_GROUP_NAME = 200  # f"{group}#{round_id}" must fit wire.MAX_NAME_BYTES


@dataclass(eq=False)
class MeanGroup:
    name: str
    members: tuple[str, ...]
    pg: object  # ProcessGroupGloo / ProcessGroupNCCL
    broken: str = ""
    rounds: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    waiter: threading.Thread | None = None


class MeanRound:
    """One group-mean round: a comms.transport.MeanHandle."""

    def __init__(self, members: tuple[str, ...], deadline: float) -> None:
        self.members, self.deadline = members, deadline
        self.work: object | None = None
        self.outs: list[torch.Tensor] = []
        self.expect = Expect()
        self.shape: tuple[int, ...] = ()
        self.frame_bytes = 0
        self.release = 0.0  # earliest time the shaped links could have delivered the round
        self._event = threading.Event()
        self._result: MeanResult | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def cut(self) -> bool:
        """False: a collective cannot end without its members; the round ends at its deadline."""
        return False

    def result(self, timeout_s: float) -> MeanResult:
        if not self._event.wait(max(0.0, timeout_s)) or self._result is None:
            return MeanResult(MeanStatus.FAILED, None, (), "deadline")
        return self._result

    def _finish(self, result: MeanResult) -> bool:
        if self._event.is_set():
            return False
        self._result = result
        self._event.set()
        return True


class GroupMeans:
    """TorchTransport's start_mean and its rounds (a mixin: needs the attributes below)."""

    me: str
    collective: str
    stats: TransportStats
    _closed: bool
    _lock: threading.Lock
    _groups: dict[str, MeanGroup]
    _shapers: LinkShapers

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
        g = self._group(group, members)
        flat = values.detach().reshape(-1)
        name = f"{group}#{round_id}"
        try:
            frame = wire.pack(name, Kind.AVERAGE, codecs.encode(flat, codec), round_id)
        except NotFiniteError:  # own values not finite: contribute rejectable zeros, stay in step
            frame = bytes(_frame_bytes(name, flat.numel(), codec, round_id))
        return self._start_round(g, name, round_id, frame, flat.numel(), codec, timeout_s, values)

    # ---------------------------------------------------------------- test hook (bad peers)

    def _start_mean_encoded(
        self, group: str, members: list[str], round_id: int, enc: Encoded, timeout_s: float
    ) -> MeanRound:
        """start_mean with a ready Encoded, skipping the sender-side finiteness check."""
        g = self._group(group, members)
        name = f"{group}#{round_id}"
        frame = wire.pack(name, Kind.AVERAGE, enc, round_id)
        return self._start_round(g, name, round_id, frame, enc.numel, enc.codec, timeout_s, None)

    def _group(self, group: str, members: list[str]) -> MeanGroup:
        g = self._groups.get(group)
        if g is None:
            raise ValueError(f"{self.me!r} is not in a group {group!r} (closed: {self._closed})")
        if tuple(members) != g.members:
            raise ValueError(f"group {group!r} members are {list(g.members)}, got {members}")
        return g

    def _start_round(
        self,
        g: MeanGroup,
        name: str,
        round_id: int,
        frame: bytes,
        numel: int,
        codec: str,
        timeout_s: float,
        values: torch.Tensor | None,
    ) -> MeanRound:
        now = time.monotonic()
        r = MeanRound(g.members, now + timeout_s)
        if g.broken:
            return self._finish(
                r, MeanResult(MeanStatus.FAILED, None, (), f"group broken: {g.broken}")
            )
        r.shape = tuple(values.shape) if values is not None else (numel,)
        r.expect = Expect(name, Kind.AVERAGE, (numel,), frozenset({codec}), len(frame))
        r.frame_bytes = len(frame)
        n = len(g.members)
        r.release = now
        right = g.members[(g.members.index(self.me) + 1) % n]
        shaper = self._shapers.for_peer(right) if n > 1 else None
        if shaper is not None:  # a ring all-gather: n-1 frames out over the link to the right
            extra = (n - 2) * shaper.profile.latency_ms / 1e3
            r.release = shaper.schedule((n - 1) * len(frame), now) + extra
        device = torch.device("cuda") if self.collective == "nccl" else torch.device("cpu")
        own = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(device)
        r.outs = [torch.empty(len(frame), dtype=torch.uint8, device=device) for _ in range(n)]
        opts = AllgatherOptions()
        opts.timeout = timedelta(seconds=max(timeout_s, 1e-3))
        try:
            r.work = g.pg.allgather([r.outs], [own], opts)
        except Exception as e:  # noqa: BLE001 - a broken group raises at once
            g.broken = f"{type(e).__name__}: {str(e)[:200]}"
            return self._finish(r, MeanResult(MeanStatus.FAILED, None, (), g.broken))
        with self._lock:
            if g.waiter is None:
                g.waiter = threading.Thread(
                    target=self._wait_loop, args=(g,), name=f"mean-{g.name}", daemon=True
                )
                g.waiter.start()
        g.rounds.put(r)
        return r

    def _wait_loop(self, g: MeanGroup) -> None:
        """Waiter thread of one group: rounds in order, each until done or its deadline. Polls
        (sleeping in Python) instead of a blocking wait, so close() can stop it at once."""
        while True:
            r = g.rounds.get()
            if r is None:
                return
            why = _poll(r.work, r.deadline, lambda: self._closed)
            if not why:
                try:
                    r.work.wait()  # completed: returns at once, or raises the op's error
                except Exception as e:  # noqa: BLE001 - a dead peer resets the group
                    why = f"{type(e).__name__}: {str(e)[:200]}"
            if why:
                if why != "transport closed" and not g.broken:
                    g.broken = why
                    if self.collective == "nccl":
                        with contextlib.suppress(Exception):
                            g.pg.abort()
                self._finish(r, MeanResult(MeanStatus.FAILED, None, (), why))
                continue
            result = self._reduce(g, r)
            wait = r.release - time.monotonic()
            if wait > 0:  # shaped links: the result cannot be here before the model says
                if r.release > r.deadline:
                    time.sleep(max(0.0, r.deadline - time.monotonic()))
                    result = MeanResult(MeanStatus.FAILED, None, (), "deadline (shaped link)")
                else:
                    time.sleep(wait)
            self._finish(r, result)

    def _reduce(self, g: MeanGroup, r: MeanRound) -> MeanResult:
        """Validate every member's frame, sum the accepted ones in member order."""
        parts, contributors, excluded = [], [], []
        for member, out in zip(g.members, r.outs, strict=True):
            got = wire.unpack(memoryview(out.cpu().numpy()), r.expect)
            if isinstance(got, Reject):
                excluded.append(f"{member}: {got.reason}")
                if member != self.me:
                    self.stats.add_reject(got.reason)
                continue
            parts.append(got.tensor().reshape(-1))
            contributors.append(member)
        for member in g.members:
            if member != self.me:
                self.stats.add_sent(member, "average", r.frame_bytes)
                self.stats.add_received(member, "average", r.frame_bytes)
        if self.me not in contributors:
            return MeanResult(MeanStatus.FAILED, None, (), f"own payload rejected ({excluded})")
        mean = mean_in_member_order(parts).reshape(r.shape)
        if excluded:
            why = "excluded " + ", ".join(excluded)
            return MeanResult(MeanStatus.PARTIAL, mean, tuple(contributors), why, tuple(parts))
        return MeanResult(MeanStatus.OK, mean, tuple(contributors), parts=tuple(parts))

    def _finish(self, r: MeanRound, result: MeanResult) -> MeanRound:
        if r._finish(result):
            with self.stats.lock:
                self.stats.rounds[result.status.value] += 1
        return r


def _frame_bytes(name: str, numel: int, codec: str, step: int) -> int:
    """Length of wire.pack(name, AVERAGE, encode(<numel values>, codec), step), without
    encoding numel values: the header does not depend on numel (always one dim)."""
    one = wire.pack(name, Kind.AVERAGE, codecs.encode(torch.zeros(1), codec), step)
    return len(one) - codecs.encoded_nbytes(1, codec) + codecs.encoded_nbytes(numel, codec)


def gloo_group(store: dist.Store, rank: int, size: int, host: str, timeout: timedelta = FOREVER):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)


def group_pg(collective: str, store: dist.Store, rank: int, size: int, host: str):
    if collective == "nccl":  # untested here: no multi-GPU machine in CI
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = FOREVER  # every op passes its own deadline
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return gloo_group(store, rank, size, host)


def _poll(work, deadline: float, closed) -> str:
    """ "" once work completed, else "deadline" or "transport closed"; sleeps 50 us..2 ms."""
    nap = 5e-5
    while not work.is_completed():
        if closed():
            return "transport closed"
        if time.monotonic() >= deadline:
            return "deadline"
        time.sleep(nap)
        nap = min(2 * nap, 2e-3)
    return ""
