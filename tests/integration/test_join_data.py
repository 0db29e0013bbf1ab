"""Two joins with different datasets: real `meshtrain dht` and `meshtrain join` processes on
127.0.0.1. The first starts a run on a prepared dataset; a second whose copy holds other data
is refused before it claims a cell, with a line that names the difference; `status` shows the
run's dataset digest."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mesh.data.prepare import prepare
from mesh.testing.local_peers import (
    LOOPBACK,
    generated_text,
    kill,
    meshtrain,
    run_meshtrain,
    start_dht,
    status,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 120  # only to catch a hang


def _dataset(directory: Path, docs: list[str]) -> Path:
    directory.mkdir()
    (directory / "src.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(directory / "src.jsonl")], directory / "ds", "bytes")
    return directory / "ds"


def test_a_join_with_other_data_is_refused_naming_the_difference(tmp_path):
    docs = [generated_text(2000, seed=i) for i in range(40)]
    ours = _dataset(tmp_path / "ours", docs)
    theirs = _dataset(tmp_path / "theirs", [*docs[:-1], docs[-1] + "One more line.\n"])
    cfg = tiny_grid_config(tmp_path, ours, replicas=1, local="elastic.rejoin_timeout_s = 600")
    dht, maddr = start_dht()
    peers = ["--initial-peers", maddr, *LOOPBACK]
    log = (tmp_path / "first.log").open("w")
    first = meshtrain(
        "join",
        *peers,
        "--config",
        str(cfg),
        "--out",
        str(tmp_path / "a"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: "joined run" in (tmp_path / "first.log").read_text(),
            HANG_S,
            "the first join to start the run",
        )
        code, out, _ = run_meshtrain(
            "join",
            *peers,
            "--set",
            f"data.path='{theirs}'",
            "--out",
            str(tmp_path / "b"),
            timeout_s=HANG_S,
        )
        assert code == 2, out
        assert "is not the run's dataset" in out and "tokens here" in out, out
        assert "Traceback" not in out and not (tmp_path / "b").exists()
        rows = status(maddr)
        digest = json.loads((ours / "manifest.json").read_text())["digest"]
        assert rows["data"]["digest"] == digest and rows["free"] == ["s1r0"]
    finally:
        kill(first)
        kill(dht)
        log.close()
