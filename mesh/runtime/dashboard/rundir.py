"""The dashboard's JSON from a run directory (`simulate --out DIR`, a `join --out DIR`, or a
finished run), reading files only: DIR/config.toml, DIR/metrics/<stage>-<replica>.jsonl (each
cell's rows, appended while it runs), DIR/val.jsonl, DIR/logs/s<j>r<i>.err (a failed cell).

The JSON has the shape of `meshtrain status --json` (cli/status.py: run_key, grid, data, cells,
free, rejected_claims), each cell with a `state` (state.py) and what its rows say (rounds,
rejects, loss, bytes), plus `run` (fingerprint, start) and `curves` (loss against tokens per
replica). A cell's process is looked up by the pid its `started` row names, when the row was
written on this machine; otherwise a cell whose rows stopped for DEAD_AFTER_BEATS heartbeats
counts as dead.

imports: stdlib, mesh.config, mesh.algo.schedule, comms.procs, this package's state.
"""

from __future__ import annotations

import json
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from comms.procs import running
from mesh.algo.schedule import microbatches_per_update
from mesh.algo.topology import cell_name
from mesh.config import Config, load_config
from mesh.runtime.dashboard.state import FREE, Seen, cell_state

RATE_ROWS = 20  # tokens/s over a cell's last this many updates
MAX_POINTS = 300  # per curve: enough for a chart, small enough to poll every second
CURVE_KEEP = 4 * MAX_POINTS  # points a cell's loss curve holds, however long the run


class Curve:
    """A run-long series in bounded memory: every `stride`-th point is kept, and the stride
    doubles (every other kept point goes) whenever more than `keep` are held, so the points
    stay evenly spread over the whole run; the newest point is always there."""

    def __init__(self, keep: int = CURVE_KEEP) -> None:
        self.keep, self.stride, self.seen = keep, 1, 0
        self.points: list[Any] = []
        self.newest: Any = None

    def append(self, point: Any) -> None:
        if self.seen % self.stride == 0:
            self.points.append(point)
            if len(self.points) > self.keep:
                self.points, self.stride = self.points[::2], self.stride * 2
        self.seen += 1
        self.newest = point

    def __iter__(self) -> Any:
        tail = [] if self.newest is None or (self.seen - 1) % self.stride == 0 else [self.newest]
        return iter([*self.points, *tail])

    def __len__(self) -> int:
        return len(self.points) + (0 if (self.seen - 1) % self.stride == 0 else 1)

    def __getitem__(self, index: int) -> Any:
        return list(self)[index]


@dataclass
class CellTail:
    """One cell's metrics file, read on from where the last poll stopped."""

    path: Path
    offset: int = 0
    last: dict[str, Any] | None = None  # the newest training row
    last_event: dict[str, Any] | None = None
    last_is_event: bool = False
    started: dict[str, Any] | None = None  # {"pid", "host"} of the newest `started` row
    final: dict[str, Any] | None = None
    losses: Curve = field(default_factory=Curve)  # (step, loss), bounded
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RATE_ROWS))
    mtime: float | None = None
    sent: SentTotals = field(default_factory=lambda: SentTotals())  # every life of the cell

    def poll(self) -> None:
        try:
            st = self.path.stat()
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        self.mtime = st.st_mtime
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                self.take(row)

    def take(self, row: dict[str, Any]) -> None:
        if isinstance(row.get("bytes_sent"), dict):
            self.sent.see(self.path.name, row["bytes_sent"])
        if row.get("final"):
            self.final = row
        elif "event" in row:
            self.last_event, self.last_is_event = row, True
            if row["event"] == "started":
                self.started, self.final = row, None  # a resumed cell runs again
        else:
            self.last, self.last_is_event = row, False
            if isinstance(row.get("step"), int) and isinstance(row.get("time_s"), int | float):
                self.recent.append((row["step"], float(row["time_s"])))
            if isinstance(row.get("loss"), int | float):
                self.losses.append((int(row.get("step", 0)), float(row["loss"])))


class SentTotals:
    """Bytes sent per link kind, summed over every sender seen (a cell's process, a peer):
    one that left keeps its last totals in the sum, and one whose counters started again (a
    new process under the same key: a restart, a resume) banks what its old life sent."""

    def __init__(self) -> None:
        self.latest: dict[Any, dict[str, int]] = {}
        self.banked: dict[str, int] = {}

    def see(self, sender: Any, counts: dict[str, Any]) -> None:
        counts = {k: int(n) for k, n in counts.items() if isinstance(n, int | float)}
        old = self.latest.get(sender, {})
        if any(counts.get(k, 0) < n for k, n in old.items()):  # a new life's counters
            for k, n in old.items():
                self.banked[k] = self.banked.get(k, 0) + n
        self.latest[sender] = counts

    def total(self) -> dict[str, int]:
        out = dict(self.banked)
        for counts in self.latest.values():
            for k, n in counts.items():
                out[k] = out.get(k, 0) + n
        return out


def thin(points: list[Any], n: int = MAX_POINTS) -> list[Any]:
    """At most n points, evenly spaced, the last one always kept."""
    if len(points) <= n:
        return list(points)
    stride = len(points) / n
    out = [points[int(k * stride)] for k in range(n - 1)]
    return out + [points[-1]]


