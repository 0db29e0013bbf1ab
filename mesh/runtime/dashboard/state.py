"""A cell's state for people, from what a dashboard can see of it (pure functions).

States: training (its rows / heartbeats move), waiting (alive but its step stands still: its
replica waits for a neighbour, or a round), downloading (claimed, loading its stage's state
before it trains), free (nobody holds it: never held, or its peer stopped cleanly, saved and
released it, as `meshtrain status` counts it), dead (its process is gone without a clean stop,
or its heartbeats stopped), finished (it wrote its final row).

imports: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINING, WAITING, DOWNLOADING, FREE, DEAD, FINISHED = (
    "training",
    "waiting",
    "downloading",
    "free",
    "dead",
    "finished",
)
STATES = (TRAINING, WAITING, DOWNLOADING, FREE, DEAD, FINISHED)

# a heartbeat this many periods old means the peer stopped (a claim lives 4 periods in the DHT:
# registry.HEARTBEAT_LIVES; two missed beats is already more than a slow DHT write explains)
DEAD_AFTER_BEATS = 2.5
# a step standing still this many heartbeat periods (at least STILL_MIN_S) means waiting
STILL_AFTER_BEATS = 3.0
STILL_MIN_S = 3.0


@dataclass(frozen=True)
class Seen:
    """What is known of a cell at one moment (None: not known from this source)."""

    claimed: bool  # a process holds it (a live claim, or a metrics file being written)
    heartbeat_age_s: float | None = None  # since its last heartbeat / row
    step_still_s: float | None = None  # since its step last moved
    alive: bool | None = None  # its process exists (same machine only)
    final: bool = False  # it wrote its final row
    loading: bool = False  # claimed but not yet training (a join's placeholder, state catch-up)
    waiting_event: bool = False  # its last row says it waits for a neighbour
    released: bool = False  # its process stopped cleanly: saved, its claim withdrawn


def cell_state(seen: Seen, heartbeat_s: float) -> str:
    """The one word a dashboard shows for a cell."""
    if seen.final:
        return FINISHED
    if not seen.claimed or seen.released:
        return FREE
    if seen.alive is False:
        return DEAD
    if seen.alive is None and seen.heartbeat_age_s is not None:
        if seen.heartbeat_age_s > DEAD_AFTER_BEATS * heartbeat_s:
            return DEAD
    if seen.loading:
        return DOWNLOADING
    if seen.waiting_event:
        return WAITING
    still = max(STILL_MIN_S, STILL_AFTER_BEATS * heartbeat_s)
    if seen.step_still_s is not None and seen.step_still_s > still:
        return WAITING
    return TRAINING


class StepClock:
    """When each cell's step last moved, as a dashboard that polls sees it (a heartbeat carries
    the step but not when it changed)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}

    def still_s(self, cell: str, step: int, now: float) -> float:
        prev = self._last.get(cell)
        if prev is None or prev[0] != step:
            self._last[cell] = (step, now)
            return 0.0
        return now - prev[1]
