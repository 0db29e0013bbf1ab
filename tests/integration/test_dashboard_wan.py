"""The dashboard of a WAN run: a grid joined over a DHT on 127.0.0.1 (`meshtrain dht` + four
`meshtrain join`s, as tests/integration/test_join.py forms it), watched with `meshtrain dashboard
--initial-peers` in a real browser: without the run key it refuses; with it every cell is shown
training, the loss chart has points, and a peer SIGKILLed turns dead within its claim's lifetime
(plus one DHT read); a screenshot is saved."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import browser
import pytest

from cli.status import READ_TIMEOUT_S
from mesh.bench.join_procs import (
    LOOPBACK,
    cell_of,
    kill,
    meshtrain,
    run_meshtrain,
    start_dht,
    stop,
    tiny_grid_config,
    wait_for,
)
from mesh.runtime.registry import HEARTBEAT_LIVES

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 120  # only hangs: four joins each start torch, hivemind and a p2pd on a 2-core box
HEARTBEAT_S = 1.0  # tiny_grid_config's elastic.heartbeat_s
CELLS = {"s0r0", "s1r0", "s0r1", "s1r1"}


def get_json(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(url, timeout=30).read())
    except urllib.error.HTTPError as e:  # 503: the DHT did not answer this time
        return json.loads(e.read())


def test_dashboard_of_a_joined_grid(text_file, tmp_path):
    browser.chromium()  # skip before starting anything when there is no browser
    cfg = tiny_grid_config(tmp_path, text_file, slowdown=4.0)  # less CPU: see test_join
    dht, maddr = start_dht()
    procs: dict[str, subprocess.Popen] = {}
    try:
        peers = ["--initial-peers", maddr]
        for n in range(4):
            log = (tmp_path / f"j{n}.log").open("w")
            first = ["--config", str(cfg)] if n == 0 else []
            procs[f"j{n}"] = meshtrain(
                "join", *peers, *LOOPBACK, "--out", str(tmp_path / f"j{n}"), *first,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            if n == 0:  # the others read the run's config from the DHT
                wait_for(lambda: (tmp_path / "j0" / "metrics").is_dir(), HANG_S, "j0 to run")
        # without the run key the dashboard shows nothing: one line, exit 2
        code, out, _ = run_meshtrain("dashboard", *peers, "--port", "0", key=None, timeout_s=HANG_S)
        assert code == 2 and "run key" in out and "Traceback" not in out, out
        procs["dash"] = dash = meshtrain(
            "dashboard", *peers, "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        line = dash.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        url = line.split()[1]
        api = url + "api/status"

        def all_training() -> bool:
            d = get_json(api)
            states = {c["cell"]: c["state"] for c in d.get("cells", [])}
            points = sum(len(v) for v in d.get("curves", {}).get("train", {}).values())
            return states == dict.fromkeys(CELLS, "training") and points >= 2

        wait_for(all_training, HANG_S, "every cell training on the dashboard")
        page = browser.look(url)
        assert set(page.cells) == CELLS, page.cells
        assert set(page.cells.values()) <= {"training", "waiting"}, page.cells
        assert page.loss_points and page.loss_points >= 2
        d = get_json(api)
        assert d["run"]["fingerprint"] and d["grid"] == "2x2" and d["run_key"] == "ok"
        assert all(c["rounds"] is not None and c["verified"] for c in d["cells"])

        victim = next(n for n in procs if n != "dash" and cell_of(tmp_path / n) == (1, 1))
        os.killpg(procs[victim].pid, signal.SIGKILL)
        killed_at = time.time()
        procs[victim].wait(10)
        dead_at: list[float] = []

        def dead() -> bool:
            d = get_json(api)
            if {c["cell"]: c["state"] for c in d.get("cells", [])}.get("s1r1") == "dead":
                dead_at.append(d["now"])
            return bool(dead_at)

        wait_for(dead, HANG_S, "the killed peer's cell to show dead", period_s=0.2)
        assert dead_at[0] - killed_at <= HEARTBEAT_LIVES * HEARTBEAT_S + READ_TIMEOUT_S
        page = browser.look(url)
        assert page.cells["s1r1"] == "dead" and len(page.cells) == 4, page.cells
        shot = browser.screenshot(url, browser.shots_dir(tmp_path) / "dashboard-wan.png")
        assert shot.stat().st_size > 10_000
    finally:
        for p in [*procs.values(), dht]:  # a clean stop first: p2pd reaped, sockets removed
            with contextlib.suppress(Exception):
                stop(p, timeout_s=20)
            kill(p)
