"""`meshtrain bench soak --quick` and `bench scale --quick` end to end (issue #16 items 1-2):
real dht and join processes on 127.0.0.1, through the CLI. The full-length runs (an hour, 32
peers) are the benches themselves; these check that the short ones form their grid, kill and
replace a peer, measure what they claim to, write their outputs and leave nothing behind.
Time bounds only catch hangs; the numbers are the benches' (results/soak, results/scale)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_soak_quick_kills_and_replaces_a_peer_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "soak"
    res = CliRunner().invoke(
        main, ["bench", "soak", "--quick", "--minutes", "1.0", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output + (out / "error.txt").read_text(errors="replace")[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] and s["error"] is None and not s["sampler_errors"]
    # one kill, its helpers (DHT process, p2pd) gone by themselves, a new peer in its cell
    (kill,) = s["kills"]
    assert kill["helpers_outlived"] == [] and kill["sockets_left"] == []
    (rep,) = s["replacements"]
    assert rep["cell"] == kill["cell"] and rep["killed"] == kill["peer"]
    assert s["peers"][rep["peer"]]["samples"] >= 2
    assert s["leftovers"] == {"orphan_processes": [], "orphan_p2pd": 0, "socket_files_left": []}
    # every peer was sampled from /proc and from inside (its health rows)
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    peers = {x["peer"] for x in samples if x["kind"] == "sample"}
    assert len(peers) == 5
    for peer in peers:
        mine = [x for x in samples if x["kind"] == "sample" and x["peer"] == peer]
        assert all(x["rss_mb_cell"] > 0 for x in mine), peer
        assert any(x.get("fds_p2pd", 0) > 0 and x.get("threads_dht", 0) > 0 for x in mine), peer
        assert any(isinstance(x.get("asyncio_tasks"), int) for x in mine), peer
        assert any(isinstance(x.get("mailbox_pending"), int) for x in mine), peer
    assert s["rss_growth_mb_max"] < 100  # a 1-minute run: far below; a leak shows at once
    losses = [w["train_loss"] for w in s["loss_by_window"] if w["train_loss"] is not None]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, losses
    assert (out / "soak.png").stat().st_size > 10_000
    assert "rss_growth_under_100mb" in (out / "table.md").read_text()


@pytest.mark.timeout(900)
def test_scale_quick_forms_the_grid_and_measures_it(tmp_path):
    out = tmp_path / "scale"
    res = CliRunner().invoke(main, ["bench", "scale", "--quick", "--out", str(out)])
    assert res.exit_code == 0, res.output + (out / "error.txt").read_text(errors="replace")[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["completed"] and s["peers"] == 8 and s["grid"] == "4x2"
    assert s["time_to_all_training_s"] is not None and s["not_training"] == []
    assert sorted(s["cells"].values()) == sorted(f"s{j}r{i}" for j in range(4) for i in range(2))
    assert s["status"]["cells_listed"] == [8]
    assert len(s["dht_per_peer_per_min"]) == 8
    assert all(v["stores"] > 0 and v["get_records"] > 0 for v in s["dht_per_peer_per_min"].values())
    assert s["rounds_window"]["applied"] > 0
    assert s["torch_threads"] == [1]
    assert s["leftovers"] == {"orphan_processes": [], "orphan_p2pd": 0, "socket_files_left": []}
    assert (out / "scale.png").stat().st_size > 10_000


@pytest.mark.timeout(600)
def test_a_soak_stopped_by_sigterm_stops_its_grid_and_says_so(tmp_path):
    """SIGTERM (a scheduler, `kill`) unwinds the bench like Ctrl-C: every process it started
    is stopped and reaped, and its summary says it did not complete and why."""
    import signal
    import subprocess
    import sys

    from helpers import wait_for

    from comms.procs import process_tree
    from comms.procs import running as alive

    out = tmp_path / "soak"
    cmd = [sys.executable, "-m", "cli.main", "bench", "soak", "--quick", "--out", str(out)]
    log = tmp_path / "bench.log"  # what it printed, shown when it ends otherwise than asked
    bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:

        def formed() -> bool:
            path = out / "samples.jsonl"
            rows = path.read_text().splitlines() if path.exists() else []
            return len({json.loads(r)["peer"] for r in rows if '"sample"' in r}) >= 4

        wait_for(formed, 240, "the soak's four peers sampled")
        grid = process_tree(bench.pid)[1:]
        assert len(grid) >= 5  # the DHT and four joins, and their helpers
        bench.send_signal(signal.SIGTERM)
        code = bench.wait(120)
        assert code == 128 + signal.SIGTERM, (code, log.read_text()[-3000:])
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)
    wait_for(lambda: not any(alive(p) for p in grid), 10, "the grid's processes to be gone")
    s = json.loads((out / "summary.json").read_text())
    assert not s["completed"] and s["error"] == "SystemExit: 143"
    assert s["leftovers"] == {"orphan_processes": [], "orphan_p2pd": 0, "socket_files_left": []}
    assert (out / "table.md").exists()
