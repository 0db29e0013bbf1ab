"""A cell's averaging rounds in flight and the order an update runs them: one book for both
engines (the simulator, mesh/engine/sim.py, and the runtime, mesh/runtime/rounds.py).

After each optimizer update a cell first applies, in launch order, the rounds whose
delay tau has passed; then, every dp.interval_steps updates, it launches the next round; with
tau = 0 (SPARTA, DPAvg: blocking) the round just launched is applied at once. A round is
applied only after every round launched before it (the drift correction assumes launch order).
A book entry is the round and whatever the engine waits on for its mean: the simulator fills
the mean at launch (no handle), the runtime keeps the transport's MeanHandle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

import torch

H = TypeVar("H")


@dataclass
class Round:
    """One averaging round of one stage as seen by one cell."""

    index: int
    launch_step: int
    indices: torch.Tensor  # into the stage's flat parameter vector (the same on every replica)
    snapshot: torch.Tensor  # this cell's values at launch (its contribution)
    payload_bytes: int  # what this cell puts on the wire for the round (encoded)
    mean: torch.Tensor | None = None  # filled when the round completes
    sent: torch.Tensor | None = None  # what this cell puts in the round instead of its
    # snapshot: an emulated hostile peer's scaled values (faults.poison)
    own: torch.Tensor | None = None  # its decoded own payload (dp.payload_error_feedback)

    @property
    def payload(self) -> torch.Tensor:
        """The values this cell contributes to the round."""
        return self.snapshot if self.sent is None else self.sent


class Action(StrEnum):
    APPLY = "apply"  # apply every due round that has its mean, oldest first
    LAUNCH = "launch"  # launch this update's round


def after_update(update: int, interval_steps: int, tau: int) -> tuple[Action, ...]:
    """What a cell does with its rounds after its update `update` (0-based)."""
    if update % interval_steps:
        return (Action.APPLY,)
    if tau == 0:
        return (Action.APPLY, Action.LAUNCH, Action.APPLY)
    return (Action.APPLY, Action.LAUNCH)


def round_index(update: int, interval_steps: int) -> int:
    """The round launched after update `update` (one every interval_steps updates)."""
    return update // interval_steps


@dataclass
class RoundBook(Generic[H]):
    """The rounds a cell launched and has not applied or dropped, in launch order."""

    tau: int
    entries: deque[tuple[Round, H]] = field(default_factory=deque)

    def launch(self, rnd: Round, handle: H) -> None:
        assert not self.entries or self.entries[-1][0].launch_step <= rnd.launch_step
        self.entries.append((rnd, handle))

    def due(self, step: int) -> tuple[Round, H] | None:
        """The oldest round if its tau has passed at `step` (None: nothing due yet)."""
        if not self.entries:
            return None
        head = self.entries[0]
        return head if head[0].launch_step + self.tau <= step else None

    def pop(self) -> tuple[Round, H]:
        """Take the oldest round out of the book (it is applied or failed now)."""
        return self.entries.popleft()

    def void(self) -> int:
        """Drop every round in flight (the cell's state was replaced); returns how many."""
        n = len(self.entries)
        self.entries.clear()
        return n

    def indices(self) -> Iterator[int]:
        """The round indices in flight (the round clock avoids launching one twice)."""
        return (rnd.index for rnd, _ in self.entries)

    def handles(self) -> Iterator[H]:
        return (h for _, h in self.entries)

    def __len__(self) -> int:
        return len(self.entries)
