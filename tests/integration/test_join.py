"""A grid formed over a DHT by `meshtrain dht` + `meshtrain join` processes on 127.0.0.1.

One run (to pay the daemons' start-up once) walks through the issue's scenarios in order:
formation by four joins (only the first brings a config), `status`, a falling loss, the run's
dashboard over the DHT (refused without the run key; with it every cell training, in a real
browser), refused outsiders (no run key, another config fingerprint, an unkeyed transport
sending activations), a killed peer shown dead on the dashboard within its claim's lifetime
and replaced by a new join that downloads its stage's state, the bootstrap node killed (peers
keep training; a join naming only it fails clearly), and a clean stop.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import browser
import pytest
import torch

from cli.status import READ_TIMEOUT_S
from mesh.runtime.registry import HEARTBEAT_LIVES
from mesh.testing.local_peers import (
    LOOPBACK,
    PACE_MS,
    cell_of,
    kill,
    meshtrain,
    rows,
    run_meshtrain,
    status,
    step,
    stop,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Only hangs are bounded here, with room for a loaded 2-core box; how long joining, resuming and
# failing take is measured by `meshtrain bench join` (results/join/table.md).
HANG_S = 60
HEARTBEAT_S = 1.0  # tiny_grid_config's elastic.heartbeat_s
CELLS = {"s0r0", "s1r0", "s0r1", "s1r1"}


def test_grid_formed_by_joins(text_file, tmp_path):
    # the cells paced as on devices (PACE_MS): flat out, the four joins take 1.5 of the 2 cores
    # (~30 updates a second each) and starve the `status` and `join` processes this test is about
    cfg = tiny_grid_config(tmp_path, text_file, min_compute_ms=PACE_MS)
    dht = meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    joins: dict[str, subprocess.Popen] = {}
    extra: list[subprocess.Popen] = []
    try:
        maddr = dht.stdout.readline().strip()
        assert maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr, maddr
        peers = ["--initial-peers", maddr]
        logs = {}

        def join(name: str, *extra: str) -> None:
            logs[name] = (tmp_path / f"{name}.log").open("w")
            joins[name] = meshtrain(
                "join",
                *peers,
                *LOOPBACK,
                "--out",
                str(tmp_path / name),
                *extra,
                stdout=logs[name],
                stderr=subprocess.STDOUT,
            )

        # -- formation: the first join brings the config, the others read it from the DHT (it
        #    put the run's record before it claimed its cell and said so)
        join("j0", "--config", str(cfg))
        wait_for(lambda: "joined run" in (tmp_path / "j0.log").read_text(), 60, "the first claim")
        for name in ("j1", "j2", "j3"):
            join(name)
        outs = {n: tmp_path / n for n in joins}
        wait_for(lambda: all(step(o) >= 30 for o in outs.values()), 120, "every cell training")
        grid = status(maddr)
        assert grid["grid"] == "2x2"
        assert sorted(c["cell"] for c in grid["cells"]) == ["s0r0", "s0r1", "s1r0", "s1r1"]
        assert grid["free"] == []
        cells = {n: cell_of(o) for n, o in outs.items()}
        last_stage = [n for n, c in cells.items() if c[0] == 1]
        # paced, a cell learns by its updates, not by the time the slowest join took to start
        wait_for(lambda: all(step(outs[n]) >= 100 for n in last_stage), HANG_S, "100 updates")
        for n in last_stage:
            losses = [r["loss"] for r in rows(outs[n]) if r.get("loss") is not None]
            assert sum(losses[-5:]) / 5 < losses[0] - 0.3, (n, losses[0], losses[-5:])

        # -- the run's dashboard, from the DHT: without the run key it shows nothing (one line,
        #    exit 2); with it every cell is training and the loss chart has points
        code, out, _ = run_meshtrain("dashboard", *peers, "--port", "0", key=None, timeout_s=HANG_S)
        assert code == 2 and "run key" in out and "Traceback" not in out, out
        dash = meshtrain(
            "dashboard", *peers, "--port", "0", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        extra.append(dash)
        line = dash.stdout.readline()
        assert line.startswith("dashboard: http://127.0.0.1:"), line
        url = line.split()[1]
        wait_for(lambda: _all_training(url), HANG_S, "every cell training on the dashboard")
        d = _dashboard_json(url)
        assert d["run"]["fingerprint"] and d["grid"] == "2x2" and d["run_key"] == "ok"
        assert all(c["rounds"] is not None and c["verified"] for c in d["cells"])
        if browser.installed():  # .ci/run installs one
            # a page is one moment: a peer starved on a loaded box can beat late once, so the
            # page is loaded again until it shows what the JSON showed
            pages = []

            def page_training() -> bool:
                pages.append(browser.look(url))
                cells = pages[-1].cells
                return set(cells) == CELLS and set(cells.values()) <= {"training", "waiting"}

            wait_for(page_training, HANG_S, "every cell training in the browser", period_s=1)
            assert pages[-1].loss_points and pages[-1].loss_points >= 2

        # -- outsiders are refused, clearly
        code, out, _ = run_meshtrain("join", *peers, *LOOPBACK, key="not the key")
        assert code == 2 and "run key does not match" in out, out
        code, out, _ = run_meshtrain(
            "join", *peers, *LOOPBACK, "--config", str(cfg), "--set", "model.d_model=32"
        )
        assert code == 2 and "fingerprint" in out, out
        target = next(n for n, c in cells.items() if c == (1, 0))
        _outsider_sends_activation(maddr, "s1r0")
        wait_for(
            lambda: (
                [r for r in rows(outs[target]) if "rejects" in r][-1]["rejects"].get(
                    "unauthorized", 0
                )
                > 0
            ),
            HANG_S,
            "the outsider's stream to be refused and counted",
        )

        # -- a peer dies: the other replica keeps training; a new join takes the free cell,
        #    downloads its stage's state, and its replica resumes
        victim = next(n for n, c in cells.items() if c == (1, 1))
        partner = next(n for n, c in cells.items() if c == (0, 1))
        survivor = next(n for n, c in cells.items() if c == (1, 0))
        killed_at = time.time()
        kill(joins[victim])  # the peer's machine dies: its DHT process and p2pd with it
        at_kill = step(outs[survivor])
        # the dashboard shows its cell dead within the claim's lifetime (plus one DHT read)
        dead_at = _dead_on_the_dashboard(url, "s1r1")
        assert dead_at - killed_at <= HEARTBEAT_LIVES * HEARTBEAT_S + READ_TIMEOUT_S
        if browser.installed():
            page = browser.look(url)
            assert page.cells["s1r1"] == "dead" and len(page.cells) == 4, page.cells
            shot = browser.screenshot(url, browser.shots_dir(tmp_path) / "dashboard-wan.png")
            assert shot.stat().st_size > 10_000
        stop(dash, timeout_s=20)  # a clean stop: its p2pd reaped, its sockets removed
        wait_for(lambda: step(outs[survivor]) >= at_kill + 20, 60, "the other replica")
        wait_for(
            lambda: "s1r1" in status(maddr)["free"], HANG_S, "the dead peer's claim to expire", 2
        )
        before = step(outs[partner])
        join("j4")
        outs["j4"] = tmp_path / "j4"
        wait_for(lambda: step(outs[partner]) > before + 5, HANG_S, "the replica to resume")
        assert cell_of(outs["j4"]) == (1, 1)
        loaded = [r for r in rows(outs["j4"]) if r.get("event") == "state_loaded"]
        assert loaded and loaded[0]["step"] > at_kill

        # -- the bootstrap node dies: peers keep training; a join naming only it fails clearly
        stop(dht)
        at_dht = step(outs[survivor])
        wait_for(lambda: step(outs[survivor]) >= at_dht + 20, 60, "training without bootstrap")
        code, out, _ = run_meshtrain("join", *peers, *LOOPBACK, timeout_s=HANG_S)
        assert code == 2 and "DHT" in out and "Traceback" not in out, out

        # -- Ctrl-C / SIGTERM: every join saves its cell, releases it and exits 0
        codes = {n: stop(p) for n, p in joins.items() if n != victim}
        assert all(c == 0 for c in codes.values()), codes
        for n, c in cells.items():
            if n == victim:
                continue
            saved = sorted((outs[n] / "checkpoints" / f"{c[0]}-{c[1]}").glob("step-*.pt"))
            last = torch.load(saved[-1], weights_only=True)
            # the stop-save holds every update the cell logged: nothing trained is lost
            assert last["step"] >= step(outs[n]), (n, last["step"], step(outs[n]))

        # -- the whole run restarts on a new bootstrap: a peer takes back the cell it has
        #    checkpoints of (not the first free one) and resumes from its checkpoint
        dht2 = meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        extra.append(dht2)
        maddr2 = dht2.stdout.readline().strip()
        back = "j4"  # the replacement join, which held s1r1
        saved_step = max(
            torch.load(p, weights_only=True)["step"]
            for p in (outs[back] / "checkpoints" / "1-1").glob("step-*.pt")
        )
        again = meshtrain(
            "join",
            "--initial-peers",
            maddr2,
            *LOOPBACK,
            "--config",
            str(cfg),
            "--out",
            str(outs[back]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        extra.append(again)
        joined = next(line for line in again.stdout if "joined run" in line)
        assert " as s1r1 " in joined, joined  # not s0r0, the first free cell in grid order
        wait_for(
            lambda: (
                [c["step"] for c in status(maddr2)["cells"] if c["cell"] == "s1r1"] == [saved_step]
            ),
            HANG_S,
            "the restarted peer's claim at its checkpoint's step",
            2,
        )
        assert stop(again) == 0
    finally:
        for p in [*joins.values(), dht, *extra]:
            kill(p)


def _dashboard_json(url: str) -> dict:
    try:
        return json.loads(urllib.request.urlopen(url + "api/status", timeout=30).read())
    except urllib.error.HTTPError as e:  # 503: the DHT did not answer this time
        return json.loads(e.read())


def _all_training(url: str) -> bool:
    d = _dashboard_json(url)
    states = {c["cell"]: c["state"] for c in d.get("cells", [])}
    points = sum(len(v) for v in d.get("curves", {}).get("train", {}).values())
    return states == dict.fromkeys(CELLS, "training") and points >= 2


def _dead_on_the_dashboard(url: str, cell: str) -> float:
    """The dashboard's clock (its JSON's `now`) when it first shows `cell` dead."""
    dead_at: list[float] = []

    def dead() -> bool:
        d = _dashboard_json(url)
        if {c["cell"]: c["state"] for c in d.get("cells", [])}.get(cell) == "dead":
            dead_at.append(d["now"])
        return bool(dead_at)

    wait_for(dead, HANG_S, f"{cell} to show dead on the dashboard", period_s=0.2)
    return dead_at[0]


def _outsider_sends_activation(maddr: str, to: str) -> None:
    """A transport without the run key (and another config) sends a cell an activation."""
    from comms import codecs
    from comms.p2p.transport import P2PTransport
    from comms.wire import Kind

    with P2PTransport("intruder", initial_peers=[maddr], timeout_s=10) as t:
        enc = codecs.encode(torch.zeros(2, 16, 16), "fp32")
        handle = t.send(to, "0/act/0", Kind.ACTIVATION, enc, 0)
        try:
            handle.wait(10)
        except Exception:  # noqa: BLE001 - refused: the stream is closed on us
            pass


def _forge(maddr: str, conn) -> None:
    """Another process (another RSA key) tries to overwrite and to withdraw a signed claim."""
    from comms.p2p.dht import DhtClient

    other = DhtClient([maddr], "forge", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        subkey = conn.recv()
        fake = {"v": 1, "cell": "s0r0", "peer": "mallory"}
        conn.send(
            [
                other.dht_store("cells.r0", subkey, fake, 30),
                other.dht_store("cells.r0", subkey, None, 31),
            ]
        )
    finally:
        other.close()


def test_a_signed_claim_cannot_be_overwritten_by_another_peer():
    import multiprocessing as mp

    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from comms.p2p.dht import DhtClient

    boot = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[RSASignatureValidator()],
    )
    maddr = str(boot.get_visible_maddrs()[0])
    mine = DhtClient([maddr], "forge", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_forge, args=(maddr, there))
    try:
        subkey = f"s0r0/me{mine.owner_marker}"
        assert mine.dht_store("cells.r0", subkey, {"v": 1, "cell": "s0r0", "peer": "me"}, 30)
        proc.start()
        here.send(subkey)
        assert here.recv() == [False, False]  # both refused by the validators
        assert mine.dht_get("cells.r0") == {subkey: {"v": 1, "cell": "s0r0", "peer": "me"}}
    finally:
        proc.join(30)
        mine.close()
        boot.shutdown()
