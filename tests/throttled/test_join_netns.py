"""The 2x2 grid of `meshtrain dht` + four `meshtrain join`, each peer in its own network
namespace behind a veth link shaped with kernel tbf (its upload and download). Root only;
skipped cleanly otherwise. Checks that it trains and that each peer's measured averaging traffic
stays within its link's budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for

from comms.netns import netns_star, unavailable
from mesh.testing.local_peers import rows as cell_rows
from mesh.testing.local_peers import tiny_grid_config

RATE_MBIT = 20.0
pytestmark = [pytest.mark.throttled, pytest.mark.integration, pytest.mark.slow]


def _rows(out: Path) -> list[dict]:
    """The update rows of the cell the join runs now (a join that lost its first claim to a
    racing one also wrote a couple of rows for that cell, which must not stand for it)."""
    return [r for r in cell_rows(out) if "event" not in r]


def test_grid_of_joins_in_shaped_namespaces(text_file, tmp_path):
    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    # the replicas form up to a second or two apart, and within a replica a follower catches up
    # after its leader announced: a replica starts ~120 updates behind the other (this tiny
    # model runs 50-80 a second), more than a round stays open. The trailing cells follow the
    # column's round clock (mesh/algo/round_clock.py), so rounds land on both sides anyway
    cfg = tiny_grid_config(tmp_path, text_file)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTRAIN_RUN_KEY": "k"}
    procs: list[subprocess.Popen] = []
    with netns_star(5, RATE_MBIT) as star:

        def start(k: int, *args: str, **kw) -> subprocess.Popen:
            maddr = f"/ip4/{star.addrs[k]}/tcp/0"
            cmd = star.cmd(k, sys.executable, "-m", "cli.main", *args, "--host-maddrs", maddr)
            p = subprocess.Popen(cmd, env=env, start_new_session=True, text=True, **kw)
            procs.append(p)
            return p

        try:
            dht = start(0, "dht", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            bootstrap = dht.stdout.readline().strip()
            assert bootstrap.startswith(f"/ip4/{star.addrs[0]}/"), bootstrap
            outs = [tmp_path / f"j{k}" for k in range(1, 5)]
            logs = [(tmp_path / f"j{k}.log").open("w") for k in range(1, 5)]
            for k in range(1, 5):
                extra = ["--config", str(cfg)] if k == 1 else []
                start(
                    k,
                    "join",
                    "--initial-peers",
                    bootstrap,
                    "--out",
                    str(outs[k - 1]),
                    *extra,
                    stdout=logs[k - 1],
                    stderr=subprocess.STDOUT,
                )
                if k == 1:  # the run's config record first: it is stored before the claim
                    first_log = tmp_path / "j1.log"
                    wait_for(lambda p=first_log: "joined run" in p.read_text(), 60, "1st claim")
            wait_for(lambda: all(len(_rows(o)) > 40 for o in outs), 150, "four cells training")
            at = [len(_rows(o)) for o in outs]  # then a steady stretch to measure
            wait_for(lambda: all(len(_rows(o)) > n + 40 for o, n in zip(outs, at)), 150, "40 more")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
    budget_bytes_s = RATE_MBIT * 1e6 / 8
    for out in outs:
        rows = [r for r in _rows(out) if "bytes_sent" in r and not r.get("final")]
        first, last = rows[len(rows) // 4], rows[-1]
        dt = last["time_s"] - first["time_s"]
        avg = last["bytes_sent"].get("average", 0) - first["bytes_sent"].get("average", 0)
        sent = sum(last["bytes_sent"].values()) - sum(first["bytes_sent"].values())
        # rounds ran across the shaped links in the steady window, on every cell
        assert avg > 0, out
        assert last["rounds_applied"] > first["rounds_applied"], (out, first, last)
        assert sent / dt <= budget_bytes_s * 1.05, (out, sent / dt, budget_bytes_s)
        assert avg / dt <= budget_bytes_s, (out, avg / dt)
    last_stages = 0
    for out in outs:
        losses = [r["loss"] for r in _rows(out) if r.get("loss") is not None]
        if losses:
            last_stages += 1
            assert min(losses[-10:]) < losses[0], (out, losses[0], losses[-10:])
    assert last_stages == 2
