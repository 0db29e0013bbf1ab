"""`meshtrain bench nat`: peers behind NAT, direct against relayed, in network namespaces.

Root, iproute2 and nftables only (comms.natns). Two measurements:
- streams (mesh/bench/nat_probe.py): from a home behind NAT, a 4 KiB message answered by one
  byte (a cell's send and its ack), round-trip time p50 and p90, then BULK_MIB on one stream:
  direct to a public peer, and relayed to a peer in another home through a public relay; and
  the same relayed transfer through a relay that is not forced public (go-libp2p's default
  relay service, whose 128 KiB per connection p2pd's -relayDataLimit does not change);
- how often a forced-public p2pd's relay service is go-libp2p's default one (RACE_STARTS
  starts without comms/p2p/relay_service.py's check);
- the grid (mesh/bench/nat_grid.py): replica 0 public cells, replica 1 two cells in two homes
  that reach each other only through a relay. Updates a second per cell over WINDOW_S: with
  p2pd's default relay limits (30 min, 4 GiB), with go-libp2p's default relay's (2 min,
  128 KiB: what relays served before the check, and always on private addresses), and with
  BURNERS busy processes beside it (a loaded 2-core box).
Writes summary.json (every number, the load average, the machine) and table.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from comms.natns import PUBLIC_ADDR, nat_homes
from comms.p2p.relay_service import DEFAULT_LIMIT
from mesh.bench import nat_probe
from mesh.bench.nat_grid import nat_grid
from mesh.report import format_table
from mesh.testing.local_peers import generated_text, kill, rows, wait_for

BULK_MIB = 16
RESET_PROBE_MIB = 1  # through the default relay: more than its 128 KiB
WINDOW_S, SETTLE_S = 30.0, 15.0
BURNERS = 2
RACE_STARTS = 8
PROBE_WAIT_S = 180


def _probe(label: str, args: list[str], topo: Any, ns: str, d: Path) -> subprocess.Popen:
    """`python -m mesh.bench.nat_probe ARGS` in namespace ns, its output in d/LABEL.log."""
    cmd = topo.cmd(ns, sys.executable, "-m", "mesh.bench.nat_probe", *args)
    log = (d / f"{label}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stream_round(d: Path, default_relay: bool) -> dict[str, Any]:
    """One relay in the public namespace, servers in it and in home 0, the client in home 1;
    their files and logs in d."""
    d.mkdir(parents=True, exist_ok=True)
    with nat_homes(2) as topo:
        h0, h1 = topo.home_addrs
        relay = ["relay", str(d), PUBLIC_ADDR] + (["--default-relay"] if default_relay else [])
        procs = [_probe("relay", relay, topo, topo.public, d)]
        try:
            home0 = ["server", str(d), "home0", h0, "--nat"]
            procs.append(_probe("home0", home0, topo, topo.homes[0], d))
            names = ["home0"]
            if not default_relay:
                public = ["server", str(d), "public", PUBLIC_ADDR]
                procs.append(_probe("public", public, topo, topo.public, d))
                names.insert(0, "public")
            bulk = (RESET_PROBE_MIB if default_relay else BULK_MIB) << 20
            args = ["client", str(d), h1, str(bulk), *names]
            if default_relay:  # the echo stream alone would pass 128 KiB: the bulk only
                args.append("--no-rtt")
            client = _probe("client", args, topo, topo.homes[1], d)
            procs.append(client)
            done = d / "client.json"
            deadline = time.monotonic() + PROBE_WAIT_S
            while not done.exists() and client.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if not done.exists():
                log = (d / "client.log").read_text()[-800:]
                raise RuntimeError(f"the probe client wrote no results: {log}")
            results = json.loads(done.read_text())
            sink = d / "home0.sink.jsonl"
            with contextlib.suppress(AssertionError):  # the server notes a reset a moment later
                wait_for(sink.exists, 10, "the server's note of the transfer")
            got = [json.loads(x) for x in sink.read_text().splitlines()] if sink.exists() else []
            results["home0"]["relayed_bytes_arrived"] = got[-1]["got"] if got else None
            return results
        finally:
            for p in procs:
                kill(p)


def race_round(d: Path, starts: int = RACE_STARTS) -> dict[str, Any]:
    """A forced-public p2pd started `starts` times without the relay-service check: how often
    go-libp2p's default relay service is the one answering (comms/p2p/relay_service.py)."""
    d.mkdir(parents=True, exist_ok=True)
    with nat_homes(1) as topo:
        cmd = topo.cmd(
            topo.public,
            sys.executable,
            "-m",
            "mesh.bench.nat_probe",
            "race",
            str(d),
            PUBLIC_ADDR,
            str(starts),
        )
        subprocess.run(cmd, check=True, timeout=PROBE_WAIT_S, capture_output=True)
    answers = [tuple(a) if a else None for a in json.loads((d / "race.json").read_text())]
    return {
        "starts": starts,
        "asked": list(nat_probe.RACE_LIMITS),
        "default_answered": sum(a == DEFAULT_LIMIT for a in answers),
        "ours_answered": sum(a == nat_probe.RACE_LIMITS for a in answers),
        "answers": answers,
    }


