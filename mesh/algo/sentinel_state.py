"""A Sentinel's statistics as plain values and tensors, and back (a logical run's checkpoint).

What torch.load(..., weights_only=True) reads back: a resumed simulator judges the next tensor
as the uninterrupted run would. A state that is not of this form is refused (ValueError) and
nothing changes: a checkpoint is input like any other.
"""

from __future__ import annotations

from collections import deque

import torch

from mesh.algo.sentinel import (
    FEATURES,
    FLOORS,
    SCALE_WINDOW,
    SKETCH_DIM,
    SenderStats,
    Sentinel,
    TokenTable,
    sketch_matrix,
)


def sentinel_state(sentinel: Sentinel) -> list[dict[str, object]]:
    """Every stream's statistics, sorted by (sender, kind)."""
    return [
        {
            "sender": sender,
            "kind": kind,
            "seen": s.seen,
            "accepted": s.accepted,
            "dropped": s.dropped,
            "flagged": s.flagged,
            "since": s.since,
            "mean": dict(s.mean),
            "slope": dict(s.slope),
            "learned": dict(s.learned),
            "streak": dict(s.streak),
            "deviations": {k: list(d) for k, d in s.deviations.items()},
            "recent": list(s.recent),
            "table": _table_state(s.table),
        }
        for (sender, kind), s in sorted(sentinel.streams.items())
    ]


def load_sentinel_state(sentinel: Sentinel, state: object) -> None:
    """Replace the sentinel's streams with `state` (from sentinel_state); ValueError, nothing
    changed, when it is not of that form."""
    streams = {}
    for entry in state if isinstance(state, list) else [None]:
        stats = _stats_of(entry)
        if stats is None or not isinstance(entry, dict) or entry["kind"] not in FLOORS:
            raise ValueError("sentinel state: not a list of stream statistics")
        streams[(entry["sender"], entry["kind"])] = stats
    sentinel.streams = streams


def _table_state(table: TokenTable | None) -> dict[str, torch.Tensor] | None:
    if table is None:
        return None
    width = table.rows.shape[1] if table.sketch is None else table.sketch.shape[0]
    return {"rows": table.rows, "offsets": table.offsets, "counts": table.counts, "width": width}


def _table_of(entry: object) -> TokenTable | None:
    """The TokenTable of a saved entry (its sketch is a pure function of the width)."""
    if not isinstance(entry, dict) or set(entry) != {"rows", "offsets", "counts", "width"}:
        raise ValueError("sentinel state: malformed token table")
    rows, offsets, counts, width = (entry[k] for k in ("rows", "offsets", "counts", "width"))
    if not (
        isinstance(width, int)
        and width >= 1
        and all(isinstance(t, torch.Tensor) for t in (rows, offsets, counts))
        and rows.ndim == 2
        and offsets.shape == counts.shape == rows.shape[:1]
        and bool(torch.isfinite(rows).all() and torch.isfinite(offsets).all())
    ):
        raise ValueError("sentinel state: malformed token table")
    sketch = sketch_matrix(width)  # a pure function of the width: not saved
    if rows.shape[1] != (width if sketch is None else SKETCH_DIM):
        raise ValueError("sentinel state: malformed token table")
    sketch = None if sketch is None else sketch.to(rows.device)
    return TokenTable(rows.clone(), offsets.clone(), counts.clone(), sketch)


def _floats(d: object, kind: type) -> bool:
    return isinstance(d, dict) and all(k in FEATURES and isinstance(v, kind) for k, v in d.items())


def _stats_of(entry: object) -> SenderStats | None:
    """One stream's SenderStats from its saved entry, or None when any field is malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sender"), str):
        return None
    counts = [entry.get(k) for k in ("seen", "accepted", "dropped", "since")]
    devs, recent = entry.get("deviations"), entry.get("recent")
    if not (
        all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts)
        and isinstance(entry.get("flagged"), bool)
        and _floats(entry.get("mean"), float)
        and _floats(entry.get("slope"), float)
        and _floats(entry.get("streak", {}), float)  # absent from older checkpoints
        and _floats(entry.get("learned"), int)
        and isinstance(devs, dict)
        and all(k in FEATURES and isinstance(v, list) for k, v in devs.items())
        and all(isinstance(x, float) for v in devs.values() for x in v)
        and isinstance(recent, list)
        and all(isinstance(x, bool) for x in recent)
    ):
        return None
    try:
        table = None if entry.get("table") is None else _table_of(entry["table"])
    except ValueError:
        return None
    seen, accepted, dropped, since = counts
    return SenderStats(
        seen=seen,
        accepted=accepted,
        dropped=dropped,
        flagged=entry["flagged"],
        mean=dict(entry["mean"]),
        slope=dict(entry["slope"]),
        learned=dict(entry["learned"]),
        streak=dict(entry.get("streak", {})),
        deviations={k: deque(v, maxlen=SCALE_WINDOW) for k, v in devs.items()},
        table=table,
        recent=deque(recent),
        since=since,
    )
