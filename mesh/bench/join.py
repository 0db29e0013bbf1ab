"""`meshtrain bench join`: how long a grid formed by `join`s takes to train, recover and fail.

Real `meshtrain dht` and `meshtrain join` processes on 127.0.0.1 (a 2x2 grid of a tiny model on
a generated text file, so no corpus is needed), the flow of tests/integration/test_join.py. Each
repeat starts a fresh grid and times (wall clock, polling the metrics files every 0.1 s):
- join_to_training_s: from a join process's start to the first update in its metrics file, for
  the three joins started together once the first join has put the run's config in the DHT
  (the first join's own time is mostly waiting for them, so it is left out);
- replacement_to_resumed_s: the stage-1 peer of replica 1 SIGKILLed, its claim expired and its
  stage-0 partner stalled: from a new join's start until that partner updates again (the new
  peer has claimed the cell, downloaded its stage's state and re-formed the pipeline);
- dead_bootstrap_to_error_s: the bootstrap node stopped while the grid trains: a join naming
  only it, from its start to its exit with code 2 and a one-line error.
Writes summary.json (every value, median/min/max, the machine) and table.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mesh.report import format_table
from mesh.testing.local_peers import (
    LOOPBACK,
    cell_of,
    generated_text,
    kill,
    meshtrain,
    run_meshtrain,
    start_dht,
    status,
    step,
    stop,
    tiny_grid_config,
    wait_for,
)

MEASURES = {
    "join_to_training_s": ("join to training", "a join's start to its first update (3 per grid)"),
    "replacement_to_resumed_s": (
        "replacement to resumed",
        "a new join's start, after a peer was killed, to its replica's next update",
    ),
    "dead_bootstrap_to_error_s": (
        "dead bootstrap to error",
        "a join naming only a stopped bootstrap: start to exit 2",
    ),
}
WAIT_S = 120  # a step that takes longer than this is a failure, not a slow measurement
POLL_S = 0.1


def run_join_bench(out: Path, repeats: int = 3) -> dict[str, Any]:
    """Run `repeats` grids, write out/summary.json and out/table.md, return the summary."""
    machine = machine_info()
    per_repeat = []
    for _ in tqdm(range(repeats), desc="bench join", unit="grid", dynamic_ncols=True):
        with tempfile.TemporaryDirectory(prefix="mt-bench-join-") as tmp:
            per_repeat.append(one_grid(Path(tmp)))
    summary = {
        "command": f"meshtrain bench join --repeats {repeats}",
        "grid": "2x2, 2 layers, d_model 16, seq_len 16, heartbeat 1 s",
        "machine": machine,
        "repeats": per_repeat,
        "stats": {name: describe(values_of(per_repeat, name)) for name in MEASURES},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = to_markdown(summary)
    (out / "table.md").write_text(table)
    print(table, end="")
    return summary


def one_grid(tmp: Path) -> dict[str, Any]:
    """One grid from scratch: the three timings of the module docstring."""
    text = tmp / "text.txt"
    text.write_text(generated_text(60_000))
    cfg = tiny_grid_config(tmp, text)
    dht, maddr = start_dht()
    joins: dict[str, subprocess.Popen] = {}
    started: dict[str, float] = {}

    def join(name: str, *extra: str) -> None:
        log = (tmp / f"{name}.log").open("w")
        started[name] = time.monotonic()
        joins[name] = meshtrain(
            "join",
            "--initial-peers",
            maddr,
            *LOOPBACK,
            "--out",
            str(tmp / name),
            *extra,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    try:
        join("j0", "--config", str(cfg))
        wait_for(lambda: "joined run" in _log(tmp, "j0"), WAIT_S, "the first join", POLL_S)
        for name in ("j1", "j2", "j3"):
            join(name)
        first = _first_updates(tmp, started, ["j0", "j1", "j2", "j3"])
        result: dict[str, Any] = {
            "join_to_training_s": [round(first[n] - started[n], 2) for n in ("j1", "j2", "j3")]
        }
        cells = {n: cell_of(tmp / n) for n in joins}
        victim = next(n for n, c in cells.items() if c == (1, 1))
        partner = next(n for n, c in cells.items() if c == (0, 1))
        survivor = next(n for n, c in cells.items() if c == (1, 0))
        kill(joins[victim])
        wait_for(lambda: "s1r1" in status(maddr)["free"], WAIT_S, "the claim to expire")
        stalled = _wait_stalled(tmp / partner, quiet_s=2.0)
        join("j4")
        wait_for(lambda: step(tmp / partner) > stalled, WAIT_S, "the replica to resume", POLL_S)
        result["replacement_to_resumed_s"] = round(time.monotonic() - started["j4"], 2)
        if cell_of(tmp / "j4") != (1, 1):
            raise RuntimeError(f"the replacement took {cell_of(tmp / 'j4')}, not s1r1")
        stop(dht)
        at_stop = step(tmp / survivor)
        wait_for(lambda: step(tmp / survivor) >= at_stop + 10, WAIT_S, "training on", POLL_S)
        code, out, took = run_meshtrain(
            "join", "--initial-peers", maddr, *LOOPBACK, timeout_s=WAIT_S
        )
        if code != 2 or "DHT" not in out:
            raise RuntimeError(f"a join naming a dead bootstrap exited {code}: {out[-2000:]}")
        result["dead_bootstrap_to_error_s"] = round(took, 2)
        return result
    except Exception as e:
        logs = "\n".join(f"--- {n}.log\n{_log(tmp, n)[-1500:]}" for n in joins)
        raise RuntimeError(f"bench join: {e}\n{logs}") from e
    finally:
        for p in joins.values():  # ask all first: they stop in parallel
            if p.poll() is None:
                p.terminate()
        for p in [*joins.values(), dht]:
            stop(p)


def _log(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _first_updates(tmp: Path, started: dict[str, float], names: list[str]) -> dict[str, float]:
    """When each join's first update was seen (time.monotonic)."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + WAIT_S
    while len(seen) < len(names):
        if time.monotonic() > deadline:
            missing = [n for n in names if n not in seen]
            raise AssertionError(f"no update from {missing} within {WAIT_S} s")
        for n in names:
            if n not in seen and step(tmp / n) >= 1:
                seen[n] = time.monotonic()
        time.sleep(POLL_S)
    return seen


