"""`meshtrain bench soak`: a 2x2 hivemind grid trained for an hour on wan100-shaped links, one
peer SIGKILLed and replaced by a fresh `join` every ~10 minutes, each peer's resources sampled.

Real `meshtrain dht` + `meshtrain join` processes on 127.0.0.1 (mesh/bench/grid.py), a tiny
model on a generated text file (real compute, so the loss means something; each forward and
backward then waits emulation.slowdowns x its time, so four peers leave the box room), every link
shaped in-process by the transport to 100 Mbit/s and 20 ms one way (transport.link = "wan100").
A sampler thread reads, every --sample period and for each live peer, /proc (RSS, descriptors
and threads of the cell process, its DHT process and p2pd; the /tmp/hivemind-*.sock files the
tree holds) and the new rows of the cell's metrics file (its last `health` row: threads, live
asyncio tasks, mailbox depth; training steps, loss, rounds), and appends one line per peer to
OUT/samples.jsonl as it goes, kills and replacements too, so a crashed or cut-short soak
still has its data. The end (also after a failure): every process stopped and reaped, what
outlived the grid (p2pd, socket files) checked, summary.json, table.md and soak.png written
from samples.jsonl (mesh/bench/soak_report.py).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mesh.algo.topology import cell_name
from mesh.bench.grid import LocalGrid, record_failure
from mesh.bench.soak_report import write_reports
from mesh.runtime.metrics import RowTail, cell_of_file, newest_metrics_file
from mesh.testing.local_peers import tiny_grid_config, wait_for
from mesh.testing.procstat import tree_sample

CELLS = ["s0r0", "s1r1", "s1r0", "s0r1"]  # the kill order: each cell in turn
FORM_S = 240  # forming the grid or replacing a peer longer than this is a failure
CLAIM_LIVES_S = 4 * 1.0  # a dead peer's claim expires after 4 heartbeats (heartbeat_s = 1)
# runtime lines of the soak's grid: shaped links; real compute that waits 3x its own time
SOAK_LOCAL = (
    'transport.link = "wan100"\nemulation.slowdowns = ["s0r0=4", "s1r0=4", "s0r1=4", "s1r1=4"]\n'
)
SOAK_STEPS = 10_000_000  # never reached: the soak stops the grid
# The lr and lambda schedules span the soak, as a real run's span the run: cosine over the
# updates a soak of that length makes (86k per cell in 60 min here, session 9). The first soak
# ran at a constant lr (its schedules spanned SOAK_STEPS) and its loss rose from minute 30.
SOAK_UPDATES_PER_MIN = 1400
SOAK_D_MODEL, SOAK_SEQ_LEN = 48, 32  # bytes of Shakespeare: still learning after an hour
# (fp8 rounds are applied relative to the cell's own decoded payload, dp.payload_error_feedback,
# the default: without it the codec's rounding random-walked into the weights and the loss rose
# from minute 30 in every soak; session 11)


def plan(minutes: float, quick: bool) -> dict[str, float]:
    """The soak's schedule: about one kill per 10 minutes (at least one), evenly spaced so the
    last replacement has as long to settle as the others; samples every 30 s (5 s quick);
    growth is measured from 1/12 of the run (minute 5 of 60) on."""
    duration_s = minutes * 60
    kills = max(1, round(minutes / 10))
    return {
        "duration_s": duration_s,
        "kills": kills,
        "kill_every_s": duration_s / (kills + 1),
        "sample_s": 5.0 if quick else 30.0,
        "warmup_s": min(300.0, duration_s / 12),
    }


class Tail:
    """The rows a cell appended to its metrics file since the last read."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.cell = run_dir, ""
        self.tail: RowTail | None = None
        self.health: dict[str, Any] = {}
        self.last: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        path = newest_metrics_file(self.run_dir)
        if path is None:
            return {}
        if self.tail is None or self.tail.path != path:  # a join that lost its claim rejoined
            self.cell, self.tail = cell_name(*cell_of_file(path)), RowTail(path)
            self.health, self.last = {}, {}
        losses = []
        for row in self.tail.read():
            if row.get("event") == "health":
                self.health = row
            elif "event" not in row and not row.get("final"):
                self.last = row
                if row.get("loss") is not None:
                    losses.append(row["loss"])
        h, last = self.health, self.last
        return {
            "cell": self.cell,
            "step": last.get("step", 0),
            "loss_mean": sum(losses) / len(losses) if losses else None,
            "loss_n": len(losses),
            "health_threads": h.get("threads"),
            "asyncio_tasks": h.get("asyncio_tasks"),
            "mailbox_pending": h.get("mailbox_pending"),
            "health_age_s": round(time.time() - h["unix_s"], 1) if "unix_s" in h else None,
            "dht": h.get("dht"),
            **{k: last.get(k, 0) for k in ("rounds_applied", "rounds_partial", "rounds_failed")},
        }


