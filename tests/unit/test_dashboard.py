"""The dashboard's pure parts: a cell's state, the JSON of a run directory (files written here
as a run writes them), the live view of status rows, heartbeat stats, the exporters' numbers,
and the server answering on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.request
from dataclasses import replace

import pytest
from fakes import FakeDirectory

from cli.status import status_rows
from mesh.config import load_config
from mesh.runtime.dashboard.live import LiveView
from mesh.runtime.dashboard.rundir import RunDirView, SentTotals, thin, tokens_per_step
from mesh.runtime.dashboard.server import SourceError, make_server
from mesh.runtime.dashboard.state import (
    DEAD,
    DEAD_AFTER_BEATS,
    DOWNLOADING,
    FINISHED,
    FREE,
    TRAINING,
    WAITING,
    Seen,
    StepClock,
    cell_state,
)
from mesh.runtime.exporters import prometheus_port_of, scalars
from mesh.runtime.metrics import beat_stats
from mesh.runtime.registry import CellRecord, Registry, cell_value, parse_cell, parse_stats

HB = 1.0


def test_cell_state_from_what_is_seen():
    assert cell_state(Seen(claimed=False), HB) == FREE
    assert cell_state(Seen(claimed=True, final=True, alive=False), HB) == FINISHED
    assert cell_state(Seen(claimed=True, alive=False, heartbeat_age_s=0.1), HB) == DEAD
    # no process to look at (another machine, the DHT): its heartbeats decide
    assert cell_state(Seen(claimed=True, heartbeat_age_s=0.5, step_still_s=0.0), HB) == TRAINING
    assert cell_state(Seen(claimed=True, heartbeat_age_s=2.6), HB) == DEAD
    assert cell_state(Seen(claimed=True, heartbeat_age_s=2.6), 10.0) != DEAD  # slower beats
    # a live process whose rows stopped long ago only waits (a pipeline blocked on a neighbour)
    assert cell_state(Seen(claimed=True, alive=True, heartbeat_age_s=60), HB) == TRAINING
    assert cell_state(Seen(claimed=True, alive=True, step_still_s=10), HB) == WAITING
    assert cell_state(Seen(claimed=True, alive=True, waiting_event=True), HB) == WAITING
    assert cell_state(Seen(claimed=True, heartbeat_age_s=0.2, loading=True), HB) == DOWNLOADING


def test_step_clock_counts_from_the_last_change():
    clock = StepClock()
    assert clock.still_s("s0r0", 5, 100.0) == 0.0
    assert clock.still_s("s0r0", 5, 104.0) == 4.0
    assert clock.still_s("s0r0", 6, 105.0) == 0.0
    assert clock.still_s("s1r0", 6, 105.0) == 0.0


def test_thin_keeps_the_ends_and_at_most_n():
    pts = list(range(1000))
    out = thin(pts, 50)
    assert len(out) == 50 and out[0] == 0 and out[-1] == 999 and out == sorted(out)
    assert thin(pts[:10], 50) == pts[:10]


def _row(stage, replica, step, t, loss=None, **kw):
    return {
        "stage": stage,
        "replica": replica,
        "step": step,
        "time_s": t,
        "loss": loss,
        "bytes_sent": {"activation": 100 * step},
        "rounds_started": step,
        "rounds_applied": step,
        "rounds_partial": 1,
        "rounds_failed": 0,
        "rejects": {"late": 2},
        **kw,
    }


def _write_run(tmp_path, cells):
    """A 2x2 run directory: config.toml and `cells` (stage, replica) -> rows."""
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2", "model.seq_len=16"])
    (tmp_path / "config.toml").write_text(cfg.to_toml())
    (tmp_path / "metrics").mkdir()
    for (j, i), rows in cells.items():
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / "metrics" / f"{j}-{i}.jsonl").write_text(text)
    return cfg


def _dead_pid():
    p = subprocess.Popen(["true"])  # a process that has exited and been reaped
    p.wait()
    return p.pid


def test_run_dir_json(tmp_path):
    host = socket.gethostname()
    started = {"event": "started", "step": 0, "pid": os.getpid(), "host": host}
    gone = {"event": "started", "step": 0, "pid": _dead_pid(), "host": host}
    cfg = _write_run(
        tmp_path,
        {
            (0, 0): [started, *[_row(0, 0, s, 0.1 * s) for s in range(1, 6)]],
            (1, 0): [started, *[_row(1, 0, s, 0.1 * s, loss=5.0 - s / 10) for s in range(1, 6)]],
            (1, 1): [gone, _row(1, 1, 1, 0.1, loss=5.0)],  # its process is gone, no final row
        },
    )
    (tmp_path / "val.jsonl").write_text(
        json.dumps({"replica": 0, "step": 4, "tokens": 400, "val_loss": 4.5}) + "\n"
    )
    view = RunDirView(tmp_path)
    d = view.json()
    cells = {c["cell"]: c for c in d["cells"]}
    assert d["grid"] == "2x2" and d["free"] == ["s0r1"]  # nothing was written for it
    assert cells["s0r0"]["state"] == TRAINING and cells["s1r1"]["state"] == DEAD
    c = cells["s1r0"]
    assert c["step"] == 5 and c["loss"] == pytest.approx(4.5) and c["rejects"] == 2
    assert c["rounds"] == {"applied": 5, "partial": 1, "failed": 0}
    assert c["tokens_per_s"] == pytest.approx(4 * tokens_per_step(cfg) / 0.4, rel=1e-3)
    assert d["run"]["fingerprint"] == cfg.fingerprint()
    assert d["bytes_sent"] == {"activation": 500 + 500 + 100}
    per = tokens_per_step(cfg)
    assert d["curves"]["train"]["0"][0] == [per, pytest.approx(4.9)]
    assert d["curves"]["train"]["1"] == [[per, 5.0]]
    assert d["curves"]["val"] == {"0": [[200.0, 4.5]]}  # tokens per replica: 400 over 2
    # rows appended later are read on from where the last poll stopped; a final row finishes
    with (tmp_path / "metrics" / "1-0.jsonl").open("a") as f:
        f.write(json.dumps(_row(1, 0, 6, 0.6, loss=4.3)) + "\n")
        f.write(json.dumps({"final": True, "step": 6, "bytes_sent": {"activation": 700}}) + "\n")
        f.write('{"stage": 1, "replica": 0, "st')  # a line still being written: not yet
    cells = {c["cell"]: c for c in view.json()["cells"]}
    assert cells["s1r0"]["state"] == FINISHED and cells["s1r0"]["loss"] == pytest.approx(4.3)
    assert view.tails[(1, 0)].losses[-1] == (6, pytest.approx(4.3))
    # a failed cell's report makes it dead whatever its pid says
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "s0r0.err").write_text("boom\n")
    assert {c["cell"]: c["state"] for c in view.json()["cells"]}["s0r0"] == DEAD


def test_run_dir_without_config_is_a_user_error(tmp_path):
    from mesh.config import ConfigError

    with pytest.raises(ConfigError, match="config.toml"):
        RunDirView(tmp_path)


def _claim(cell, peer, step, t, stats=None, inc=1):
    return CellRecord(cell, peer, inc, 1.0, 0, step, 50.0, t, None, stats=stats)


def test_heartbeat_stats_round_trip_and_type_checks():
    row = _row(1, 0, 3, 0.3, loss=4.0)
    stats = beat_stats(row)
    assert stats == {
        "rounds": [3, 1, 0],
        "rejects": 2,
        "bytes": {"activation": 300},
        "loss": 4.0,
    }
    rec = _claim("s1r0", "QmA", 3, 10.0, stats)
    assert parse_cell(cell_value(rec)) == rec
    assert parse_cell(cell_value(replace(rec, stats=None))).stats is None
    # each field is kept only when well-typed; a bad one does not cost the claim
    assert parse_stats({"loss": "x", "rounds": [1, 2], "rejects": -1, "bytes": []}) is None
    assert parse_stats({"loss": float("nan"), "rejects": 4}) == {"rejects": 4}
    many = {f"k{n}": 1 for n in range(20)}
    assert parse_stats({"bytes": many, "rounds": [1, True, 0]}) is None


def test_live_view_states_dead_cells_and_curves():
    """Status rows of the DHT at successive polls: the last stage's heartbeat losses become
    curves; a claim gone stale is dead; a cell seen before whose claim expired stays dead."""
    directory = FakeDirectory()
    reg = Registry(directory, None, HB)
    cfg = load_config([], ["grid.stages=2", "grid.replicas=1"])
    view = LiveView()
    for n, t in enumerate((100.0, 101.0)):
        for j in range(2):
            stats = {"loss": 5.0 - n, "rounds": [n, 0, 0], "rejects": 0, "bytes": {"pp": 10}}
            reg.beat(_claim(f"s{j}r0", f"Qm{j}", n + 1, t, stats))
        rows = status_rows(reg, cfg, now=t + 0.2)
        rows["tokens_per_step"] = 7
        d = view.json(rows, t + 0.2)
    assert [c["state"] for c in d["cells"]] == [TRAINING, TRAINING]
    assert d["curves"]["train"] == {"0": [[7, 5.0], [14, 4.0]]}
    assert d["bytes_sent"] == {"pp": 20} and d["cells"][1]["rounds"]["applied"] == 1
    # s1r0 stops beating: its claim grows stale, then expires
    reg.beat(_claim("s0r0", "Qm0", 3, 104.0))
    d = view.json(status_rows(reg, cfg, now=104.1), 104.1)
    assert {c["cell"]: c["state"] for c in d["cells"]} == {"s0r0": TRAINING, "s1r0": DEAD}
    claims = directory.data["cells.r0"]
    directory.data["cells.r0"] = {k: v for k, v in claims.items() if "s1r0" not in k}
    rows = status_rows(reg, cfg, now=110.0)
    assert rows["free"] == ["s1r0"]
    d = view.json(rows, 110.0)
    dead = [c for c in d["cells"] if c["cell"] == "s1r0"]
    assert dead and dead[0]["state"] == DEAD and d["free"] == []
    # a placeholder claim of a join (its process not up yet) is downloading
    reg.beat(_claim("s1r0", "QmNew", 0, 110.0, inc=0))
    d = view.json(status_rows(reg, cfg, now=110.1), 110.1)
    assert {c["cell"]: c["state"] for c in d["cells"]}["s1r0"] == DOWNLOADING


def test_live_view_a_read_that_misses_a_fresh_claim_is_not_a_death():
    """A DHT read under load can answer without a live cell's claim: the cell keeps the state it
    last showed until its last heartbeat is as old as a dead peer's, then it is dead."""
    directory = FakeDirectory()
    reg = Registry(directory, None, HB)
    cfg = load_config([], ["grid.stages=2", "grid.replicas=1"])
    view = LiveView()
    for j in range(2):
        reg.beat(_claim(f"s{j}r0", f"Qm{j}", 5, 100.0))
    d = view.json(status_rows(reg, cfg, now=100.2), 100.2)
    assert {c["cell"]: c["state"] for c in d["cells"]} == {"s0r0": TRAINING, "s1r0": TRAINING}
    held = dict(directory.data["cells.r0"])
    directory.data["cells.r0"] = {k: v for k, v in held.items() if "s1r0" not in k}
    rows = status_rows(reg, cfg, now=100.5)
    assert rows["free"] == ["s1r0"]  # the read missed it
    d = view.json(rows, 100.5)
    assert {c["cell"]: c["state"] for c in d["cells"]} == {"s0r0": TRAINING, "s1r0": TRAINING}
    assert d["free"] == []
    # still missing once its heartbeat would be older than DEAD_AFTER_BEATS periods: dead
    late = 100.0 + DEAD_AFTER_BEATS * HB + 0.5
    d = view.json(status_rows(reg, cfg, now=late), late)
    assert {c["cell"]: c["state"] for c in d["cells"]}["s1r0"] == DEAD


