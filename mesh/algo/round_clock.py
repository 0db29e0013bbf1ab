"""Which averaging round a cell launches: the round clock its stage's replicas share.

Role: design 1.3 "rounds across replicas that run at different speeds". A round's subset is a
function of its index, so every replica of a stage must launch the same indices; a replica that
numbered rounds by its own step would, once it trails by more than a round stays open
(tau + dp.max_round_lag_steps), never meet its partner in a round again: each side's payload
arrives after the other closed the round. The clock here is the leading replica's: a cell
numbers rounds by its own updates while it keeps up, and a cell that trails the newest round
any column peer launched by `jump_after` rounds or more launches that round instead (skipping
the ones between: they are the leader's alone). The trailer then meets every round it
launches, and the leader every round the trailer launches. No shared wall clock, no DHT
record: the clock travels in the round ids of the payloads themselves.

Pure functions; the runtime (mesh/runtime/stage.py) keeps the last index and asks the transport
for the newest one seen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

NEVER = math.inf  # jump_after when rounds must follow the cell's own steps (dp.strict_tau)


def jump_threshold(tau: int, max_round_lag_steps: int, interval_steps: int) -> int:
    """Rounds a cell may trail the newest round before it jumps: half of what a round stays
    open on the leader's side (tau + max_round_lag_steps updates), so the trailer's payload
    lands there before the round is cut, with room for the link. At least 2: two replicas in
    step a round apart (one formed a moment later) must not skip rounds, each skip is a round
    the other side waits out for nothing."""
    return max(2, (tau + max_round_lag_steps) // (2 * max(1, interval_steps)))


def own_next(own_index: int, last: int | None) -> int:
    """The index this cell launches next by its own count: its update count, or one past the
    last index it launched when the clock took it further."""
    return own_index if last is None else max(own_index, last + 1)


def next_round(
    own_index: int,
    last: int | None,
    newest_seen: int,
    jump_after: float,
    in_flight: Iterable[int] = (),
    parts: int | None = None,
) -> int | None:
    """The index of the round to launch now, or None to launch none this time.

    own_index: the cell's own count (update // interval); last: the index it launched last
    (None before the first); newest_seen: the highest index a column peer launched that
    reached this cell (-1: none); in_flight: the indices of its rounds still open; parts: K of
    the partition selector (None for a selector without the guarantee). A jump that would put a
    coordinate in flight twice (the new index in the same part as an open round: K apart)
    launches nothing this time instead: design 1.3's "no coordinate in flight twice".
    """
    base = own_next(own_index, last)
    if newest_seen - base < jump_after:
        return base
    if parts is not None and any((newest_seen - i) % parts == 0 for i in in_flight):
        return None
    return newest_seen