class Sampler(threading.Thread):
    """Every period_s: one line per live peer appended to `path` (see the module docstring)."""

    def __init__(self, grid: LocalGrid, path: Path, period_s: float, t0: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.grid, self.path, self.period_s, self.t0 = grid, path, period_s, t0
        self.tails: dict[str, Tail] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()  # samples.jsonl is appended from both threads
        self.errors: list[str] = []

    def finish(self) -> None:
        """Stop sampling; returns once no sample is being taken (a grid that never formed
        never started it)."""
        self.stop.set()
        if self.ident is not None:
            self.join(30)

    def write(self, record: dict[str, Any]) -> None:
        with self.lock, self.path.open("a") as f:
            f.write(json.dumps({"t_s": round(time.monotonic() - self.t0, 2), **record}) + "\n")

    def run(self) -> None:
        # every period_s from its own start (a grid slow to form must not be sampled in a burst
        # of catch-up samples); t_s stays relative to t0
        start, k = time.monotonic(), 0
        while not self.stop.wait(max(0.0, start + k * self.period_s - time.monotonic())):
            k += 1
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - one bad sample must not end the soak's record
                self.errors.append(traceback.format_exc(limit=3))

    def sample(self) -> None:
        for name, p in list(self.grid.joins.items()):
            if p.poll() is not None:
                continue
            tail = self.tails.setdefault(name, Tail(self.grid.out(name)))
            self.grid.remember(p.pid)
            tree = tree_sample(p.pid)
            if "cell" not in tree["roles"]:
                # the join is alive but its cell is not (starting, or exited a moment ago): a
                # sample of it would lack the cell's numbers; a gap row says so instead
                self.write({"kind": "gap", "peer": name, "why": "no cell process"})
                continue
            flat = {f"{k}_{r}": v for r, st in tree["roles"].items() for k, v in st.items()}
            age = time.monotonic() - self.grid.started[name]
            self.write(
                {
                    "kind": "sample",
                    "peer": name,
                    "age_s": round(age, 1),
                    **tree["total"],
                    **flat,
                    "sockets": len(tree["sockets"]),
                    **tail.read(),
                }
            )


def run_soak(out: Path, minutes: float, quick: bool) -> dict[str, Any]:
    """Run the soak (see the module docstring); returns the summary it wrote."""
    p = plan(minutes, quick)
    out.mkdir(parents=True, exist_ok=True)
    samples = out / "samples.jsonl"
    samples.unlink(missing_ok=True)
    (out / "error.txt").unlink(missing_ok=True)  # a failed run's, not this one's
    command = f"meshtrain bench soak --minutes {minutes:g}" + (" --quick" if quick else "")
    meta: dict[str, Any] = {"command": command, "plan": p, "completed": False, "error": None}
    with tempfile.TemporaryDirectory(prefix="mt-bench-soak-") as tmp:
        grid = LocalGrid(Path(tmp))
        sampler: Sampler | None = None
        try:
            horizon = max(100, round(minutes * SOAK_UPDATES_PER_MIN))
            # Shakespeare, not the tests' random words: their entropy floor is reached within
            # minutes, and the soak's loss must be able to fall for the whole hour
            cfg = tiny_grid_config(
                Path(tmp),
                None,
                local=SOAK_LOCAL,
                steps=SOAK_STEPS,
                d_model=SOAK_D_MODEL,
                seq_len=SOAK_SEQ_LEN,
                schedule_steps=horizon,
            )
            meta["schedule_steps"] = horizon
            with grid:
                t0 = time.monotonic()
                sampler = Sampler(grid, samples, p["sample_s"], t0)
                try:
                    form(grid, cfg)
                    meta["formed_s"] = round(time.monotonic() - t0, 1)
                    sampler.start()
                    soak_loop(grid, sampler, p)
                    meta["completed"] = True
                finally:  # before the grid closes: its record of processes is then final
                    sampler.finish()
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: report what we have
            record_failure(grid, meta, out, e)
        finally:
            if sampler is not None:
                meta["sampler_errors"] = sampler.errors
            meta["leftovers"] = grid.leftovers
            summary = write_reports(out, samples, meta)
    if meta["error"]:
        raise RuntimeError(f"bench soak: {meta['error']} (see {out}/error.txt)")
    return summary


def form(grid: LocalGrid, cfg: Path) -> None:
    """Four joins: the first brings the config, then three more; until every cell trains."""
    grid.join("p0", "--config", str(cfg))
    grid.wait_joined("p0", FORM_S)
    for name in ("p1", "p2", "p3"):
        grid.join(name)
    wait_for(
        lambda: all(_trains(grid, n) for n in ("p0", "p1", "p2", "p3")),
        FORM_S,
        "all four peers to train",
        0.5,
    )


def soak_loop(grid: LocalGrid, sampler: Sampler, p: dict[str, float]) -> None:
    """For duration_s from the grid's formation (a loaded box can take most of a short soak to
    form it: the kills are spaced over the time it trains): every kill_every_s, SIGKILL the
    peer in the next cell of CELLS and start a fresh join in its place; a progress bar over
    the minutes."""
    t0 = time.monotonic()
    end = t0 + p["duration_s"]
    kills, n_peers = 0, 4
    with tqdm(
        total=round(p["duration_s"] / 60, 1),
        desc="bench soak",
        unit="min",
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n:.1f}/{total} min [{elapsed}]",
    ) as bar:
        while time.monotonic() < end:
            bar.n = round((time.monotonic() - t0) / 60, 1)
            bar.refresh()
            if kills < p["kills"] and time.monotonic() >= t0 + (kills + 1) * p["kill_every_s"]:
                cell = CELLS[kills % len(CELLS)]
                victim = holder(grid, cell)
                if victim is None:
                    raise RuntimeError(f"no live peer holds {cell} at the kill")
                crash = grid.crash(victim)
                sampler.write({"kind": "kill", "peer": victim, "cell": cell, **crash})
                bar.write(
                    f"killed {victim} ({cell}); its helpers exited in {crash['helpers_exit_s']} s"
                )
                name = f"p{n_peers}"
                n_peers += 1
                took = replace(grid, name)
                sampler.write(
                    {
                        "kind": "replaced",
                        "peer": name,
                        "killed": victim,
                        "cell": Tail(grid.out(name)).read().get("cell"),
                        "join_to_training_s": took,
                    }
                )
                bar.write(f"{name} took {cell}'s place: training {took} s after its join")
                kills += 1
            time.sleep(0.5)
        bar.n = bar.total
        bar.refresh()
    exited = {n: q.returncode for n, q in grid.joins.items() if q.poll() is not None}
    crashed = {n: c for n, c in exited.items() if c != -9}
    if crashed:
        raise RuntimeError(f"peers exited on their own: {crashed}")