def seen_of(tail: CellTail | None, failed: bool, now: float, host: str) -> Seen:
    """What a cell's files say of it."""
    if tail is None or (tail.last is None and tail.last_event is None and tail.final is None):
        return Seen(claimed=False)
    alive = None
    if failed:
        alive = False
    elif tail.started is not None and tail.started.get("host") == host:
        pid = tail.started.get("pid")
        alive = running(pid) if isinstance(pid, int) else None
    age = None if tail.mtime is None else max(0.0, now - tail.mtime)
    event = tail.last_event.get("event") if tail.last_is_event and tail.last_event else None
    return Seen(
        claimed=True,
        heartbeat_age_s=age,
        step_still_s=age,  # a row per update: the file's age is how long the step stood
        alive=alive,
        final=tail.final is not None,
        waiting_event=event == "waiting",
        # a clean stop's last row (mesh/runtime/trainer.py): saved, and released on a DHT run
        released=event == "saved" and not failed,
    )


class RunDirView:
    """Polls a run directory; `json()` is what the dashboard's page reads."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        if not (self.dir / "config.toml").is_file():
            from mesh.config import ConfigError

            raise ConfigError(
                f"--run {self.dir}: no config.toml there; pass the directory a `simulate --out` "
                "or `join --out` wrote"
            )
        self.cfg: Config = load_config([self.dir / "config.toml"])
        self.fingerprint = self.cfg.fingerprint()
        self.tails: dict[tuple[int, int], CellTail] = {}
        self.host = socket.gethostname()

    def json(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return build_json(self.cfg, self.dir, self.fingerprint, self.poll(), now, self.host)

    def poll(self) -> dict[tuple[int, int], CellTail]:
        for path in (self.dir / "metrics").glob("*.jsonl"):
            try:
                key = tuple(int(x) for x in path.stem.split("-"))
            except ValueError:
                continue
            self.tails.setdefault(key, CellTail(path)).poll()  # type: ignore[arg-type]
        return self.tails


def tokens_per_step(cfg: Config) -> int:
    """Training tokens one replica sees per update."""
    mpu = microbatches_per_update(cfg.pipeline.schedule, cfg.pipeline.microbatches)
    return mpu * cfg.tokens_per_microbatch


def build_json(
    cfg: Config,
    run_dir: Path,
    fingerprint: str,
    tails: dict[tuple[int, int], CellTail],
    now: float,
    host: str,
) -> dict[str, Any]:
    P, m = cfg.grid.stages, cfg.grid.replicas
    cells, free = [], []
    bytes_by_kind: dict[str, int] = {}
    for i in range(m):
        for j in range(P):
            name = cell_name(j, i)
            tail = tails.get((j, i))
            failed = (run_dir / "logs" / f"{cell_name(j, i)}.err").is_file()
            seen = seen_of(tail, failed, now, host)
            state = cell_state(seen, cfg.elastic.heartbeat_s)
            if tail is not None:  # a cell that stopped still counts what it sent
                for kind, n in tail.sent.total().items():
                    bytes_by_kind[kind] = bytes_by_kind.get(kind, 0) + n
            if state == FREE:
                free.append(name)
                continue
            cells.append(cell_json(name, tail, state, seen, now, cfg))
    per_step = tokens_per_step(cfg)
    train = {
        str(i): thin([[s * per_step, loss] for s, loss in tails[(P - 1, i)].losses])
        for i in range(m)
        if (P - 1, i) in tails
    }
    val: dict[str, list[list[float]]] = {}
    for r in read_rows(run_dir / "val.jsonl"):
        if isinstance(r.get("replica"), int) and isinstance(r.get("val_loss"), int | float):
            val.setdefault(str(r["replica"]), []).append([r["tokens"] / m, r["val_loss"]])
    start = (run_dir / "config.toml").stat().st_mtime
    return {
        "run_key": "none",  # files: nothing to verify
        "grid": f"{P}x{m}",
        "data": {"path": cfg.data.path, "digest": cfg.data.digest},
        "cells": cells,
        "free": free,
        "rejected_claims": 0,
        "run": {
            "source": str(run_dir),
            "fingerprint": fingerprint,
            "start": start,
            "heartbeat_s": cfg.elastic.heartbeat_s,
            "steps": cfg.run.steps,
        },
        "bytes_sent": bytes_by_kind,
        "curves": {"train": train, "val": val},
        "now": now,
    }


def cell_json(
    name: str, tail: CellTail | None, state: str, seen: Seen, now: float, cfg: Config
) -> dict[str, Any]:
    """A cell as status --json has it (peer: the local process), with its rows' counters."""
    # the final row has the totals (steps, bytes, rejects), the last update's row the rest
    row = {**(tail.last or {}), **(tail.final or {})} if tail is not None else {}
    started = (tail.started or {}) if tail is not None else {}
    rejects = row.get("rejects") or {}
    rate = _rate(tail, cfg)
    return {
        "cell": name,
        "peer": f"pid {started['pid']}@{started.get('host', '?')}" if "pid" in started else "",
        "verified": True,
        "step": int(row.get("step", 0)),
        "tokens_per_s": round(rate, 1),
        "heartbeat_age_s": None if seen.heartbeat_age_s is None else round(seen.heartbeat_age_s, 1),
        "session": 0,
        "session_age_s": None,
        "state": state,
        "rounds": {k: int(row.get(f"rounds_{k}", 0)) for k in ("applied", "partial", "failed")},
        "rejects": sum(int(v) for v in rejects.values()),
        "loss": row.get("loss"),
        # neighbours this cell's sentinel flagged (sentinel.enabled), as status shows them
        "flagged": [c for c in row.get("flagged") or [] if isinstance(c, str)],
    }


def _rate(tail: CellTail | None, cfg: Config) -> float:
    """Tokens/s of a replica through this cell over its last RATE_ROWS updates (a cell that
    stopped: its last rate)."""
    if tail is None or len(tail.recent) < 2:
        return 0.0
    (s0, t0), (s1, t1) = tail.recent[0], tail.recent[-1]
    return (s1 - s0) * tokens_per_step(cfg) / (t1 - t0) if t1 > t0 else 0.0


def read_rows(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        if line.strip().endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
