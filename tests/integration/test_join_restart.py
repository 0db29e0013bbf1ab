"""A `join` peer stopped with Ctrl-C and started again (the same command) within its claim's
lifetime: it saved every update it had made, takes its own cell back and resumes from its own
save, not from a download; its replica trains on; its summary counts both lives."""

from __future__ import annotations

import random
import signal
import subprocess

import pytest

from mesh.runtime.lives import split_lives
from mesh.runtime.registry import HEARTBEAT_LIVES
from mesh.testing.local_peers import (
    LOOPBACK,
    PACE_MS,
    cell_of,
    kill,
    meshtrain,
    rows,
    start_dht,
    step,
    stop,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 120  # only hangs are bounded (a loaded 2-core box)


def test_a_join_stopped_with_ctrl_c_and_started_again_resumes_from_its_own_save(
    text_file, tmp_path
):
    """2x1 (no other replica to download from: a download would be a second cell's state),
    Ctrl-C to the stage-1 peer at a random step: it exits 0 having saved its step; the same
    command, started at once, claims s1r0 again, its new life starts at that step (the
    `resumed` event names its checkpoint) and trains on with no `state_loaded`."""
    cfg = tiny_grid_config(tmp_path, text_file, replicas=1, min_compute_ms=PACE_MS)
    dht, maddr = start_dht()
    procs = {}
    try:
        logs = {n: (tmp_path / f"{n}.log").open("w") for n in ("j0", "j1", "j1b")}

        def join(name: str, out: str, *extra: str) -> subprocess.Popen:
            procs[name] = meshtrain(
                "join",
                "--initial-peers",
                maddr,
                *LOOPBACK,
                "--out",
                str(tmp_path / out),
                *extra,
                stdout=logs[name],
                stderr=subprocess.STDOUT,
            )
            return procs[name]

        join("j0", "j0", "--config", str(cfg))
        wait_for(lambda: "joined run" in (tmp_path / "j0.log").read_text(), HANG_S, "j0's claim")
        join("j1", "j1")
        out = tmp_path / "j1"
        at = random.randint(10, 40)
        print(f"Ctrl-C at step {at}")  # the seed of a failure, with -s
        wait_for(lambda: step(out) >= at, HANG_S, f"s1r0 at step {at}")
        assert cell_of(out) == (1, 0)
        procs["j1"].send_signal(signal.SIGINT)
        assert procs["j1"].wait(HANG_S) == 0, (tmp_path / "j1.log").read_text()[-3000:]
        logged = step(out)  # every update the stopped peer wrote a row for
        saved = [r for r in rows(out) if r.get("event") == "saved"][-1]
        assert saved["step"] >= logged and saved["released"], saved  # nothing made is lost
        partner = step(tmp_path / "j0")

        join("j1b", "j1")  # the same command again, at once: within the claim's lifetime
        wait_for(lambda: step(out) >= saved["step"] + 5, HANG_S, "the restarted peer training")
        text = (tmp_path / "j1b.log").read_text()
        assert " as s1r0 " in text, text[-3000:]
        life = split_lives(rows(out))[-1]
        resumed = [r for r in life if r.get("event") == "resumed"]
        assert len(resumed) == 1 and resumed[0]["step"] == saved["step"], resumed
        assert resumed[0]["checkpoint"].endswith(f"step-{saved['step']:08d}.pt")
        assert not [r for r in life if r.get("event") == "state_loaded"], "no download"
        assert step(tmp_path / "j0") > partner  # its replica trains on with it
        print(
            f"logged {logged}, saved {saved['step']}, resumed {resumed[0]['step']}, "
            f"claim lifetime {HEARTBEAT_LIVES} heartbeats"
        )
        assert stop(procs["j1b"]) == 0 and stop(procs["j0"]) == 0
        # its summary counts both lives of the cell in its directory
        table = [ln for ln in (tmp_path / "j1b.log").read_text().splitlines() if "| s1r0" in ln]
        assert table and table[-1].rstrip(" |").split("|")[-1].strip() == "2", table
    finally:
        for p in [*procs.values(), dht]:
            kill(p)
