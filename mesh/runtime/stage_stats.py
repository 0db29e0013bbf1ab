"""A cell worker's counters: its rounds, sessions, microbatches, compute time, staleness and
stash (what its metrics rows and final row report; mesh/runtime/stage.py and pool.py keep them).

imports: stdlib only.
"""

from __future__ import annotations

import collections
import resource
from dataclasses import dataclass, field


@dataclass
class StageStats:
    rounds_started: int = 0
    rounds_applied: int = 0
    rounds_partial: int = 0
    rounds_failed: int = 0
    rounds_jumped: int = 0  # indices passed over to keep up with the column's round clock
    rounds_skipped: int = 0  # launches left out: the jump would put a coordinate in flight twice
    sessions_broken: int = 0  # pipeline sessions ended by a lost or replaced neighbour
    # last stage: the last update's loss (a list of every update's grew for the run's life)
    loss: float | None = None
    microbatches: int = 0  # backwards done
    busy_s: float = 0.0  # compute: emulated device time, or thread CPU time of real math
    staleness: collections.Counter[int] = field(default_factory=collections.Counter)
    stash_bytes_peak: int = 0  # weight versions + in-flight inputs and output gradients
    grad_norm: float | None = None  # the last update's, before clipping (None: emulated)

    @property
    def staleness_max(self) -> int:
        """Largest gap so far between a microbatch's read version and the live one at its
        backward (the gradient delay actually seen)."""
        return max(self.staleness, default=0)

    @staticmethod
    def rss_peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
