"""`join` and `status` say what is happening: real `meshtrain dht` + `meshtrain join` processes on
127.0.0.1 forming a 2x1 grid of the tiny model.

A lone join says whom its replica waits for; `status` without (or with another) run key says
the run's claims are readable only with its key, shows no free cell, and exits 2; a second join lets
the replica start; Ctrl-C saves and releases, and says so; the neighbour left behind says it
waits, and for whom; joining again resumes from the checkpoint and says so. Failed joins leave
no /tmp/hivemind-* files of their own behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers
import pytest

from comms import procs
from mesh.testing.local_peers import (
    KEY,
    LOOPBACK,
    PACE_MS,
    finish,
    kill,
    meshtrain,
    run_meshtrain,
    start_dht,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANG_S = 120  # only to catch a hang: a loaded 2-core box needs far less


def _run(*args: str, key: str | None = KEY) -> tuple[int, str]:
    code, out, _ = run_meshtrain(*args, key=key, timeout_s=HANG_S)
    return code, out


def _json(out: str) -> dict:
    return json.loads(out[out.index("{") : out.rindex("}") + 1])


def _wait(cond, what: str) -> None:
    wait_for(cond, HANG_S, what)


class Join:
    """A `meshtrain join` whose output (stdout and stderr) goes to a log file."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as f:
            self.proc = meshtrain("join", *LOOPBACK, *args, stdout=f, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text().replace("\r", "\n")

    def count(self, line: str) -> int:
        return sum(1 for ln in self.text().splitlines() if ln.strip() == line)

    def steps(self, out: Path, cell: str) -> int:
        path = out / "metrics" / f"{cell[1]}-{cell[3]}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        rows = [json.loads(ln) for ln in lines if ln.endswith("}")]
        return max((r["step"] for r in rows if "loss" in r), default=0)


def test_join_and_status_say_what_is_happening(text_file, tmp_path):
    cfg = tiny_grid_config(  # less CPU for the cells: see test_join
        tmp_path,
        text_file,
        replicas=1,
        local="elastic.rejoin_timeout_s = 600",
        min_compute_ms=PACE_MS,
    )
    dht, maddr = start_dht()
    peers = ["--initial-peers", maddr]
    started = [dht]
    try:
        out_a, out_b = tmp_path / "a", tmp_path / "b"
        first = Join(tmp_path / "j0.log", *peers, "--config", str(cfg), "--out", str(out_a))
        started.append(first.proc)
        waiting = "waiting for s1r0 (free) to start replica 0"
        _wait(lambda: first.count(waiting) >= 1, "the lone join to say whom it waits for")

        # -- status without the key: the claims live in the key's space, unread; none is free;
        #    exit 2
        code, out = _run("status", *peers, "--json", key=None)
        assert code == 2, out
        rows = _json(out)
        assert rows["run_key"] == "missing" and rows["grid"] == "2x1"
        assert rows["cells"] == [] and rows["free"] == [] and not rows["claims_readable"]
        assert "none was given (--run-key or MESHTRAIN_RUN_KEY)" in out
        code, out = _run("status", *peers, key="another key")
        assert code == 2, out
        assert "run key does not match" in out and "readable only with its key" in out
        assert "free cells: unknown" in out

        # -- a second join lets the replica start
        second = Join(tmp_path / "j1.log", *peers, "--out", str(out_b))
        started.append(second.proc)
        formed = "replica 0 formed (s0r0, s1r0)"
        _wait(lambda: formed in first.text(), "the replica to form")
        _wait(lambda: second.steps(out_b, "s1r0") >= 5, "the second join training")

        def sessions_in_status() -> bool:  # a claim carries its session from the next beat
            code, out = _run("status", *peers, "--json")
            assert code == 0, out
            rows = _json(out)
            assert rows["run_key"] == "ok" and rows["free"] == []
            assert all(c["verified"] for c in rows["cells"])
            return all(c["session"] > 0 for c in rows["cells"])

        _wait(sessions_in_status, "both claims to show their session")
        code, out = _run("status", *peers)
        assert code == 0, out
        assert re.search(r"\| s1r0 .* \| \d\d:\d\d:\d\d \(\d+ (s|min \d\d s) ago\) +\|", out), out

        # -- Ctrl-C (the whole process group, as a terminal sends it): saved, released, said
        said_before = first.count(waiting)
        os.killpg(second.proc.pid, signal.SIGINT)
        assert second.proc.wait(HANG_S) == 0, second.text()
        said = re.search(r"checkpoint saved to (\S+), released s1r0", second.text())
        assert said, second.text()
        saved = Path(said.group(1))
        assert saved.is_file() and saved.parent == out_b / "checkpoints" / "1-0"
        saved_step = int(saved.stem.split("-")[1])

        # -- the neighbour left behind says it waits, and for whom
        _wait(lambda: first.count(waiting) > said_before, "the neighbour to say it waits")

        # -- the same peer joins again: it takes back its cell and says it resumed
        formed_before = first.text().count(formed)
        again = Join(tmp_path / "j2.log", *peers, "--out", str(out_b))
        started.append(again.proc)
        resumed = f"resumed from my checkpoint at step {saved_step} ({saved})"
        _wait(lambda: resumed in again.text(), "the rejoin to say it resumed")
        _wait(lambda: first.text().count(formed) > formed_before, "the replica to re-form")
        for j in (first, again):
            os.killpg(j.proc.pid, signal.SIGINT)
            assert j.proc.wait(HANG_S) == 0, j.text()
        assert "Traceback" not in first.text() + second.text() + again.text()
    finally:
        for p in started:
            kill(p)


