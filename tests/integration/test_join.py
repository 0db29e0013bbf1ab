"""A grid formed over a DHT by `meshtrain dht` + `meshtrain join` processes on 127.0.0.1.

One run (to pay the daemons' start-up once) walks through the issue's scenarios in order:
formation by four joins (only the first brings a config), `status`, a falling loss, refused
outsiders (no run key, another config fingerprint, an unkeyed transport sending activations),
a killed peer replaced by a new join that downloads its stage's state, the bootstrap node
killed (peers keep training; a join naming only it fails fast and clearly), and a clean stop.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mesh.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "correct horse battery staple"
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


def _config(tmp: Path, text_file: Path) -> Path:
    path = tmp / "run.toml"
    path.write_text(
        f"""
[model]
n_layers = 2
d_model = 16
n_heads = 2
seq_len = 16
[grid]
stages = 2
replicas = 2
[pipeline]
microbatch_size = 2
[data]
path = "{text_file}"
val_batches = 2
[run]
steps = 100000
[runtime]
heartbeat_s = 1.0
max_lag_steps = 5
round_timeout_s = 5
"""
    )
    return path


def _meshtrain(*args: str, key: str | None = KEY, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MESHTRAIN_RUN_KEY", None)
    if key is not None:
        env["MESHTRAIN_RUN_KEY"] = key
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.Popen(cmd, env=env, start_new_session=True, text=True, **kw)


def _run(*args: str, key: str | None = KEY, timeout_s: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = _meshtrain(*args, key=key, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = p.communicate(timeout=timeout_s)
    return p.returncode, out, time.monotonic() - t0


def _status(maddr: str) -> dict:
    code, out, _ = _run("status", "--initial-peers", maddr, "--json")
    assert code == 0, out
    return json.loads(out[out.index("{") :])


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.3)


def _cell_of(out: Path) -> tuple[int, int] | None:
    rows = read_metrics(out, events=True)
    return next(iter(rows), None)


def _rows(out: Path) -> list[dict]:
    rows = read_metrics(out, events=True)
    return next(iter(rows.values()), [])


def _step(out: Path) -> int:
    return max((r["step"] for r in _rows(out) if "step" in r and "event" not in r), default=0)


def _stop(p: subprocess.Popen, timeout_s: float = 60) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        return -9


def test_grid_formed_by_joins(text_file, tmp_path):
    cfg = _config(tmp_path, text_file)
    dht = _meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    joins: dict[str, subprocess.Popen] = {}
    extra: list[subprocess.Popen] = []
    try:
        maddr = dht.stdout.readline().strip()
        assert maddr.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in maddr, maddr
        peers = ["--initial-peers", maddr]
        logs = {}

        def join(name: str, *extra: str) -> None:
            logs[name] = (tmp_path / f"{name}.log").open("w")
            joins[name] = _meshtrain(
                "join", *peers, *LOOPBACK, "--out", str(tmp_path / name), *extra,
                stdout=logs[name], stderr=subprocess.STDOUT,
            )  # fmt: skip

        # -- formation: the first join brings the config, the others read it from the DHT
        join("j0", "--config", str(cfg))
        _wait(lambda: _status(maddr)["grid"] == "2x2", 60, "the run's config record")
        for name in ("j1", "j2", "j3"):
            join(name)
        outs = {n: tmp_path / n for n in joins}
        _wait(lambda: len(_status(maddr)["cells"]) == 4, 90, "four cells in status")
        _wait(lambda: all(_step(o) >= 30 for o in outs.values()), 90, "every cell training")
        status = _status(maddr)
        assert sorted(c["cell"] for c in status["cells"]) == ["s0r0", "s0r1", "s1r0", "s1r1"]
        assert status["free"] == []
        cells = {n: _cell_of(o) for n, o in outs.items()}
        last_stage = [n for n, c in cells.items() if c[0] == 1]
        for n in last_stage:
            losses = [r["loss"] for r in _rows(outs[n]) if r.get("loss") is not None]
            assert sum(losses[-5:]) / 5 < losses[0] - 0.3, (n, losses[0], losses[-5:])

        # -- outsiders are refused, clearly and fast
        code, out, _ = _run("join", *peers, *LOOPBACK, key="not the key")
        assert code == 2 and "run key does not match" in out, out
        code, out, _ = _run(
            "join", *peers, *LOOPBACK, "--config", str(cfg), "--set", "model.d_model=32"
        )
        assert code == 2 and "fingerprint" in out, out
        target = next(n for n, c in cells.items() if c == (1, 0))
        _outsider_sends_activation(maddr, "s1r0")
        _wait(
            lambda: (
                [r for r in _rows(outs[target]) if "rejects" in r][-1]["rejects"].get(
                    "unauthorized", 0
                )
                > 0
            ),
            30,
            "the outsider's stream to be refused and counted",
        )

        # -- a peer dies: the other replica keeps training; a new join takes the free cell,
        #    downloads its stage's state, and its replica resumes
        victim = next(n for n, c in cells.items() if c == (1, 1))
        partner = next(n for n, c in cells.items() if c == (0, 1))
        survivor = next(n for n, c in cells.items() if c == (1, 0))
        os.killpg(joins[victim].pid, signal.SIGKILL)
        joins[victim].wait(10)
        at_kill = _step(outs[survivor])
        _wait(lambda: _step(outs[survivor]) >= at_kill + 20, 60, "the other replica")
        _wait(lambda: "s1r1" in _status(maddr)["free"], 30, "the dead peer's claim to expire")
        t_join = time.monotonic()
        before = _step(outs[partner])
        join("j4")
        outs["j4"] = tmp_path / "j4"
        _wait(lambda: _step(outs[partner]) > before + 5, 60, "the replica to resume")
        resumed_s = time.monotonic() - t_join
        assert _cell_of(outs["j4"]) == (1, 1)
        loaded = [r for r in _rows(outs["j4"]) if r.get("event") == "state_loaded"]
        assert loaded and loaded[0]["step"] > at_kill
        assert resumed_s < 10, resumed_s  # the bound; ~4.5 s on this 2-core box

        # -- the bootstrap node dies: peers keep training; a join naming only it fails fast
        _stop(dht)
        at_dht = _step(outs[survivor])
        _wait(lambda: _step(outs[survivor]) >= at_dht + 20, 60, "training without bootstrap")
        code, out, took = _run("join", *peers, *LOOPBACK)
        assert code == 2 and "DHT" in out and "Traceback" not in out, out
        assert took < 10, took

        # -- Ctrl-C / SIGTERM: every join saves its cell, releases it and exits 0
        codes = {n: _stop(p) for n, p in joins.items() if n != victim}
        assert all(c == 0 for c in codes.values()), codes
        for n, c in cells.items():
            if n == victim:
                continue
            saved = sorted((outs[n] / "checkpoints" / f"{c[0]}-{c[1]}").glob("step-*.pt"))
            last = torch.load(saved[-1], weights_only=True)
            assert last["step"] == _step(outs[n]) or last["step"] >= _step(outs[n]) - 1

        # -- the whole run restarts on a new bootstrap: a peer takes back the cell it has
        #    checkpoints of (not the first free one) and resumes from its checkpoint
        dht2 = _meshtrain("dht", *LOOPBACK, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        extra.append(dht2)
        maddr2 = dht2.stdout.readline().strip()
        back = "j4"  # the replacement join, which held s1r1
        saved_step = max(
            torch.load(p, weights_only=True)["step"]
            for p in (outs[back] / "checkpoints" / "1-1").glob("step-*.pt")
        )
        again = _meshtrain(
            "join", "--initial-peers", maddr2, *LOOPBACK, "--config", str(cfg),
            "--out", str(outs[back]), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        extra.append(again)
        joined = next(line for line in again.stdout if "joined run" in line)
        assert " as s1r1 " in joined, joined  # not s0r0, the first free cell in grid order
        _wait(
            lambda: (
                [c["step"] for c in _status(maddr2)["cells"] if c["cell"] == "s1r1"] == [saved_step]
            ),
            30,
            "the restarted peer's claim at its checkpoint's step",
        )
        assert _stop(again) == 0
    finally:
        for p in [*joins.values(), dht, *extra]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def _outsider_sends_activation(maddr: str, to: str) -> None:
    """A transport without the run key (and another config) sends a cell an activation."""
    from comms import codecs
    from comms.p2p import P2PTransport
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
    from comms.p2p_dht import DhtClient

    other = DhtClient([maddr], "forge", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        subkey = conn.recv()
        fake = {"v": 1, "cell": "s0r0", "peer": "mallory"}
        conn.send(
            [other.dht_store("cells", subkey, fake, 30), other.dht_store("cells", subkey, None, 31)]
        )
    finally:
        other.close()


def test_a_signed_claim_cannot_be_overwritten_by_another_peer():
    import multiprocessing as mp

    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from comms.p2p_dht import DhtClient

    boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                        record_validators=[RSASignatureValidator()])  # fmt: skip
    maddr = str(boot.get_visible_maddrs()[0])
    mine = DhtClient([maddr], "forge", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_forge, args=(maddr, there))
    try:
        subkey = f"s0r0/me{mine.owner_marker}"
        assert mine.dht_store("cells", subkey, {"v": 1, "cell": "s0r0", "peer": "me"}, 30)
        proc.start()
        here.send(subkey)
        assert here.recv() == [False, False]  # both refused by the validators
        assert mine.dht_get("cells") == {subkey: {"v": 1, "cell": "s0r0", "peer": "me"}}
    finally:
        proc.join(30)
        mine.close()
        boot.shutdown()
