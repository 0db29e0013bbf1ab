"""The dashboard page in a real browser, on a run directory written here as a run writes it (no
grid to start): the loss chart's key names dots only when there are validation points (a DHT
run has none), its legend names each replica drawn, a cleanly stopped cell is drawn free, and
the bytes bars keep a stopped cell's totals; a stage-pools run's page has each stage's pool."""

from __future__ import annotations

import json
import socket
import threading

import browser
import pytest
from fakes import FakeDirectory

from cli.status import status_rows
from mesh.config import load_config
from mesh.runtime.dashboard.live import LiveView
from mesh.runtime.dashboard.rundir import RunDirView
from mesh.runtime.dashboard.server import make_server
from mesh.runtime.registry import CellRecord, Registry

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _row(stage, replica, step, loss=None):
    return {
        "stage": stage,
        "replica": replica,
        "step": step,
        "time_s": 0.1 * step,
        "loss": loss,
        "bytes_sent": {"activation": 100 * step},
    }


def _write(run, rows_by_cell):
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2", "model.seq_len=16"])
    (run / "config.toml").write_text(cfg.to_toml())
    (run / "metrics").mkdir(exist_ok=True)
    for (j, i), rows in rows_by_cell.items():
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (run / "metrics" / f"{j}-{i}.jsonl").write_text(text)


@pytest.fixture
def served(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    started = {"event": "started", "step": 0, "pid": 1, "host": "elsewhere"}
    saved = {"event": "saved", "checkpoint": "x", "released": True}
    _write(
        run,
        {
            (0, 0): [started, *[_row(0, 0, s) for s in range(1, 4)]],
            (1, 0): [started, *[_row(1, 0, s, 5.0 - s / 10) for s in range(1, 4)]],
            (0, 1): [started, *[_row(0, 1, s) for s in range(1, 3)], saved],  # a clean stop
            (1, 1): [started, *[_row(1, 1, s, 5.1 - s / 10) for s in range(1, 4)]],
        },
    )
    view = RunDirView(run)
    view.host = socket.gethostname()
    server = make_server(view.json, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield run, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_page_key_legend_free_cell_and_bytes(served):
    browser.chromium()  # skip when there is no browser
    run, url = served
    page = browser.look(url)
    assert page.polled and page.loss_points == 6
    assert page.loss_key == "lines: training"  # no validation rows: no dots promised
    assert page.legend == ["0", "1"]  # one entry per replica drawn
    assert page.cells["s0r1"] == "free", page.cells
    assert all(page.cells[c] != "free" for c in ("s0r0", "s1r0", "s1r1")), page.cells
    assert page.byte_kinds == ["activation"]
    # validation rows appear: the key names the dots
    rows = [{"replica": i, "step": 2, "tokens": 400, "val_loss": 4.5} for i in (0, 1)]
    (run / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = browser.look(url)
    assert page.loss_key == "lines: training, dots: validation"
    assert page.loss_points == 8 and page.legend == ["0", "1"]


def test_a_pooled_runs_page_shows_each_stages_pool(tmp_path):
    """A stage-pools run read from the DHT (status rows from claims, as `dashboard
    --initial-peers` polls them): the grid gets a pool row, each stage's running cells, their
    summed capacity and the share of what they routed that went to another replica's cell."""
    browser.chromium()
    reg = Registry(FakeDirectory(), None, 1.0)
    cfg = load_config([], ["grid.stages=2", "grid.replicas=2", "pipeline.routing='pools'"])
    tps = {"s0r0": 300.0, "s0r1": 100.0, "s1r0": 250.0, "s1r1": 250.0}
    routed = {"s0r0": {"routed": 30, "cross": 9}, "s0r1": {"routed": 10, "cross": 3}}
    for cell, rate in tps.items():
        record = CellRecord(
            cell, f"Qm{cell}", 1, 1.0, 0, 5, rate, 100.0, None, stats=routed.get(cell)
        )
        reg.beat(record)
    view = LiveView()
    server = make_server(lambda: view.json(status_rows(reg, cfg, now=100.2), 100.2), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.look(f"http://127.0.0.1:{server.server_address[1]}/")
    finally:
        server.shutdown()
        server.server_close()
    assert page.polled and set(page.cells) == set(tps), page.cells
    assert page.pools == {
        "0": "2 cells · 400 tok/s · 30% to other replicas",  # (9 + 3) / (30 + 10)
        "1": "2 cells · 500 tok/s",  # the last stage routes nothing on
    }, page.pools