def _cell_rates(out: Path, t0: float, t1: float) -> dict[str, float]:
    """Updates a second and pipeline bytes a second of a cell between its rows' times t0, t1."""
    steps = [r for r in rows(out) if "event" not in r and "step" in r]
    a = min((r for r in steps if r["time_s"] >= t0), key=lambda r: r["time_s"])
    b = max((r for r in steps if r["time_s"] <= t1), key=lambda r: r["time_s"])
    dt = max(1e-9, b["time_s"] - a["time_s"])
    pipe = sum(
        b["bytes_sent"].get(k, 0) - a["bytes_sent"].get(k, 0) for k in ("activation", "gradient")
    )
    return {
        "updates_per_s": round((b["step"] - a["step"]) / dt, 1),
        "pipeline_kb_per_s": round(pipe / dt / 1e3, 1),
        "window_s": round(dt, 1),
    }


def grid_round(
    text: Path, burners: int, relay_mib: float = 4096.0, relay_s: float = 1800.0
) -> dict[str, Any]:
    """The NAT grid trained WINDOW_S (after SETTLE_S), with `burners` busy processes beside,
    every relay resetting a relayed connection after relay_mib each way or relay_s."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        with tempfile.TemporaryDirectory(prefix="nat-grid-") as tmp:
            d = Path(tmp)
            (d / "text.txt").write_text(text.read_text())
            with nat_grid(d, d / "text.txt", relay_s, relay_mib) as grid:
                time.sleep(SETTLE_S)
                load0 = os.getloadavg()[0]
                cells_ = ("s0r0", "s1r0", "s0r1", "s1r1")
                ends = {c: rows(grid.out(c))[-1]["time_s"] for c in cells_}  # each its own clock
                time.sleep(WINDOW_S)
                load1 = os.getloadavg()[0]
                cells = {}
                for cell in cells_:
                    cells[cell] = _cell_rates(grid.out(cell), ends[cell], ends[cell] + WINDOW_S)
                    cells[cell]["path"] = "relayed" if cell.endswith("r1") else "direct"
                via = [r.get("relayed_via") for r in grid.health("s0r1")][-1:]
        return {
            "burners": burners,
            "relay_limit": [relay_s, relay_mib],
            "load_avg_1min": [round(load0, 1), round(load1, 1)],
            "cells": cells,
            "s0r1_relayed_via": via[0] if via else None,
        }
    finally:
        for p in spin:
            p.send_signal(signal.SIGKILL)
            p.wait()


def run_nat_bench(out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nat-bench-"))  # the probes' files and logs, the text
    text = work / "text.txt"
    text.write_text(generated_text(60_000))
    try:
        summary: dict[str, Any] = {
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "streams": stream_round(work / "streams", default_relay=False),
            "default_relay": stream_round(work / "default_relay", default_relay=True),
            "relay_race": race_round(work / "race"),
            "grid": [
                grid_round(text, 0),
                # go-libp2p's default relay service's limits, as p2pd served before the check
                grid_round(text, 0, DEFAULT_LIMIT[1] / 2**20, DEFAULT_LIMIT[0]),
                grid_round(text, BURNERS),
            ],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(summary))
    return summary


def table(summary: dict[str, Any]) -> str:
    s, dflt = summary["streams"], summary["default_relay"]["home0"]
    lines = ["Streams from a home behind NAT (4 KiB message + 1-byte ack; one stream):", ""]
    lines += format_table(
        ["path", "RTT p50 ms", "RTT p90 ms", f"{BULK_MIB} MiB, Mbit/s"],
        [
            [
                "direct (to a public peer)",
                s["public"]["rtt_ms_p50"],
                s["public"]["rtt_ms_p90"],
                s["public"].get("bulk_mbit_s", s["public"].get("bulk_error")),
            ],
            [
                "relayed (to another home)",
                s["home0"]["rtt_ms_p50"],
                s["home0"]["rtt_ms_p90"],
                s["home0"].get("bulk_mbit_s", s["home0"].get("bulk_error")),
            ],
        ],
    ).splitlines()
    race = summary["relay_race"]
    lines += [
        "",
        f"Through a relay not forced public (go-libp2p's default relay): "
        f"{dflt['relayed_bytes_arrived']} of {RESET_PROBE_MIB << 20} bytes arrived "
        f"({dflt.get('bulk_error', 'no reset')}).",
        f"A forced-public p2pd started {race['starts']} times without the check: the "
        f"default relay service answered {race['default_answered']} times, "
        f"p2pd's configured one {race['ours_answered']}.",
        "",
        f"The grid (2x2 tiny model, replica 1 in two homes), updates/s over {WINDOW_S:.0f} s:",
        "",
    ]
    body = []
    for g in summary["grid"]:
        c = g["cells"]
        direct = (c["s0r0"]["updates_per_s"] + c["s1r0"]["updates_per_s"]) / 2
        relayed = (c["s0r1"]["updates_per_s"] + c["s1r1"]["updates_per_s"]) / 2
        limit = "30 min, 4 GiB" if g["relay_limit"][1] >= 4096 else "2 min, 128 KiB"
        body.append(
            [
                f"{g['burners']} busy processes beside",
                limit,
                f"{g['load_avg_1min'][1]}",
                f"{direct:.1f}",
                f"{relayed:.1f}",
                f"{direct / relayed:.1f}" if relayed else "inf",
            ]
        )
    lines += format_table(
        ["box", "relay limit", "load avg", "replica 0 (direct)", "replica 1 (relayed)", "ratio"],
        body,
    ).splitlines()
    return "\n".join(lines) + "\n"
