"""What a cell writes of itself to its metrics file (mesh/runtime/trainer.py's CellRun): a row
per update, a `health` row now and then from the heartbeat thread, and the final row of its
totals."""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import torch

from comms.transport import Transport
from mesh.runtime.cell_worker import CellWorker
from mesh.runtime.pool_grid import pool_row

HEALTH_EVERY_S = 5.0  # a `health` row at most this often (on the heartbeat thread)


def health_rows(event: Any, transport: Transport) -> Any:
    """A heartbeat hook writing a `health` event row every HEALTH_EVERY_S: what only the
    process itself can see of a leak (threads, live asyncio tasks, mailbox depth, its own DHT
    calls); `meshtrain bench soak` reads /proc for the rest (RSS, descriptors). unix_s ties the
    row's time_s to the wall clock."""
    last = [-HEALTH_EVERY_S]

    def beat() -> None:
        now = time.monotonic()
        if now - last[0] < HEALTH_EVERY_S:
            return
        last[0] = now
        event(
            "health",
            threads=threading.active_count(),
            torch_threads=torch.get_num_threads(),
            unix_s=round(time.time(), 3),
            **transport.health(),
        )

    return beat


def update_row(worker: CellWorker, transport: Transport, time_s: float) -> dict[str, Any]:
    """The cell's row after an update (time_s: since its process's cell started)."""
    st, cell = worker.stats, worker.cell
    return {
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "time_s": round(time_s, 4),
        "loss": st.loss,
        "lr_scale": cell.lr_scale(),
        "grad_norm": st.grad_norm,
        "bytes_sent": transport.stats.sent_by_kind(),
        "rounds_started": st.rounds_started,
        "rounds_applied": st.rounds_applied,
        "rounds_partial": st.rounds_partial,
        "rounds_failed": st.rounds_failed,
        "rounds_jumped": st.rounds_jumped,
        "rounds_skipped": st.rounds_skipped,
        "rejects": dict(transport.stats.rejects),
        # neighbours sentinel.enabled flagged for sending far outside their statistics
        "flagged": cell.sentinel.flagged() if cell.sentinel is not None else [],
        "microbatches": st.microbatches,
        "busy_s": round(st.busy_s, 6),
        "staleness_max": st.staleness_max,
        "stash_bytes_peak": st.stash_bytes_peak,
        "rss_peak_mb": round(st.rss_peak_mb(), 1),
        **pool_row(st),
    }


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()[:16]


def final_row(worker: CellWorker, transport: Transport, start: float) -> dict[str, Any]:
    """The cell's totals, written once its worker finished (its sends drained); wall_s since
    `start` (time.perf_counter), its digest's time included."""
    cell = worker.cell
    return {
        "final": True,
        "stage": cell.stage,
        "replica": cell.replica,
        "step": cell.step,
        "flat_sha": _digest(cell.flat),
        "wall_s": time.perf_counter() - start,
        "bytes_sent": transport.stats.sent_by_kind(),  # sends drained: final counts
        "staleness_hist": {str(k): n for k, n in sorted(worker.stats.staleness.items())},
        "rejects": dict(transport.stats.rejects),
        "sessions_broken": worker.stats.sessions_broken,
        **pool_row(worker.stats),
    }
