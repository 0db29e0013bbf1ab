"""A peer with no route back to it: `meshtrain dht` in namespace a, `meshtrain join` in b. First
b is reachable (a dials it back); then a's new connections to b are dropped (a NAT or firewall in
front of b, seen from a; b's own connections to a still work) and the join is refused with the
fix, claiming nothing. Root only; skipped cleanly otherwise."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from comms.netns import ADDR_A, ADDR_B, drop_new_connections, netns_pair, unavailable
from mesh.testing.local_peers import KEY, tiny_grid_config

pytestmark = [pytest.mark.throttled, pytest.mark.integration, pytest.mark.slow]
HANG_S = 120


def test_join_with_no_route_back_is_refused_with_the_fix(text_file, tmp_path):
    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    cfg = tiny_grid_config(tmp_path, text_file)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MESHTRAIN_RUN_KEY": KEY}

    with netns_pair() as pair:

        def meshtrain(ns: str, *args: str) -> tuple[int, str]:
            cmd = pair.cmd(ns, sys.executable, "-m", "cli.main", *args)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
            return p.returncode, p.stdout + p.stderr

        def join(*args: str) -> tuple[int, str]:
            return meshtrain(
                pair.b,
                "join",
                "--initial-peers",
                bootstrap,
                "--config",
                str(cfg),
                "--host-maddrs",
                f"/ip4/{ADDR_B}/tcp/0",
                *args,
            )

        cmd = pair.cmd(
            pair.a, sys.executable, "-m", "cli.main", "dht", "--host-maddrs", f"/ip4/{ADDR_A}/tcp/0"
        )
        dht = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            bootstrap = dht.stdout.readline().strip()
            assert bootstrap.startswith(f"/ip4/{ADDR_A}/"), bootstrap
            # reachable: checked, then stopped by a --stage the run does not have (no cell runs)
            code, out = join("--stage", "9", "--out", str(tmp_path / "control"))
            assert code == 2 and "--stage 9: the run has stages 0..1" in out, out
            assert f"dialed this one back at /ip4/{ADDR_B}/tcp/" in out, out

            drop_new_connections(pair)
            code, out = join("--out", str(tmp_path / "j"))
            assert code == 2 and "Traceback" not in out, out
            assert "a peer of the run could not dial this one" in out, out
            assert "No cell was claimed" in out and "--client-mode" in out, out
            code, out = meshtrain(pair.b, "status", "--initial-peers", bootstrap, "--json")
            assert code == 0, out
            assert json.loads(out[out.index("{") :])["cells"] == [], out
            assert not (tmp_path / "j").exists()
        finally:
            dht.send_signal(signal.SIGTERM)
            try:
                dht.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(dht.pid, signal.SIGKILL)
                dht.wait(10)
