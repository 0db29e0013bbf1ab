"""The Transport protocol: named tensors between named peers, background group means, counters.

Two real implementations (comms/torchdist/transport.py over gloo/NCCL, comms/p2p/transport.py over
hivemind's libp2p) pass the same test suite. Peers are named by strings (the grid calls them
"s1r0"); each backend maps names to addresses its own way (ranks, or hivemind PeerIDs found through
the DHT).

Point-to-point messages are matched by (sender, tag): the receiver keeps a bounded mailbox per
sender, `recv` takes the message with that tag or waits until a deadline. Every received message
goes through `comms.wire.unpack` with an `Expect` before anything is allocated or used; rejects
are counted and dropped, never raised into the training loop.

Faults are values: a group mean returns a `MeanResult` whose status says ok, partial (some
members' payloads missing or rejected: the mean is over the contributors named) or failed. A
partial result is never silently presented as a full mean.

imports: torch, comms only.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import torch

from comms.codecs import Encoded
from comms.wire import Expect, Kind, Message


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


def mean_in_member_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The group mean: float32, summed strictly left to right in member order, then divided by
    the count. The one formula of both transports, the simulator and the robust aggregates, so a
    mean has the same bits on every member and in a one-process reference."""
    acc = parts[0].to(torch.float32).clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc.div_(len(parts))


class SendHandle(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> None:
        """Block until the bytes left (or raise PeerTimeout / PeerLost)."""


class MeanHandle(Protocol):
    def done(self) -> bool: ...

    def result(self, timeout_s: float) -> MeanResult:
        """The round's outcome; FAILED with reason 'deadline' if not done in time."""

    def cut(self) -> bool:
        """Stop waiting for members that have not contributed: True when the round now ends
        over the payloads it has (PARTIAL, as at its deadline), False when this transport's
        rounds cannot end without every member (a collective: it ends at its deadline)."""


@dataclass
class TransportStats:
    """Byte and message counters, per peer and message kind; thread-safe via `lock`."""

    bytes_sent: Counter[tuple[str, str]] = field(default_factory=Counter)  # (peer, kind)
    bytes_received: Counter[tuple[str, str]] = field(default_factory=Counter)
    messages_sent: Counter[tuple[str, str]] = field(default_factory=Counter)
    rejects: Counter[str] = field(default_factory=Counter)  # by reason
    rounds: Counter[str] = field(default_factory=Counter)  # by MeanStatus
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_sent(self, peer: str, kind: Kind | str, nbytes: int) -> None:
        k = kind.name.lower() if isinstance(kind, Kind) else kind
        with self.lock:
            self.bytes_sent[(peer, k)] += nbytes
            self.messages_sent[(peer, k)] += 1

    def add_received(self, peer: str, kind: Kind | str, nbytes: int) -> None:
        k = kind.name.lower() if isinstance(kind, Kind) else kind
        with self.lock:
            self.bytes_received[(peer, k)] += nbytes

    def add_reject(self, reason: str) -> None:
        with self.lock:
            self.rejects[reason] += 1

    def sent_by_kind(self) -> dict[str, int]:
        with self.lock:
            out: Counter[str] = Counter()
            for (_, kind), n in self.bytes_sent.items():
                out[kind] += n
            return dict(out)


@runtime_checkable
class Transport(Protocol):
    backend: str  # "torch" or "hivemind"
    me: str  # this peer's name
    stats: TransportStats

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> SendHandle:
        """Queue `enc` for peer `to` under `tag`; returns at once (shaping happens behind)."""

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """The message from `frm` with `tag`, validated against `expect`; PeerTimeout after
        timeout_s. Messages that fail validation are counted in stats.rejects and dropped."""

    def recv_prefix(self, frm: str, prefix: str, expect: Expect, timeout_s: float) -> Message:
        """The oldest message from `frm` whose tag starts with `prefix`, validated against
        `expect` (its tag is the message's name); PeerTimeout after timeout_s (0: only what
        waits now), PeerLost when `frm` is cut off and nothing matching waits. For a receiver
        that cannot know a tag before it arrives: a stage pool's cell takes whichever
        microbatch a neighbour routed to it."""

    def start_mean(
        self,
        group: str,
        members: list[str],
        round_id: int,
        values: torch.Tensor,
        codec: str,
        timeout_s: float,
    ) -> MeanHandle:
        """Start the mean of a flat float32 payload over `members` (self included) without
        blocking. Every member must call it with the same group, members and round_id. The
        result is the mean of all contributors' DEQUANTIZED payloads, own included, summed in
        member order, so it is bit-identical on every member."""

    def newest_round(self, group: str, members: Sequence[str]) -> int:
        """The highest round id of `group` that another of `members` launched and whose
        payload reached this peer (-1: none): the round clock a trailing replica keeps up
        with (mesh/algo/round_clock.py)."""

    def drop_tags(self, prefix: str) -> int:
        """Nobody will take a message whose tag starts with `prefix` (a broken pipeline
        session's): drop those waiting and those that arrive later, counted in stats.rejects as
        "stale". Returns how many were waiting."""

    def void_rounds(self, group: str, members: Sequence[str], round_ids: range) -> int:
        """This peer will never run these averaging rounds of `group` (its state was replaced
        by a download that skipped them): the other members' payloads for them are dropped,
        those waiting now and those that arrive later, counted in stats.rejects as "late".
        Returns how many were waiting."""

    def health(self) -> dict[str, Any]:
        """What a leak would show in, as numbers a metrics row can hold (messages waiting in
        mailboxes, live tasks, DHT calls): the `health` rows of a cell's metrics."""

    def close(self) -> None:
        """Stop threads and daemons, release ports; idempotent."""


@runtime_checkable
class Directory(Protocol):
    """A signed key-value directory (the DHT): where an elastic grid's claims, sessions and run
    record live (mesh/runtime/registry.py)."""

    def dht_store(
        self, key: str, subkey: str, value: Any, ttl_s: float, timeout_s: float | None = None
    ) -> bool: ...

    def dht_get(self, key: str, timeout_s: float | None = None) -> dict[str, Any] | None: ...

    def dht_get_many(
        self, keys: Sequence[str], timeout_s: float | None = None, withdrawn: bool = False
    ) -> list[dict[str, Any] | None]:
        """Each key's live subkey -> value ({}: none; None: no answer); withdrawn: also the
        subkeys their writer withdrew lately (a store of None), with the value None."""

    @property
    def owner_marker(self) -> str:
        """The subkey suffix that makes a record writable only by this peer (its signature)."""


@runtime_checkable
class DirectoryTransport(Transport, Directory, Protocol):
    """A transport whose peers meet through a Directory (hivemind): the elastic grid's."""

    @property
    def peer_id(self) -> str:
        """This peer's address in the directory (a libp2p PeerID, base58)."""
