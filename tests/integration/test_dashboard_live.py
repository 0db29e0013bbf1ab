"""A running `meshtrain simulate --backend hivemind` grid (a killed cell does not stop it)
watched the ways issue #17 offers, in order on one grid (its start-up is paid once): Prometheus
scraped from each cell while it trains, the dashboard page in a real browser (every cell shown,
the loss chart drawn, a SIGKILLed cell dead within its heartbeat timeout, a screenshot), then
TensorBoard's event files read back after a clean stop. Each exporter's numbers are checked
against the cell's JSONL rows, the record."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import browser
import helpers
import pytest

from mesh.runtime.metrics import read_metrics
from mesh.runtime.registry import HEARTBEAT_LIVES
from mesh.testing.local_peers import kill, meshtrain, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 120  # only hangs: a loaded 2-core box starts four torch processes slowly
HEARTBEAT_S = 1.0
P, M = 2, 2


def free_port_block(n: int) -> int:
    """A base port with n free ports above it on 127.0.0.1 (checked by binding them)."""
    for base in range(31000, 60000, 97):
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no block of free ports")


def get_json(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=30).read())


@pytest.fixture(scope="module")
def grid(tmp_path_factory, text_file):
    d = tmp_path_factory.mktemp("live")
    run_dir, base = d / "run", free_port_block(P * M)
    sets = [
        *helpers.TINY,
        f"data.path='{text_file}'",
        "metrics.tensorboard=true",
        f"metrics.prometheus_port={base}",
        f"elastic.heartbeat_s={HEARTBEAT_S}",
        "transport.recv_timeout_s=300",
        "checkpoint.every=0",
    ]
    log = (d / "simulate.log").open("w")
    sim = meshtrain(
        "simulate",
        "--grid",
        f"{P}x{M}",
        "--steps",
        "1000000",
        "--backend",
        "hivemind",
        "--out",
        str(run_dir),
        *(a for s in sets for a in ("--set", s)),
        key=None,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    procs = [sim]
    try:
        wait_for(lambda: (run_dir / "config.toml").is_file(), HANG_S, "simulate to start")
        dash = meshtrain(
            "dashboard",
            "--run",
            str(run_dir),
            "--port",
            "0",
            key=None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(dash)
        line = dash.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        url = line.split()[1]
        wait_for(
            lambda: sum(c["step"] >= 3 for c in get_json(url + "api/status")["cells"]) == P * M,
            HANG_S,
            "every cell training",
        )
        yield {"dir": run_dir, "url": url, "base": base, "sim": sim, "shots": d}
    finally:
        for p in procs:
            kill(p)


def _families(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _steps(run_dir, cell) -> list[int]:
    return sorted(r["step"] for r in read_metrics(run_dir)[cell])


def test_prometheus_serves_each_cell_while_it_trains(grid):
    for i in range(M):
        for j in range(P):
            before = _steps(grid["dir"], (j, i))
            fams = _families(grid["base"] + i * P + j)
            after = _steps(grid["dir"], (j, i))
            (sample,) = fams["meshtrain_step"].samples
            assert sample.labels == {"cell": f"s{j}r{i}"}
            # a row is written to the file, then exported (MetricsSink.write): the scrape shows
            # a row the file had by the second read, and at most one row older than the file's
            # newest at the first (that one may have been written but not yet exported)
            assert sample.value in after
            assert sample.value >= (before[-2] if len(before) > 1 else before[-1])
            kinds = {s.labels["kind"] for s in fams["meshtrain_bytes_sent"].samples}
            assert kinds, "no bytes sent exported"
            results = {s.labels["result"] for s in fams["meshtrain_rounds"].samples}
            assert results == {"started", "applied", "partial", "failed"}
            assert "meshtrain_lr_scale" in fams and "meshtrain_grad_norm" in fams
            if j == P - 1:
                rows = {r["step"]: r for r in read_metrics(grid["dir"])[(j, i)]}
                (loss,) = fams["meshtrain_loss"].samples
                step = int(sample.value)
                if step in rows:  # the scrape's step and loss belong to one row
                    assert loss.value == pytest.approx(rows[step]["loss"])


def test_browser_shows_the_grid_and_a_killed_cell_dead(grid):
    url = grid["url"]
    page = browser.look(url)
    assert page.polled
    assert set(page.cells) == {f"s{j}r{i}" for i in range(M) for j in range(P)}
    assert all(s in ("training", "waiting") for s in page.cells.values()), page.cells
    assert page.loss_points and page.loss_points > 0
    started = [r for r in read_metrics(grid["dir"], events=True)[(1, 1)] if r.get("event")]
    pid = next(r["pid"] for r in reversed(started) if r["event"] == "started")
    os.kill(pid, signal.SIGKILL)  # a cell process of the simulate this test started
    killed_at = time.time()
    dead_at: list[float] = []

    def dead() -> bool:
        d = get_json(url + "api/status")
        if {c["cell"]: c["state"] for c in d["cells"]}.get("s1r1") == "dead":
            dead_at.append(d["now"])
        return bool(dead_at)

    wait_for(dead, HANG_S, "the killed cell to show dead", period_s=0.2)
    # the page said so within the heartbeat timeout (its claim would expire then)
    assert dead_at[0] - killed_at <= HEARTBEAT_LIVES * HEARTBEAT_S
    page = browser.look(url)
    assert page.cells["s1r1"] == "dead" and page.cells["s1r0"] in ("training", "waiting")
    shot = browser.screenshot(url, browser.shots_dir(grid["shots"]) / "dashboard-simulate.png")
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one


def test_tensorboard_events_match_the_rows_after_a_clean_stop(grid):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sim = grid["sim"]
    os.killpg(sim.pid, signal.SIGINT)  # Ctrl-C: every live cell stops cleanly, writers closed
    sim.wait(HANG_S)
    for cell in [(0, 0), (1, 0), (0, 1)]:  # s1r1 was SIGKILLed above: its tail may be lost
        acc = EventAccumulator(
            str(grid["dir"] / "tensorboard" / f"s{cell[0]}r{cell[1]}"), size_guidance={"scalars": 0}
        )
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"lr_scale", "grad_norm", "tokens_per_s", "rounds/applied"} <= tags, tags
        assert any(t.startswith("bytes_sent/") for t in tags), tags
        rows = {r["step"]: r for r in read_metrics(grid["dir"])[cell] if not r.get("final")}
        lr = {e.step: e.value for e in acc.Scalars("lr_scale")}
        assert set(lr) == set(rows)  # every row, nothing else
        assert all(lr[s] == pytest.approx(rows[s]["lr_scale"], rel=1e-6) for s in lr)
        if cell[0] == P - 1:
            loss = {e.step: e.value for e in acc.Scalars("loss")}
            assert loss and all(loss[s] == pytest.approx(rows[s]["loss"], rel=1e-6) for s in loss)
