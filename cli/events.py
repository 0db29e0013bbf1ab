"""What a joined cell is doing, as lines for people: its event rows (mesh/runtime/trainer.py
writes them to metrics/<stage>-<replica>.jsonl, mesh/runtime/session.py says whom a replica waits
for) turned into sentences that `join` prints above its progress bar.

imports: stdlib only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def short_peer(peer: str) -> str:
    """A PeerID people can tell apart and match with `status`: its head and tail."""
    return peer if len(peer) <= 20 else f"{peer[:12]}...{peer[-4:]}"


def event_line(row: dict[str, Any], cell: str) -> str | None:
    """The sentence for one event row of `cell` (None: an event people need not see)."""
    kind, step = row.get("event"), row.get("step")
    if kind == "waiting":
        who = ", ".join(f"{c} ({state})" for c, state in sorted(row["waiting_for"].items()))
        return f"waiting for {who} to start replica {row['replica']}"
    if kind == "session":
        members = ", ".join(row.get("members") or [])
        return f"replica {row['replica']} formed ({members}): training from step {step}"
    if kind == "resumed":
        return f"resumed from my checkpoint at step {step} ({row.get('checkpoint', '?')})"
    if kind == "state_loaded":
        source = row.get("from_cell")
        peer = row.get("from_peer")
        where = f"{source} (peer {short_peer(peer)})" if source and peer else "a live peer"
        return f"loaded state from {where} at step {step}"
    if kind == "state_download_failed":
        return f"kept my own state: {row.get('reason', 'the state download failed')}"
    if kind == "session_broken":
        replica = cell.partition("r")[2]
        return f"replica {replica} stopped at step {step}: a neighbour left or was replaced"
    if kind == "saved":
        line = f"checkpoint saved to {row.get('checkpoint', '?')}"
        if row.get("released") is True:
            return f"{line}, released {cell}"
        if row.get("released") is False:
            return f"{line}; could not release {cell} (no DHT answer): its claim expires by itself"
        return line
    return None


class EventLines:
    """Turns a cell's rows (read again and again while it runs) into the lines not said yet;
    the events already in the file when it was made (an earlier run's) are never said."""

    def __init__(self, rows_before: list[dict[str, Any]], cell: str) -> None:
        self.cell = cell
        self.seen = sum(1 for r in rows_before if "event" in r)
        self._lock = threading.Lock()  # the drawing thread, then the main thread at the end

    def say_appended(self, rows: list[dict[str, Any]], say: Callable[[str], None]) -> None:
        """Say the events among rows just appended to the file (a RowTail's read)."""
        with self._lock:
            for row in rows:
                if "event" in row:
                    self.seen += 1
                    line = event_line(row, self.cell)
                    if line is not None:
                        say(line)

    def say_new(self, rows: list[dict[str, Any]], say: Callable[[str], None]) -> None:
        with self._lock:
            events = [r for r in rows if "event" in r]
            fresh, self.seen = events[self.seen :], max(self.seen, len(events))
            for row in fresh:
                line = event_line(row, self.cell)
                if line is not None:
                    say(line)