def test_live_view_a_released_cell_is_free_as_status_says_and_its_bytes_stay():
    """A peer that stops cleanly withdraws its claim: `status` lists its cell free (released),
    and so does the dashboard (not dead); what it sent stays in the totals. A withdrawal under
    another signer than the claim's is not its owner's: that cell, gone, is dead."""
    directory = FakeDirectory()
    reg = Registry(directory, None, HB)
    cfg = load_config([], ["grid.stages=2", "grid.replicas=1"])
    view = LiveView()
    for j in range(2):
        reg.beat(_claim(f"s{j}r0", f"Qm{j}", 5, 100.0, {"bytes": {"pp": 10 + j}}))
    d = view.json(status_rows(reg, cfg, now=100.2), 100.2)
    assert d["bytes_sent"] == {"pp": 21}
    assert reg.release("s1r0", "Qm1")
    rows = status_rows(reg, cfg, now=101.0)
    assert rows["free"] == ["s1r0"] and rows["released"] == {"s1r0": ["[owner:test]"]}
    d = view.json(rows, 101.0)
    assert {c["cell"]: c["state"] for c in d["cells"]} == {"s0r0": TRAINING}
    assert d["free"] == ["s1r0"] and d["bytes_sent"] == {"pp": 21}
    # the withdrawal expires: still free, not dead
    directory.data["cells.r0"] = {k: v for k, v in directory.data["cells.r0"].items() if v}
    d = view.json(status_rows(reg, cfg, now=110.0), 110.0)
    assert d["free"] == ["s1r0"] and d["bytes_sent"] == {"pp": 21}
    # a new peer takes the cell: its bytes add to the old peer's
    reg.beat(_claim("s1r0", "QmNew", 6, 110.0, {"bytes": {"pp": 4}}))
    d = view.json(status_rows(reg, cfg, now=110.1), 110.1)
    assert d["bytes_sent"] == {"pp": 10 + 11 + 4}
    # s0r0 vanishes, and another process writes a withdrawal in its name: not its owner's
    claims = directory.data["cells.r0"]
    directory.data["cells.r0"] = {k: v for k, v in claims.items() if "s0r0" not in k}
    assert Registry(directory.joined("[owner:evil]"), None, HB).release("s0r0", "Qm0")
    rows = status_rows(reg, cfg, now=111.0)
    assert rows["released"] == {"s0r0": ["[owner:evil]"]}
    d = view.json(rows, 111.0)
    assert {c["cell"]: c["state"] for c in d["cells"]}["s0r0"] == DEAD


