"""Which averaging round a cell launches: the round clock its stage's replicas share.

Role: rounds across replicas that run at different speeds. A round's subset is a
function of its index, so every replica of a stage must launch the same indices; a replica that
numbered rounds by its own step would, once it trails by more than a round stays open
(tau + dp.max_round_lag_steps), never meet its partner in a round again: each side's payload
arrives after the other closed the round. The clock here is the leading replica's: a cell
numbers rounds by its own updates while it keeps up, and a cell that trails the newest round
any column peer launched by `jump_after` rounds or more launches that round instead (skipping
the ones between: they are the leader's alone). The trailer then meets every round it
launches, and the leader every round the trailer launches. No shared wall clock, no DHT
record: the clock travels in the round ids of the payloads themselves.

The leader's side (`lead_limit`): a cell launches no round more than `lead` rounds past the
newest one a partner launched; it launches that newest round instead (still open on the
partner's side: both sides meet in it), or the next after its own last when that is newer and
within the bound, or none this time. Without it, a replica 3x faster than its only partner
launches three rounds for each one the partner reaches (two thirds of its rounds waited out
alone, counted failed); with it, the fast replica averages at the pace of the column, and each
round it launches is one the partner reaches while it is open. `lead` is what the partner
launches while a round stays open (the round deadline, or tau + dp.max_round_lag_steps of this
cell's updates, whichever is first), halved for room, and at least 1; only a cell clearly
faster than its partners bounds its lead.

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
    final_index: int | None = None,
    lead: int | None = None,
) -> int | None:
    """The index of the round to launch now, or None to launch none this time.

    own_index: the cell's own count (update // interval); last: the index it launched last
    (None before the first); newest_seen: the highest index a column peer launched that
    reached this cell (-1: none); in_flight: the indices of its rounds still open; parts: K of
    the partition selector (None for a selector without the guarantee). A jump that would put a
    coordinate in flight twice (the new index in the same part as an open round: K apart)
    launches nothing this time instead: no coordinate is ever in flight twice.
    final_index: the last index any replica launches (that of the run's last update): a cell
    whose clock ran ahead of its own count after a jump launches nothing past it near the end,
    since no partner ever will (each would be a round waited out alone).
    lead: rounds this cell may launch past newest_seen (lead_limit; None: no bound).
    """
    base = own_next(own_index, last)
    if final_index is not None and base > final_index:
        return None
    if lead is not None and newest_seen >= 0 and base > newest_seen + lead:
        # the newest round a partner launched (still open on its side), or the next after ours
        follow = newest_seen if last is None else max(last + 1, newest_seen)
        if follow > newest_seen + lead:
            return None
        if parts is not None and any((follow - i) % parts == 0 for i in in_flight):
            return None
        return follow
    if newest_seen - base < jump_after:
        return base
    if parts is not None and any((newest_seen - i) % parts == 0 for i in in_flight):
        return None
    return newest_seen


LEAD_RATIO = 1.25  # a cell bounds its lead only when this much faster than its partners


def lead_limit(
    open_s: float, own_rounds_per_s: float | None, partner_rounds_per_s: float | None, cap: float
) -> int | None:
    """Rounds a cell may launch past the newest round a partner launched (see the module
    docstring), or None for no bound: a cell not LEAD_RATIO times faster than its partners'
    launches is the column's pace (a bound there would slow the clock it sets). A faster one:
    what the partners launch in half of open_s (how long a round stays open), between 1 and
    cap (the trailer's jump threshold). Never 0: with at least 1, the cell whose last round is
    the oldest can always launch, so cells never wait for each other."""
    if partner_rounds_per_s is None or own_rounds_per_s is None or math.isinf(cap):
        return None
    if own_rounds_per_s <= LEAD_RATIO * partner_rounds_per_s:
        return None
    return int(max(1, min(cap, 0.5 * open_s * partner_rounds_per_s)))


def pace(samples: list[tuple[float, int]]) -> float | None:
    """Rounds per second over (time_s, round index) samples, oldest first; None with fewer
    than two, or no time between them."""
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return None
    return max(0.0, samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