def _wait_stalled(out: Path, quiet_s: float) -> int:
    """Wait until the cell in `out` made no update for quiet_s; its step then."""
    last, since = step(out), time.monotonic()
    deadline = since + WAIT_S
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"{out.name} kept training without its partner")
        time.sleep(POLL_S)
        now = step(out)
        if now != last:
            last, since = now, time.monotonic()
    return last


def values_of(per_repeat: list[dict[str, Any]], name: str) -> list[float]:
    """Every value of one measure over the repeats (a list per repeat or a single value)."""
    out: list[float] = []
    for r in per_repeat:
        v = r[name]
        out += v if isinstance(v, list) else [v]
    return out


def describe(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "median": round(statistics.median(values), 2),
        "min": min(values),
        "max": max(values),
    }


def machine_info() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "load_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": version("torch"),
        "hivemind": version("hivemind"),
    }


def to_markdown(summary: dict[str, Any]) -> str:
    rows = []
    for name, (label, what) in MEASURES.items():
        s = summary["stats"][name]
        rows.append(
            [label, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}", s["n"], what]
        )
    table = format_table(["measure", "median s", "min s", "max s", "n", "from - to"], rows)
    m = summary["machine"]
    return (
        f"{table}\n\n{summary['grid']}; {m['cores']} cores (1-min load {m['load_1m_at_start']} "
        f"at start), Python {m['python']}, torch {m['torch']}, hivemind {m['hivemind']}; "
        f"`{summary['command']}`\n"
    )
