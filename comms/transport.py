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
partial result is never silently presented as a full mean. Every transport runs its means with
comms/group_means.py (its `means`): the protocol's averaging members are defined here, once,
over it (`Averaging`).

imports: torch, comms only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from comms.codecs import Encoded
from comms.group_means import GroupMeans
from comms.means import Contribution, MeanHandle, MeanResult, MeanStatus, mean_in_member_order
from comms.stats import TransportStats
from comms.wire import Expect, Kind, Message

# what a transport's user reads of its rounds and counters, named where the protocol is
__all__ = [
    "Averaging",
    "Directory",
    "DirectoryTransport",
    "MeanHandle",
    "MeanResult",
    "MeanStatus",
    "SendHandle",
    "Transport",
    "TransportStats",
    "mean_in_member_order",
]


class SendHandle(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> None:
        """Block until the bytes left (or raise PeerTimeout / PeerLost)."""


class Averaging(Protocol):
    """The averaging members of a Transport, the same for every transport: defined here, over
    its rounds (comms/group_means.py); a transport subclasses this to have them."""

    means: GroupMeans

    def start_mean(
        self,
        group: str,
        members: list[str],
        round_id: int,
        values: torch.Tensor,
        codec: str,
        timeout_s: float,
        abstain: bool = False,
    ) -> MeanHandle:
        """Start the mean of a flat float32 payload over `members` (self included) without
        blocking. Every member must call it with the same group, members and round_id. The
        result is the mean of all contributors' DEQUANTIZED payloads, own included, summed in
        member order, so it is bit-identical on every member. abstain: this member's weights
        are stale; it sends no payload and takes the others' mean (comms/means.py)."""
        mine = Contribution.of(values, codec, abstain)
        return self.means.start(group, members, round_id, mine, timeout_s)

    def newest_round(self, group: str, members: Sequence[str]) -> int:
        """The highest round id of `group` that another of `members` launched and whose
        payload reached this peer (-1: none): the round clock a trailing replica keeps up
        with (mesh/algo/round_clock.py)."""
        return self.means.newest(group, members)

    def void_rounds(self, group: str, members: Sequence[str], round_ids: range) -> int:
        """This peer will never run these averaging rounds of `group` (its state was replaced
        by a download that skipped them): the other members' payloads for them are dropped,
        those waiting now and those that arrive later, counted in stats.rejects as "late".
        Returns how many were waiting."""
        return self.means.void(group, members, round_ids)


@runtime_checkable
class Transport(Averaging, Protocol):
    backend: str  # "torch" or "hivemind"
    me: str  # this peer's name
    stats: TransportStats

    def send(self, to: str, tag: str, kind: Kind, enc: Encoded, step: int) -> SendHandle:
        """Queue `enc` for peer `to` under `tag`; returns at once (shaping happens behind)."""

    def recv(self, frm: str, tag: str, expect: Expect, timeout_s: float) -> Message:
        """The message from `frm` with `tag`, validated against `expect`; PeerTimeout after
        timeout_s. Messages that fail validation are counted in stats.rejects and dropped."""

    def wait_arrival(self, seen: int, timeout_s: float) -> int:
        """Block until a message is filed after the `seen`-th one, or timeout_s; returns the
        count of messages filed so far (pass it back as `seen`)."""

    def recv_prefix(self, frm: str, prefix: str, expect: Expect, timeout_s: float) -> Message:
        """The oldest message from `frm` whose tag starts with `prefix`, validated against
        `expect` (its tag is the message's name); PeerTimeout after timeout_s (0: only what
        waits now), PeerLost when `frm` is cut off and nothing matching waits. For a receiver
        that cannot know a tag before it arrives: a stage pool's cell takes whichever
        microbatch a neighbour routed to it."""

    def drop_tags(self, prefix: str) -> int:
        """Nobody will take a message whose tag starts with `prefix` (a broken pipeline
        session's): drop those waiting and those that arrive later, counted in stats.rejects as
        "stale". Returns how many were waiting."""

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

    @property
    def relayed(self) -> bool:
        """Whether others reach this peer through a relay (behind a NAT, client mode)."""