def test_run_dir_a_cleanly_stopped_cell_is_free_and_totals_keep_every_life(tmp_path):
    host = socket.gethostname()
    gone = {"event": "started", "step": 0, "pid": _dead_pid(), "host": host}
    saved = {"event": "saved", "checkpoint": "x", "released": True}
    _write_run(
        tmp_path,
        {
            # stopped cleanly (SIGTERM, Ctrl-C): saved, released; its process is gone
            (0, 0): [gone, _row(0, 0, 1, 0.1), _row(0, 0, 2, 0.2), saved],
            # killed: no saved row
            (1, 0): [gone, _row(1, 0, 1, 0.1, loss=5.0)],
            # restarted: the second life's counters start again at 0
            (0, 1): [gone, _row(0, 1, 3, 0.3), saved, gone, _row(0, 1, 1, 0.5)],
        },
    )
    d = RunDirView(tmp_path).json()
    states = {c["cell"]: c["state"] for c in d["cells"]}
    assert d["free"] == ["s0r0", "s1r1"] and states == {"s1r0": DEAD, "s0r1": DEAD}
    assert d["bytes_sent"] == {"activation": 200 + 100 + (300 + 100)}


def test_sent_totals_keep_departed_senders_and_bank_restarts():
    t = SentTotals()
    t.see("a", {"pp": 10, "dp": 5})
    t.see("b", {"pp": 7})
    t.see("a", {"pp": 12, "dp": 5})
    assert t.total() == {"pp": 19, "dp": 5}
    t.see("a", {"pp": 1})  # a new process under the same name: counters from 0
    assert t.total() == {"pp": 12 + 7 + 1, "dp": 5}
    t.see("b", {"pp": "x"})  # not a number: not counted; the totals stay
    assert t.total() == {"pp": 12 + 7 + 1, "dp": 5}


