"""Reachability on 127.0.0.1: a join that other peers cannot dial back is told the fix and claims
nothing; a reachable one is told so and claims its cell; p2pd failing to start (its port taken)
is one line with the cause and the fix, exit 2, for `dht` and `join` alike. (A peer in a
namespace with no route back to it: tests/throttled/test_join_reach_netns.py.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import helpers
import pytest
from p2p_procs import assert_gone, comm, process_tree, sockets_of

from mesh.testing.local_peers import (
    LOOPBACK,
    meshtrain,
    run_meshtrain,
    start_dht,
    status,
    stop,
    tiny_grid_config,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ID = "12D3KooWLmVKHJP3ztkbN8zXcZfBDMfZ9Go9tJ2ZeFmGyZ3M6fr5"
HANG_S = 90


def test_unreachable_join_claims_nothing_and_a_reachable_one_does(text_file, tmp_path):
    cfg = tiny_grid_config(tmp_path, text_file)
    dht, maddr = start_dht()
    # a port that refuses connections (bound, never listening): what others meet when this
    # machine announces a port that its router does not forward
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    joined = None
    try:
        code, out, _ = run_meshtrain(
            "join",
            "--initial-peers",
            maddr,
            *LOOPBACK,
            "--config",
            str(cfg),
            "--announce-maddrs",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--out",
            str(tmp_path / "j0"),
            timeout_s=HANG_S,
        )
        assert code == 2, out
        assert "could not dial this one" in out and "connection refused" in out, out
        assert f"--announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/{port}" in out, out
        assert "--client-mode" in out and "Traceback" not in out, out
        seen = status(maddr)
        assert seen["grid"] is None and seen["cells"] == [], seen  # no run record, no claim
        assert not (tmp_path / "j0").exists()
        # the bootstrap's probe p2pd (started for the dial-back) is gone: only its own is left
        assert _p2pds(dht.pid) == 1
        # the overrides get past the check (then stop at a --stage the run does not have)
        for flag in ("--skip-reach-check", "--client-mode"):
            code, out, _ = run_meshtrain(
                "join",
                "--initial-peers",
                maddr,
                *LOOPBACK,
                "--config",
                str(cfg),
                flag,
                "--announce-maddrs",
                f"/ip4/127.0.0.1/tcp/{port}",
                "--stage",
                "9",
                timeout_s=HANG_S,
            )
            assert code == 2 and f"reachability: not checked ({flag}" in out, out
            assert "--stage 9: the run has stages 0..1" in out, out

        log = tmp_path / "j1.log"
        with log.open("w") as f:
            joined = meshtrain(
                "join",
                "--initial-peers",
                maddr,
                *LOOPBACK,
                "--config",
                str(cfg),
                "--out",
                str(tmp_path / "j1"),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        wait_for(
            lambda: "joined run" in log.read_text() or joined.poll() is not None,
            HANG_S,
            "the reachable join's claim",
        )
        text = log.read_text()
        assert "reachability: reachable: a peer of the run dialed this one back at " in text
        assert "/ip4/127.0.0.1/tcp/" in text and "joined run" in text, text
        # its claim: the scout's, or (when a loaded host's store missed the bootstrap node) the
        # cell's own, made when its DHT node is up
        wait_for(lambda: len(status(maddr)["cells"]) == 1, HANG_S, "its claim in the DHT")
    finally:
        closed.close()
        if joined is not None:
            assert stop(joined) == 0
        stop(dht)


def test_p2pd_start_failures_are_one_line_with_the_fix(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))  # listening: also answers join's TCP probe
    port = taken.getsockname()[1]
    try:
        code, out, _ = run_meshtrain("dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
        assert code == 2 and "Traceback" not in out, out
        assert out.strip().splitlines()[-1] == (
            f"error: the libp2p daemon (p2pd) could not start: port {port} on 127.0.0.1 is taken "
            "(another program, or another peer on this machine): choose another port in "
            f"--host-maddrs, or /tcp/0 for any free one (`ss -ltnp 'sport = :{port}'` shows "
            "who holds it)"
        )
        code, out, _ = run_meshtrain(
            "join",
            "--initial-peers",
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{ID}",
            "--host-maddrs",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--out",
            str(tmp_path / "j"),
        )
        assert code == 2 and "Traceback" not in out, out
        assert f"could not start: port {port} on 127.0.0.1 is taken" in out, out
        code, out, _ = run_meshtrain(
            "dht",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--announce-maddrs",
            "/ip4/127.0.0.1/tcp/0",
        )
        assert code == 2 and "--announce-maddrs needs the port others dial" in out, out
    finally:
        taken.close()


def _p2pds(pid: int) -> int:
    """How many p2pd processes run under `pid` (zombies count: a probe must be reaped)."""
    return sum(comm(p) == "p2pd" for p in process_tree(pid)[1:])


def test_any_dht_peer_answers_when_the_bootstrap_does_not():
    """A plain hivemind bootstrap serves no dial-back: with nobody else the verdict is unknown
    (join goes on and says so); once a peer's transport serves the DHT, it answers instead."""
    from functools import partial

    from cli.reach import peer_id_of, reach_verdict
    from comms.p2p import dialback
    from comms.p2p.dht import start_dht
    from comms.p2p.transport import P2PTransport

    boot = helpers.BootNode()
    maddrs = [str(m) for m in boot.get_visible_maddrs()]
    ask = partial(dialback.ask, [peer_id_of(maddrs[0])], 2, 30.0, None)
    scout = peer = None
    try:
        scout = start_dht(maddrs, 30, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        alone = scout.run_coroutine(ask, return_future=True).result(HANG_S)
        assert alone["answers"] == [] and alone["silent"] == [peer_id_of(maddrs[0])]
        assert reach_verdict(alone, [])[0] == "unknown"

        peer = P2PTransport("s0r0", initial_peers=maddrs)
        scout.shutdown()
        scout.join(10)
        scout = start_dht(maddrs, 30, client_mode=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        helped = scout.run_coroutine(ask, return_future=True).result(HANG_S)
        assert [a["helper"] for a in helped["answers"]] == [peer.peer_id], helped
        verdict, text = reach_verdict(helped, [])
        assert verdict == "reachable" and "/ip4/127.0.0.1/tcp/" in text
    finally:
        for node in (scout, boot):
            if node is not None:
                node.shutdown()
                node.join(10)
        if peer is not None:
            peer.close()


def test_a_killed_bootstrap_node_leaves_no_daemon_or_socket_behind():
    # `meshtrain dht` runs the peers' DHT (comms.p2p.dht.PeerDHT): SIGKILLed, its DHT process
    # and p2pd still stop and remove their socket files (a plain hivemind.DHT's ran on)
    dht = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert "/ip4/127.0.0.1/tcp/" in dht.stdout.readline()  # it is up
        helpers = process_tree(dht.pid)[1:]
        assert _p2pds(dht.pid) == 1 and len(helpers) >= 2  # its DHT process and p2pd
        sockets = sockets_of(helpers)
        assert sockets  # p2pd's control sockets
        os.kill(dht.pid, signal.SIGKILL)
        dht.wait(10)
        assert_gone(helpers, sockets, timeout_s=30.0)
    finally:
        if dht.poll() is None:
            dht.kill()
            dht.wait()
