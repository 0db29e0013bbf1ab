"""A peer's name record in the DHT (where its transport is reached, its membership token, who
signed it), type-checked field by field, and which of a name's records it resolves to
(comms/p2p/transport.py publishes and resolves them; comms/p2p/dht.py stores them).

imports: hivemind's PeerID and comms only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hivemind.p2p import PeerID

from comms.p2p.auth import signer_of


@dataclass(frozen=True)
class PeerRecord:
    peer_id: PeerID
    maddrs: tuple[str, ...]
    auth: str | None = None  # comms.p2p.auth token (None in records of peers without one)
    signer: str = ""  # owner marker of the subkey it was stored under
    t: float = 0.0  # when the publishing process started (the newest one wins)


def parse_record(value: object, subkey: str) -> PeerRecord | None:
    """A DHT record written by a peer under subkey: type-check every field; None once the peer
    left, or when the subkey is not `<its peer_id><owner marker>`."""
    if not isinstance(value, dict) or value.get("v") != 1:
        return None
    pid, maddrs, t = value.get("peer_id"), value.get("maddrs"), value.get("t", 0.0)
    if not isinstance(pid, str) or not isinstance(maddrs, list | tuple):
        return None
    if not all(isinstance(m, str) for m in maddrs) or not isinstance(t, int | float):
        return None
    signer = signer_of(subkey, pid)
    if signer is None:
        return None
    auth = value.get("auth")
    try:
        peer_id = PeerID.from_base58(pid)
    except Exception:  # noqa: BLE001 - malformed base58 from a peer
        return None
    return PeerRecord(peer_id, tuple(maddrs), auth if isinstance(auth, str) else None, signer, t)


def parse_records(found: dict[str, object]) -> list[PeerRecord]:
    """The well-formed records of a name (subkey -> value, as the DHT returned them)."""
    return [r for k, v in found.items() if (r := parse_record(v, k)) is not None]


def pick_record(
    found: dict[str, object],
    admits: Callable[[PeerRecord], bool],
    avoid: PeerID | None = None,
) -> PeerRecord | None:
    """The record a name resolves to: the newest admitted one (`t` is its publisher's clock, so
    a caller that could not reach it names it in `avoid` and gets the next admitted one, if
    any); with none admitted, the newest well-formed one (whose use the caller refuses)."""
    recs = parse_records(found)
    recs.sort(key=lambda r: (admits(r), r.peer_id != avoid, r.t), reverse=True)
    return recs[0] if recs else None
