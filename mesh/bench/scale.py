"""`meshtrain bench scale`: 32 joined peers (an 8x4 grid) on one box over one bootstrap.

Real `meshtrain dht` + 32 `meshtrain join` processes on 127.0.0.1 (mesh/bench/grid.py), each a
cell of a tiny model with emulated compute (emulation.compute = "emulated": forward and backward
sleep FORWARD_MS / BACKWARD_MS, real payloads cross the links; one torch thread), so the box
runs the protocol, not the math. Measured:
- time_to_all_training_s: from the first join's start (the others start together once it put
  the run's config in the DHT) until every cell wrote its first update;
- status latency: wall time of `meshtrain status --json` (a fresh process: imports, a DHT node
  joining, the reads), three times once the grid trains;
- DHT records and bytes per peer per minute over a steady window: each cell's own DHT calls
  as its health rows count them (comms.p2p.dht.DhtCounts: stores and their MSGPack value
  bytes; gets, the records they returned and those records' bytes). hivemind's routing,
  replication and pings inside the DHT process are not counted;
- share of averaging rounds complete: applied / (applied + partial + failed) from the cells'
  cumulative counters, over the same window (and over the whole run, formation included).
Progress lines go to OUT/progress.jsonl as they happen; summary.json, table.md and scale.png at
the end, also after a failure (mesh/bench/scale_report.py).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mesh.algo.topology import cell_name
from mesh.bench.grid import LocalGrid, record_failure
from mesh.bench.scale_report import write_reports
from mesh.config import ConfigError
from mesh.runtime.metrics import read_metrics
from mesh.runtime.session import REJOIN_NOTE
from mesh.testing.local_peers import KEY, generated_text, run_meshtrain, tiny_grid_config
from mesh.testing.procstat import tree_sample

TRAIN_WAIT_S = 600  # all cells not training by then: reported as missed, measured on anyway
# 32 claims beating every second, each beat reading all claims, swamp a loaded 2-core box's
# DHT: replicas then see their cells come and go and (elastic.rejoin_timeout_s, 120 s by
# default) give up forming. A claim lives 4 beats either way.
HEARTBEAT_S = 2.0
STAGGER_S = 0.5  # between join starts: 31 interpreters importing torch at once only thrash
# Emulated compute per microbatch per stage. A real cell of a WAN grid runs a few microbatches
# a second (a 1B model's activations of 8 x 1024 tokens are 32 MB: seconds on a 100 Mbit/s
# link); this box hosts 32 cells on 2 cores, 1/16 core each, and a cell's protocol work grows
# with its microbatch rate (per cell, --quick: 0.12 core at 10 / 20 ms, 0.03 at 60 / 120 ms).
# At 100 / 200 ms a cell runs ~3 microbatches a second: still at or above a WAN grid's rate.
FORWARD_MS, BACKWARD_MS = 100.0, 200.0
# The joins use the DHT as clients of the one `meshtrain dht` node. As 32 DHT servers (the
# default), their DHT processes took 1.2 cores and their p2pd 0.7 of this box's 2 before any
# cell trained (cells: 0.1), each get fanned out over several loaded nodes, and reads came back
# partial: members seen as free, replicas forming and breaking for minutes (results/scale).
DHT_MODE = "client"
JOIN_TRIES = 6  # starts of one join after its first
PEER_MB = 500  # what one peer needs (PSS of cell + DHT process + p2pd: 407-480 MB here)


def scale_config(directory: Path, text_file: Path, stages: int, replicas: int) -> Path:
    return tiny_grid_config(
        directory,
        text_file,
        replicas,
        local=f'emulation.compute = "emulated"\nelastic.rejoin_timeout_s = {TRAIN_WAIT_S}\n'
        f"emulation.forward_ms = {FORWARD_MS}\nemulation.backward_ms = {BACKWARD_MS}\n"
        f'transport.dht_mode = "{DHT_MODE}"',
        steps=10_000_000,
        stages=stages,
        heartbeat_s=HEARTBEAT_S,
        round_timeout_s=10,
    )


def run_scale(out: Path, quick: bool) -> dict[str, Any]:
    stages, replicas = (4, 2) if quick else (8, 4)
    window_s = 20.0 if quick else 120.0
    need_mb = stages * replicas * PEER_MB
    if available_mb() < need_mb:
        raise ConfigError(
            f"bench scale: {stages * replicas} peers need about {need_mb} MB and this machine "
            f"has {available_mb()} MB available; free memory or use --quick"
        )
    out.mkdir(parents=True, exist_ok=True)
    progress = out / "progress.jsonl"
    progress.unlink(missing_ok=True)
    (out / "error.txt").unlink(missing_ok=True)  # a failed run's, not this one's
    meta: dict[str, Any] = {
        "command": "meshtrain bench scale" + (" --quick" if quick else ""),
        "grid": f"{stages}x{replicas}",
        "peers": stages * replicas,
        "window_s": window_s,
        "completed": False,
        "error": None,
    }
    t0 = time.monotonic()

    def note(**record: Any) -> None:
        with progress.open("a") as f:
            f.write(json.dumps({"t_s": round(time.monotonic() - t0, 2), **record}) + "\n")

    with tempfile.TemporaryDirectory(prefix="mt-bench-scale-") as tmp:
        grid = LocalGrid(Path(tmp))
        try:
            text = Path(tmp) / "text.txt"
            text.write_text(generated_text(60_000))
            cfg = scale_config(Path(tmp), text, stages, replicas)
            meta["config"] = cfg.read_text()
            with grid:
                t0 = time.monotonic()
                meta.update(form(grid, cfg, meta["peers"], note))
                meta["status"] = status_latency(grid.maddr, note, runs=1 if quick else 3)
                meta.update(steady_window(grid, window_s, note))
                meta["resources"] = resources(grid)
                meta["completed"] = True
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt too: report what we have
            record_failure(grid, meta, out, e)
        finally:
            meta["leftovers"] = grid.leftovers
            summary = write_reports(out, meta)
    if meta["error"]:
        raise RuntimeError(f"bench scale: {meta['error']} (see {out}/error.txt)")
    return summary


def form(grid: LocalGrid, cfg: Path, n: int, note: Any) -> dict[str, Any]:
    """The first join with the config, then n-1 more STAGGER_S apart; when each cell first
    updated. A join that gave up on start-up (p2pd not up within join's scout timeout on a box
    this loaded, the DHT not answering its claim or reading the run's record as absent, or no
    cell free yet) is started again, as a user would, and counted; its time runs from its
    first start."""
    t0 = time.monotonic()
    grid.join("p00", "--config", str(cfg))
    grid.wait_joined("p00", TRAIN_WAIT_S)
    note(event="config_in_dht", s=round(time.monotonic() - t0, 2))
    names = [f"p{k:02d}" for k in range(n)]
    for name in names[1:]:
        grid.join(name)
        time.sleep(STAGGER_S)
    began = dict(grid.started)
    retries: dict[str, list[str]] = {}
    first: dict[str, float] = {}
    cells: dict[str, str] = {}
    deadline = t0 + TRAIN_WAIT_S
    with tqdm(total=n, desc="bench scale: cells training", unit="cell", dynamic_ncols=True) as bar:
        while len(first) < n and time.monotonic() < deadline:
            for name in names:
                if name in first:
                    continue
                proc = grid.joins[name]
                if proc.poll() is not None:
                    why = _retryable(proc.returncode, grid.log(name))
                    if why is None or len(retries.get(name, [])) >= JOIN_TRIES:
                        raise RuntimeError(
                            f"{name} exited {proc.returncode}: {grid.log(name)[-1500:]}"
                        )
                    retries.setdefault(name, []).append(why)
                    note(event="join_retry", peer=name, why=why)
                    grid.join(name)
                    continue
                cell, step = _progress(grid.out(name))
                if step >= 1:
                    first[name], cells[name] = time.monotonic(), cell
                    note(
                        event="training",
                        peer=name,
                        cell=cell,
                        join_to_training_s=round(first[name] - began[name], 2),
                    )
                    bar.update(1)
            time.sleep(1.0)
    missing = sorted(set(names) - set(first))
    # joins that lost their cell and started over by themselves (no exit: the bench's retries
    # above do not see them), from their logs
    restarts = {n: grid.log(n).count(REJOIN_NOTE) for n in names}
    return {
        "time_to_all_training_s": None if missing else round(max(first.values()) - t0, 2),
        "not_training": missing,
        "join_to_training_s": {n: round(first[n] - began[n], 2) for n in first},
        "join_retries": retries,
        "join_self_restarts": {n: k for n, k in restarts.items() if k},
        "cells": cells,
    }


def _retryable(code: int | None, log: str) -> str | None:
    """Why a join that exited may simply be started again (None: it may not)."""
    if code != 2:
        return None
    if "could not reach the DHT" in log:
        return "p2pd or the DHT not up within the scout's timeout"
    if "no run found in the DHT" in log:  # the run's record exists: the read came back empty
        return "the DHT read of the run's record came back empty"
    if "the DHT does not answer" in log:
        return "the DHT did not answer the claim"
    if "no free cell" in log:
        return "no free cell yet"
    if "lost a cell" in log:  # a join starts over by itself a few times first
        return "lost its cell to an earlier claim"
    return None


def _current_rows(run_dir: Path) -> tuple[str, list[dict[str, Any]]]:
    """The cell a join holds now and its metrics rows: its newest metrics file (a join that
    lost its cell and was started again holds another one; the old file stays)."""
    files = sorted((run_dir / "metrics").glob("*.jsonl"), key=lambda f: f.stat().st_mtime)
    if not files:
        return "", []
    stage, replica = (int(x) for x in files[-1].stem.split("-"))
    rows = read_metrics(run_dir, events=True).get((stage, replica), [])
    return cell_name(stage, replica), rows


def _progress(run_dir: Path) -> tuple[str, int]:
    cell, rows = _current_rows(run_dir)
    return cell, max((r["step"] for r in rows if "event" not in r), default=0)


def status_latency(maddr: str, note: Any, runs: int = 3) -> dict[str, Any]:
    """`meshtrain status --json`, `runs` times: seconds each, and the cells it listed."""
    took, listed, failed = [], [], []
    for _ in range(runs):
        code, text, s = run_meshtrain(
            "status", "--initial-peers", maddr, "--json", key=KEY, timeout_s=120
        )
        if code != 0:  # an answer too (p2pd not up in time on a loaded box): said, not fatal
            failed.append(f"exit {code} after {s:.1f} s: {text.strip().splitlines()[-1][:200]}")
            note(event="status_failed", s=round(s, 2), why=failed[-1])
            continue
        took.append(round(s, 2))
        listed.append(len(json.loads(text[text.index("{") :])["cells"]))
        note(event="status", s=took[-1], cells=listed[-1])
    median = statistics.median(took) if took else None
    return {"runs_s": took, "median_s": median, "cells_listed": listed, "failed": failed}


def _health_and_rounds(grid: LocalGrid) -> dict[str, dict[str, Any]]:
    """Per peer: its last health row and the rounds counters of its last update row."""
    out = {}
    for name in grid.joins:
        _, rows = _current_rows(grid.out(name))
        health = next((r for r in reversed(rows) if r.get("event") == "health"), None)
        last = next((r for r in reversed(rows) if "event" not in r and "step" in r), {})
        out[name] = {
            "health": health,
            "rounds": {k: last.get(f"rounds_{k}", 0) for k in ("applied", "partial", "failed")},
        }
    return out


def steady_window(grid: LocalGrid, window_s: float, note: Any) -> dict[str, Any]:
    """DHT calls and rounds over window_s of a grid that trains (counter differences)."""
    a = _health_and_rounds(grid)
    note(event="window_start")
    time.sleep(window_s)
    dead = {n: p.returncode for n, p in grid.joins.items() if p.poll() is not None}
    if dead:
        raise RuntimeError(f"peers exited during the window: {dead}")
    b = _health_and_rounds(grid)
    note(event="window_end")
    dht: dict[str, dict[str, float]] = {}
    rounds = {"applied": 0, "partial": 0, "failed": 0}
    whole = dict(rounds)
    threads = []
    for name in grid.joins:
        ha, hb = a[name]["health"], b[name]["health"]
        for k in rounds:
            rounds[k] += b[name]["rounds"][k] - a[name]["rounds"][k]
            whole[k] += b[name]["rounds"][k]
        if hb is not None:
            threads.append((hb["threads"], hb.get("torch_threads")))
        if ha is None or hb is None or "dht" not in hb or hb["unix_s"] <= ha["unix_s"]:
            continue
        minutes = (hb["unix_s"] - ha["unix_s"]) / 60
        dht[name] = {k: round((hb["dht"][k] - ha["dht"][k]) / minutes, 1) for k in hb["dht"]}
    return {
        "dht_per_peer_per_min": dht,
        "rounds_window": rounds,
        "rounds_whole_run": whole,
        "cell_threads": [t for t, _ in threads],
        "torch_threads": sorted({t for _, t in threads if t is not None}),
    }


def resources(grid: LocalGrid) -> dict[str, Any]:
    """PSS and RSS of every peer's tree now (MB), and the box's memory."""
    pss, rss = [], []
    for p in grid.live().values():
        total = tree_sample(p.pid)["total"]
        pss.append(total["pss_mb"])
        rss.append(total["rss_mb"])
    return {
        "pss_mb_per_peer_median": round(statistics.median(pss), 1) if pss else None,
        "pss_mb_all_peers": round(sum(pss), 1),
        "rss_mb_per_peer_median": round(statistics.median(rss), 1) if rss else None,
        "mem_available_mb": available_mb(),
    }


def available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0
