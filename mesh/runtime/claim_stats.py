"""What a heartbeat's claim carries of its cell's counters (the loss, rounds, rejects, bytes a
dashboard and `status` show), each kept only when well-typed: a peer's record is never trusted
to be the shape it says (mesh/runtime/registry.py parses the claims with it)."""

from __future__ import annotations

import math
from typing import Any

from mesh.algo.topology import Place

STAT_KINDS_MAX = 8  # bytes sent by link kind: a few kinds (pp, dp, state), never a peer's essay


def parse_stats(value: object) -> dict[str, Any] | None:
    """A heartbeat's counters for dashboards ({loss, rounds: [applied, partial, failed],
    rejects, bytes: {kind: n}}), each kept only when well-typed; None when none is."""
    if not isinstance(value, dict):
        return None
    out: dict[str, Any] = {}
    loss = value.get("loss")
    if is_number(loss) and math.isfinite(loss):
        out["loss"] = float(loss)
    rounds = value.get("rounds")
    if isinstance(rounds, list) and len(rounds) == 3 and all(is_count(x) for x in rounds):
        out["rounds"] = [int(x) for x in rounds]
    if is_count(value.get("rejects")):
        out["rejects"] = int(value["rejects"])
    if is_count(value.get("beat_errors")):  # heartbeats the DHT did not take (session.py)
        out["beat_errors"] = int(value["beat_errors"])
    if value.get("relayed") is True:  # others reach this cell through a relay (behind NAT)
        out["relayed"] = True
    # stage pools: microbatches this cell routed, and of those to another replica's cell
    for key in ("routed", "cross"):
        if is_count(value.get(key)):
            out[key] = int(value[key])
    flagged = value.get("flagged")  # neighbours sentinel.enabled flagged (mesh/algo/sentinel.py)
    if isinstance(flagged, list) and len(flagged) <= 2 and all(is_cell_name(c) for c in flagged):
        out["flagged"] = list(flagged)
    sent = value.get("bytes")
    if (
        isinstance(sent, dict)
        and len(sent) <= STAT_KINDS_MAX
        and all(isinstance(k, str) and len(k) <= 32 and is_count(n) for k, n in sent.items())
    ):
        out["bytes"] = {k: int(n) for k, n in sent.items()}
    return out or None


def is_cell_name(v: object) -> bool:
    return isinstance(v, str) and len(v) <= 16 and Place.parse(v) is not None


def is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
