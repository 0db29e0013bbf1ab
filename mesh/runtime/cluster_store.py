"""The rendezvous store of a `meshtrain train` grid, from the cells' side: rank 0 serving it
when no launcher does, every cell watching that it still answers, and rank 0 keeping it up at
the end for the cells still finishing.

The store is where the cells' links meet (comms/torchdist/pairs.py: each cell's incarnation,
its goodbye, each pair's handshake). Once the links are up nothing needs it until a cell starts
again: a store that goes (its node lost, or rank 0's process ended) leaves whole replicas
training, but no cell can rejoin. Its one key of ours: mt/beat/CELL, a counter each cell adds
to every STORE_WATCH_S.

imports: comms, mesh.config, mesh.runtime (cluster, stop).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from comms.torchdist.gloo import store_client, store_server
from comms.torchdist.pairs import inc_key, left_key
from mesh.config import ConfigError
from mesh.runtime.cluster import Place
from mesh.runtime.stop import STOP

HOLD_STORE_S = 60.0  # the longest rank 0 keeps serving the store for cells still finishing
STORE_WATCH_S = 5.0  # how often a cell checks that the rendezvous store still answers
RECHECK_S = 2.0  # and after a failed check, when it asks once more before it says it is gone


def beat_key(cell: str) -> str:
    return f"mt/beat/{cell}"


def serve_store(place: Place, timeout_s: float) -> Any:
    """The store at MASTER_PORT, on every interface (as torchrun's own stores); ConfigError
    when the port is taken."""
    try:
        return store_server("0.0.0.0", place.store_port, timedelta(seconds=timeout_s))
    except (OSError, RuntimeError) as e:
        raise ConfigError(
            f"rank 0 cannot serve the rendezvous store on port {place.store_port} ({e}); set "
            "MASTER_PORT to a free port"
        ) from None


def watch_store(
    place: Place,
    cell: str,
    ended: threading.Event,
    on_lost: Callable[[], None],
    every_s: float = STORE_WATCH_S,
) -> threading.Thread:
    """Beat in the store every every_s (hold_store reads the beats), and call on_lost() once
    when the store does not answer, nor RECHECK_S later on a fresh connection, while the cell
    runs (not after `ended`, nor once its stop began: a launcher stopping every worker takes
    rank 0's store down a moment before it stops this one, which is no news)."""

    def answers(store: Any) -> bool:
        try:
            store.add(beat_key(cell), 1)
            return True
        except Exception:  # noqa: BLE001 - the server is gone, whatever torch calls it
            return False

    def watch() -> None:
        try:
            store = store_client(place.store_host, place.store_port, timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - never there: the transport's start says why
            return
        while not ended.wait(every_s):
            if answers(store):
                continue
            if ended.wait(RECHECK_S):
                return
            try:
                # a plain connect first: c10d's client logs each failed one with C++ frames
                socket.create_connection((place.store_host, place.store_port), RECHECK_S).close()
                wait = timedelta(seconds=RECHECK_S)
                store = store_client(place.store_host, place.store_port, wait)
                if answers(store):
                    continue
            except Exception:  # noqa: BLE001 - nobody listens there any more
                pass
            if not (ended.is_set() or STOP.exiting):
                on_lost()
            return

    thread = threading.Thread(target=watch, name="store-watch", daemon=True)
    thread.start()
    return thread


def hold_store(store: Any, cells: Sequence[str], timeout_s: float = HOLD_STORE_S) -> None:
    """Rank 0 trained to the end: keep serving the store while one of `cells` still beats in
    it and has not closed (said goodbye: mt/left/NAME at its newest mt/inc/NAME), at most
    timeout_s, so that no cell still finishing loses it. A cell whose beat stood still for
    three periods is dead: not waited for."""
    start = time.monotonic()
    moved: dict[str, tuple[int, float]] = {}  # cell -> (its beat count, when it last moved)
    while time.monotonic() - start < timeout_s:
        now, waiting = time.monotonic(), []
        try:
            for name in cells:
                if store.add(left_key(name), 0) >= store.add(inc_key(name), 0):
                    continue  # closed
                count = store.add(beat_key(name), 0)
                if moved.get(name, (None, now))[0] != count:
                    moved[name] = (count, now)
                if now - moved[name][1] < 3 * STORE_WATCH_S:
                    waiting.append(name)
        except Exception:  # noqa: BLE001 - nothing more to wait for
            return
        if not waiting:
            return
        time.sleep(0.5)