def test_exporters_numbers_and_ports():
    prev, row = _row(1, 0, 4, 1.0, loss=4.0), _row(1, 0, 6, 1.5, loss=3.5, grad_norm=0.7)
    s = scalars(row, tokens_per_update=32, prev=prev)
    assert s["loss"] == 3.5 and s["grad_norm"] == 0.7 and s["step"] == 6
    assert s["tokens_per_s"] == pytest.approx(2 * 32 / 0.5)
    assert s["bytes_sent/activation"] == 600 and s["rounds/partial"] == 1
    assert s["rejects/late"] == 2 and "tokens_per_s" not in scalars(row, 32, None)
    # one port per cell of a 4x2 grid, replica-major
    ports = {prometheus_port_of(9100, j, i, 4) for i in range(2) for j in range(4)}
    assert ports == set(range(9100, 9108))


def test_server_serves_the_page_and_the_json_on_loopback():
    answers = iter([{"cells": [], "grid": "1x1"}, SourceError("the DHT did not answer")])

    def source():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    server = make_server(source, "127.0.0.1", 0)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        page = urllib.request.urlopen(base + "/", timeout=10).read().decode()
        assert 'id="loss-chart"' in page and "/api/status" in page
        assert json.loads(urllib.request.urlopen(base + "/api/status", timeout=10).read()) == {
            "cells": [],
            "grid": "1x1",
        }
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/api/status", timeout=10)
        assert e.value.code == 503 and "did not answer" in json.loads(e.value.read())["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_dashboard_user_errors_are_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from cli.main import main

    runner = CliRunner()
    for args, says in [
        ([], "either --initial-peers"),
        (["--run", str(tmp_path), "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/Qm"], "not both"),
        (["--run", str(tmp_path)], "no config.toml"),
        (["--initial-peers", "not-an-address"], "--initial-peers"),
    ]:
        res = runner.invoke(main, ["dashboard", *args])
        assert res.exit_code == 2, (args, res.output)
        assert says in res.output and "Traceback" not in res.output, (args, res.output)
    _write_run(tmp_path, {})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = runner.invoke(main, ["dashboard", "--run", str(tmp_path), "--port", str(port)])
    assert res.exit_code == 2 and f"--port {port}" in res.output, res.output


class _LateClaims(FakeDirectory):
    """A DHT whose node gets a claim's store only after status's first read of the claims."""

    def __init__(self):
        super().__init__()
        self.late = None  # the store that lands after the next read

    def dht_get_many(self, keys, timeout_s=None, withdrawn=False):
        found = super().dht_get_many(keys, timeout_s, withdrawn)
        land, self.late = self.late, None
        if land is not None:
            land()
        return found


@pytest.mark.parametrize("reread_s", [None, 0.0])
def test_status_reads_a_free_cell_again_before_calling_it_free(reread_s):
    """s1r0's claim reaches the DHT just after status's first read. One read calls the held
    cell free (what `status` once showed for 7 held cells); with the second read it is held,
    and only a cell neither read finds a holder for is free."""
    directory = _LateClaims()
    reg = Registry(directory, None, HB)
    cfg = load_config([], ["grid.stages=3", "grid.replicas=1"])
    reg.beat(_claim("s0r0", "Qm0", 1, 100.0))
    directory.late = lambda: reg.beat(_claim("s1r0", "Qm1", 1, 100.0))
    rows = status_rows(reg, cfg, now=100.2, reread_s=reread_s)
    if reread_s is None:
        assert rows["free"] == ["s1r0", "s2r0"]
    else:
        assert rows["free"] == ["s2r0"]
        assert [c["cell"] for c in rows["cells"]] == ["s0r0", "s1r0"]