def _run_watched(*args: str, seen: set[int]) -> tuple[int, str]:
    """_run, adding to `seen` every pid of the command's process tree while it runs (its
    DHT process names its p2pd's files /tmp/hivemind-PID-*: that tells them from the files of
    the tests running beside this one)."""
    p = meshtrain(*args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(procs.process_tree(p.pid))
            done.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = finish(p, HANG_S)
    finally:
        done.set()
        watcher.join(5)
    return p.returncode, out


def test_a_failed_join_leaves_no_socket_files(tmp_path):
    from hivemind.p2p import PeerID

    dht, maddr = start_dht()
    seen: set[int] = set()
    started = time.time() - 1.0  # a file older than the test is another's whose pid was reused
    try:
        host = maddr.split("/p2p/")[0]
        # the bootstrap's address with another peer's ID (it restarted without --identity):
        # the TCP probe passes, then p2pd fails to bootstrap and exits
        someone_else = PeerID(b"\x12\x20" + os.urandom(32)).to_base58()  # a sha256 multihash
        stale = f"{host}/p2p/{someone_else}"
        code, out = _run_watched("join", "--initial-peers", stale, *LOOPBACK, seen=seen)
        assert code == 2 and "could not reach the DHT" in out, out
        # a scout that started, then found no run to join
        scout: set[int] = set()
        code, out = _run_watched("join", "--initial-peers", maddr, *LOOPBACK, seen=scout)
        assert code == 2 and "no run found" in out, out
        assert len(scout) > 1, "its DHT process was not seen: the check below would be blind"
        seen |= scout
        # the first peer's data cannot be read: one line, before it claims a cell
        bad_data = tmp_path / "bad.toml"
        bad_data.write_text('[data]\npath = "/nonexistent/corpus.txt"\n')
        args = ("join", "--initial-peers", maddr, *LOOPBACK, "--config", str(bad_data))
        code, out = _run_watched(*args, seen=seen)
        assert code == 2 and "error: data.path" in out and "Traceback" not in out, out
        # malformed: refused by syntax before any daemon starts, with the right form (every
        # malformed shape: tests/unit/test_join_ux.py)
        malformed = host[5:].replace("/tcp/", ":")
        code, out = _run_watched("join", "--initial-peers", malformed, *LOOPBACK, seen=seen)
        assert code == 2 and "e.g. /ip4/" in out and "Traceback" not in out, out
        bound = procs.bound_sockets()  # a live p2pd's: the check after this one
        files = {str(f) for f in helpers.hivemind_files(seen, started)}
        assert not files - bound, sorted(files - bound)
        assert not procs.named_with(host.encode(), "p2pd"), "a failed join left its p2pd running"
    finally:
        kill(dht)


# `meshtrain join` whose cell's hivemind transport has 1 ms to start (a machine too loaded to
# start it in time: transport.start_timeout_s cannot go under the transport's 15 s floor), as
# tests/integration/test_simulate_cli.py's cell_that_cannot_start; the rest as a user runs it
_JOIN_THAT_CANNOT_START = """
from comms.p2p.transport import P2PTransport
init = P2PTransport.__init__
def short(self, *a, **k):
    init(self, *a, **{**k, "startup_timeout_s": 0.001})
P2PTransport.__init__ = short
from cli.main import main
main()
"""


def test_a_join_whose_transport_cannot_start_exits_2_with_one_line(text_file, tmp_path):
    """Its own transport not starting in time is a user error, as for a simulated cell: exit 2
    and one line naming transport.start_timeout_s (it was taken for a network failure: exit 1).
    It never trained: no step-0 checkpoint, no summary table, and the --out it made is gone
    (it saved one and printed a one-row table, which a later join there resumed from)."""
    cfg = tiny_grid_config(tmp_path, text_file, replicas=1)
    dht, maddr = start_dht()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTRAIN_RUN_KEY": KEY}
    args = ["join", "--initial-peers", maddr, *LOOPBACK, "--config", str(cfg)]
    join = subprocess.Popen(
        [sys.executable, "-c", _JOIN_THAT_CANNOT_START, *args, "--out", str(tmp_path / "out")],
        env=env,
        start_new_session=True,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = finish(join, HANG_S)
    finally:
        kill(join)
        kill(dht)
    assert join.returncode == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith("raise transport.start_timeout_s"), out
    assert re.search(r"'s\dr0': the hivemind transport did not start within 0\.001 s", out), out
    assert "Traceback" not in out, out
    assert "| cell" not in out and "saved" not in out and "%|" not in out, out  # nor a bar
    assert not (tmp_path / "out").exists(), sorted((tmp_path / "out").rglob("*"))
