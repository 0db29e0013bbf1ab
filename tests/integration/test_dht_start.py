"""A DHT start that hangs (its forked process never says it is ready) is killed and retried,
instead of waiting for ever: hivemind itself waits without a deadline."""

import os
import time

import pytest

from comms.p2p import dht as dht_mod

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_stuck_start_is_killed_and_the_next_attempt_starts(monkeypatch, tmp_path) -> None:
    marker = tmp_path / "hang"
    marker.touch()
    real_run, real_start = dht_mod.PeerDHT.run, dht_mod.PeerDHT.start
    started: list = []

    def hang_once(self) -> None:  # runs in the forked DHT process
        if marker.exists():
            marker.unlink()
            time.sleep(3600)
        real_run(self)

    def start(self) -> None:
        started.append(self)
        real_start(self)

    monkeypatch.setattr(dht_mod.PeerDHT, "run", hang_once)
    monkeypatch.setattr(dht_mod.PeerDHT, "start", start)
    monkeypatch.setattr(dht_mod, "READY_SLACK_S", 1.0)
    t0 = time.monotonic()
    node = dht_mod.start_dht([], 60.0, host_maddrs=[LOOPBACK])
    try:
        assert not marker.exists() and len(started) == 2  # one stuck start, then a good one
        assert not _alive(started[0].pid)  # the stuck process is gone
        assert node.get_visible_maddrs()
        assert time.monotonic() - t0 < 50  # the stuck start cost its deadline, not forever
    finally:
        node.shutdown()


@pytest.mark.timeout(120)
def test_local_rendezvous_dht_starts_with_a_deadline() -> None:
    from comms.build import local_rendezvous

    with local_rendezvous("hivemind") as rz:
        assert rz["initial_peers"] and all("127.0.0.1" in a for a in rz["initial_peers"])