def holder(grid: LocalGrid, cell: str) -> str | None:
    """The live peer that trains `cell`, as its newest metrics file's name says (read here,
    not from the sampler's tails: a peer the sampler has not read yet still holds its cell)."""
    for name in grid.live():
        path = newest_metrics_file(grid.out(name))
        if path is not None and cell_name(*cell_of_file(path)) == cell:
            return name
    return None


def replace(grid: LocalGrid, name: str) -> float:
    """Start join `name` once the dead peer's claim expired (a join that finds the grid still
    full exits 2: tried again); seconds from the successful join's start to its first update."""
    time.sleep(CLAIM_LIVES_S)
    deadline = time.monotonic() + FORM_S
    while True:
        proc = grid.join(name)
        try:
            grid.wait_joined(name, FORM_S)
            break
        except RuntimeError:  # exited: a full grid is retried, anything else is a failure
            if proc.returncode != 2 or "no free cell" not in grid.log(name):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    wait_for(lambda: _trains(grid, name), FORM_S, f"{name} to train", 0.2)
    return round(time.monotonic() - grid.started[name], 2)


def _trains(grid: LocalGrid, name: str) -> bool:
    proc = grid.joins[name]
    if proc.poll() is not None:
        raise RuntimeError(f"{name} exited {proc.returncode}: {grid.log(name)[-1500:]}")
    return Tail(grid.out(name)).read().get("step", 0) >= 1
