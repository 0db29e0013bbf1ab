"""A claim on a loaded box: a holder whose beats come further apart than a claim's idle life (its
stores slow to land, as on a loaded 2-core box with sixteen joins) is never read as gone by the
other peers, on a real hivemind DHT on 127.0.0.1. Without registry.claim_ttl_s each record
expired between two such beats and `status` listed the held cell free."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.integration]

HEARTBEAT_S = 0.5
LATE_S = 2.5  # each beat's store lands this late: its beats come about 3 s apart, its life 2 s


def test_a_holder_whose_beats_come_late_is_never_read_as_gone() -> None:
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from comms.p2p.dht import DhtClient
    from mesh.runtime.registry import HEARTBEAT_LIVES, Registry
    from mesh.runtime.session import DhtCoordinator

    class LateRegistry(Registry):
        """The holder's registry: each beat waits LATE_S first (the time a loaded DHT took
        to take a store), so its records land that far apart."""

        def beat(self, rec, min_ttl_s=0.0):  # noqa: ANN001, ANN201 - Registry.beat's
            time.sleep(LATE_S)
            return super().beat(rec, min_ttl_s)

    assert LATE_S + HEARTBEAT_S > HEARTBEAT_S * HEARTBEAT_LIVES  # the idle life would lapse
    boot = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        record_validators=[RSASignatureValidator()],
    )
    maddr = str(boot.get_visible_maddrs()[0])
    nodes = [DhtClient([maddr], "late", 15, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in "hr"]
    holder_node, reader_node = nodes
    holder = None
    try:
        holder = DhtCoordinator(
            LateRegistry(holder_node, None, HEARTBEAT_S),
            cell="s0r0",
            peer=holder_node.peer_id,
            replica_cells=["s0r0", "s1r0"],
            leader=True,
            replica=0,
            steps=100,
            mpu=1,
            wait_s=60.0,
        )
        reader = Registry(reader_node, None, HEARTBEAT_S)
        # from the holder's third beat on (it has seen how late they come), every read that
        # answers finds its claim, over several of its beats
        deadline = time.monotonic() + 3 * (LATE_S + HEARTBEAT_S) + 30
        while len(holder._beat_gaps_s) < 2:
            assert time.monotonic() < deadline, "the holder did not beat"
            time.sleep(HEARTBEAT_S)
        seen = []
        until = time.monotonic() + 4 * (LATE_S + HEARTBEAT_S)
        while time.monotonic() < until:
            owned = reader.owners([0])
            if owned is not None:
                seen.append(owned.get("s0r0") is not None)
            time.sleep(HEARTBEAT_S / 2)
        assert len(seen) >= 10 and all(seen), (seen, list(holder._beat_gaps_s))
        assert holder.claim_ttl_s > LATE_S + HEARTBEAT_S
    finally:
        if holder is not None:
            holder.close()
        for node in nodes:
            node.close()
        boot.shutdown()
