"""A stage pool's wire names and bookkeeping (mesh/runtime/pool.py): its tags, parsed and
bounded before use, a cell's routing counters, and what it holds of each microbatch.

Wire (all tags start with `pool/`, and each is parsed and bounded before use):
- `pool/a/S/I` activation of microbatch (S, I), upstream -> downstream;
- `pool/g/S/I/Q/R/W` its gradient, downstream -> upstream, with the sender's load: Q
  microbatches held for other senders, R its measured rate in milli-microbatches a second, W
  the microbatches it takes at most now (sent with `pool_cell_window = "auto"` only, where it
  can exceed pipeline.pool_window: routing.cell_window; 1-999);
- `pool/r/S/I/Q/R/W` a refusal (the cell holds its window already): the sender routes the
  microbatch to another cell;
- `pool/l/S/I/Q/R/W` a load report (Q, R, W as above), sent to the cell of the sender's own
  replica upstream when a slot frees for microbatch (S, I) that cell did not send: a stream
  waiting for its own full cell hears of the room now, not when its next gradient is back;
- `pool/f/0` FIN: the sender will send no more work (its stream ended, or all its upstream did).
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field

import torch

from comms import codecs
from mesh.runtime.stage_stats import StageStats

_TAG = re.compile(
    r"pool/([agrlf])/(\d{1,6})(?:/(\d{1,12})(?:/(\d{1,6})/(\d{1,12})(?:/([1-9]\d{0,2}))?)?)?"
)


@dataclass
class PoolStats(StageStats):
    routed: collections.Counter[str] = field(default_factory=collections.Counter)  # to -> n
    cross_replica: int = 0  # microbatches sent to a cell of another replica
    refused: int = 0  # refusals this cell sent (it was full)
    rerouted: int = 0  # microbatches sent again elsewhere (refused, or their cell lost)
    voided: int = 0  # microbatches given up (no live cell took them, or void markers)
    held_peak: int = 0
    window_peak: int = 0  # the most this cell said it takes (pool_cell_window "auto" grows it)
    # the loop asleep: holding nothing (no work came: starved), or holding only microbatches
    # out downstream (waiting on answers; at stage 0 the stream window full: blocked)
    starved_s: float = 0.0
    blocked_s: float = 0.0


@dataclass
class Held:
    stream: int
    index: int
    inputs: torch.Tensor  # tokens at stage 0, else the received activation
    version: int
    sender: str | None  # upstream cell (None at stage 0)
    sent_to: str | None = None  # downstream cell (None at the last stage)
    sent_at: float = 0.0
    out: codecs.Encoded | None = None  # the activation sent, kept to route it again


def parse_tag(tag: str) -> tuple[str, int, int, int, float, int] | None:
    """(kind, stream, index, others_held, rate, window) of a pool tag (window 0: not said);
    None when malformed."""
    found = _TAG.fullmatch(tag)
    if found is None:
        return None
    kind, stream = found.group(1), int(found.group(2))
    index = int(found.group(3) or 0)
    others = int(found.group(4) or 0)
    rate = int(found.group(5) or 0) / 1000.0
    return kind, stream, index, others, rate, int(found.group(6) or 0)
