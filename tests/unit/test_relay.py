"""comms/p2p/relay.py: what a peer behind NAT asks of p2pd and publishes, and the multiaddr bytes
p2pd can read (the namespace test, tests/throttled/test_join_nat_netns.py, dials them for real)."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from comms.p2p import dht
from comms.p2p.relay import (
    MAX_RELAYS,
    RelayLimits,
    circuit_maddrs,
    dialable,
    p2pd_options,
    relay_addrs,
    via_relay,
    wire_maddr,
)
from comms.p2p.relay_service import DEFAULT_LIMIT, limit_of, pb_fields

RELAY_ID = "12D3KooWGvU6jmNszxoL2uydnoQLtUZcz7cQ2qzFdCrTJNtwvt5M"
OTHER_ID = "12D3KooWLmVKHJP3ztkbN8zXcZfBDMfZ9Go9tJ2ZeFmGyZ3M6fr5"


def test_a_peer_id_is_written_as_its_multihash_as_go_multiaddr_reads_it():
    text = f"/ip4/10.79.0.1/tcp/40513/p2p/{RELAY_ID}/p2p-circuit"
    data = wire_maddr(text).to_bytes()
    mh = PeerID.from_base58(RELAY_ID).to_bytes()
    head = Multiaddr("/ip4/10.79.0.1/tcp/40513").to_bytes()
    assert data == head + bytes([0xA5, 0x03, len(mh)]) + mh + bytes([0xA2, 0x02])
    # hivemind's own encoding is a CIDv1 (0x01 0x72 ...): p2pd refuses it
    assert Multiaddr(text).to_bytes() != data
    assert str(Multiaddr(data)) == text  # and it still reads ours back as the same address


@pytest.mark.parametrize(
    "text", ["/ip4/1.2.3.4/tcp/5", "/ip6/::1/tcp/31337", "/dns4/example.org/tcp/1/ws"]
)
def test_addresses_without_a_peer_id_are_written_as_hivemind_writes_them(text):
    assert wire_maddr(text).to_bytes() == Multiaddr(text).to_bytes()


def test_malformed_record_addresses_are_skipped_not_raised():
    good = f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY_ID}/p2p-circuit"
    bad = ["/ip4/10.0.0.1/tcp/1/p2p", "/ip4/10.0.0.1/tcp/1/p2p/not-base58!", "/nonsense/1"]
    assert [str(m) for m in dialable([*bad, good])] == [good]


def test_circuit_addresses_go_through_relays_named_with_their_peer_id():
    relays = [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY_ID}", "/ip4/10.0.0.2/tcp/2"]
    assert circuit_maddrs(relays) == [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY_ID}/p2p-circuit"]
    assert via_relay(["/ip4/10.1.0.2/tcp/3", *circuit_maddrs(relays)])
    assert not via_relay(["/ip4/10.1.0.2/tcp/3"])


def test_relays_are_peers_dialed_directly_at_their_most_public_address():
    peers = [
        (RELAY_ID, ["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.5/tcp/1", "/ip4/93.184.216.34/tcp/1"]),
        # a peer behind NAT itself (it announces a circuit): never a relay
        (OTHER_ID, ["/ip4/192.168.1.2/tcp/7", f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit"]),
    ]
    assert relay_addrs(peers) == [f"/ip4/93.184.216.34/tcp/1/p2p/{RELAY_ID}"]
    many = [(OTHER_ID, [f"/ip4/10.0.0.{k}/tcp/1"]) for k in range(1, 9)]
    assert len(relay_addrs(many)) == MAX_RELAYS


def test_a_client_mode_peer_reserves_on_its_relays_at_once_and_others_relay_within_limits():
    relays = [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY_ID}", f"/ip4/10.0.0.2/tcp/2/p2p/{OTHER_ID}"]
    kwargs, flags = p2pd_options(True, relays, RelayLimits(5, 1000))
    assert kwargs == {
        "use_auto_relay": True,
        "force_reachability": "private",
        "trusted_relays": relays,
    }
    assert flags == {"relayDiscovery": 0}  # static relays: no 3-minute wait for 4 candidates
    kwargs, flags = p2pd_options(True, [], None)
    assert "trusted_relays" not in kwargs and flags == {}
    limits = RelayLimits(8.9, 1 << 20)
    kwargs, flags = p2pd_options(False, relays, limits)
    # forced public: p2pd's relay service with these limits, checked to be the one that serves
    assert kwargs == {"force_reachability": "public", "relay_service": limits}
    assert flags == {"relayTimeLimit": "8s", "relayDataLimit": 1 << 20}  # whole seconds
    assert p2pd_options(False, [], None) == ({"force_reachability": "public"}, {})


def test_the_dht_process_passes_extra_flags_to_every_p2pd_it_starts():
    before = P2P.__dict__["_make_process_args"]
    try:
        dht._add_p2pd_flags({"relayTimeLimit": "3s", "relayDataLimit": 4096})
        args = P2P._make_process_args("p2pd", relay=True, tls=False)
        assert args == ["p2pd", "-relay=1", "-tls=0", "-relayTimeLimit=3s", "-relayDataLimit=4096"]
    finally:
        P2P._make_process_args = before
    assert P2P._make_process_args("p2pd", relay=True) == ["p2pd", "-relay=1"]


def _answer(*fields: bytes) -> bytes:
    return b"".join(fields)


def test_a_relays_answer_to_a_reservation_says_which_relay_service_serves():
    # HopMessage{type: STATUS, limit: {duration: 120, data: 131072}, status: OK}: go-libp2p's
    limit = b"\x08\x78\x10\x80\x80\x08"
    default = _answer(b"\x08\x02", b"\x22" + bytes([len(limit)]) + limit, b"\x28\x64")
    assert limit_of(default) == DEFAULT_LIMIT == (120, 131072)
    # with a reservation (field 3) before it and p2pd's configured limit: 8 s, 256 KiB
    ours = b"\x08\x08\x10\x80\x80\x10"
    rsvp = b"\x08\x96\x01\x12\x02ab"
    answer = _answer(
        b"\x08\x02",
        b"\x1a" + bytes([len(rsvp)]) + rsvp,
        b"\x22" + bytes([len(ours)]) + ours,
        b"\x28\x64",
    )
    assert limit_of(answer) == (8, 262144)
    refused = _answer(b"\x08\x02", b"\x28\xc8\x01")  # RESERVATION_REFUSED (200)
    assert limit_of(refused) is None
    with pytest.raises(ValueError):
        pb_fields(b"\x22\x09\x08")  # a field longer than the message


def test_the_first_p2pd_of_a_dht_process_is_started_until_its_relay_service_is_ours():
    import asyncio

    from comms.p2p import relay_service

    answers = iter([DEFAULT_LIMIT, None, (8, 1 << 18)])
    made: list[Daemon] = []
    asked: list[tuple[str, str]] = []

    class Daemon:
        def __init__(self, name: str) -> None:
            self.name, self.down = name, False
            made.append(self)

        async def shutdown(self) -> None:
            self.down = True

    async def create(**kwargs):
        probe = kwargs.get("no_listen")
        return Daemon("probe" if probe else f"p2pd{sum(d.name != 'probe' for d in made)}")

    async def own_limit(p2p, probe):
        asked.append((p2p.name, probe.name))
        return next(answers)

    before = P2P.__dict__["create"]
    real_own_limit = relay_service.own_limit
    try:
        P2P.create = create
        relay_service.own_limit = own_limit
        relay_service.check_relay_service(RelayLimits(8, 1 << 18))
        first = asyncio.run(P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        later = asyncio.run(P2P.create(no_listen=True))  # a dial-back probe: not checked
    finally:
        P2P.create = before
        relay_service.own_limit = real_own_limit
    # one probe asked each start; the third answered with ours, the others were stopped
    assert asked == [("p2pd0", "probe"), ("p2pd1", "probe"), ("p2pd2", "probe")]
    assert [(d.name, d.down) for d in made] == [
        ("p2pd0", True),
        ("probe", True),
        ("p2pd1", True),
        ("p2pd2", False),
        ("probe", False),
    ]
    assert first is made[3] and later is made[4]  # a later create (a dial-back's) as it was


def test_relayed_cells_travel_in_heartbeats_to_status_and_the_dashboard():
    from pathlib import Path

    from cli.status import stats_json, status_table
    from mesh.runtime import dashboard
    from mesh.runtime.registry import parse_stats

    assert parse_stats({"relayed": True}) == {"relayed": True}
    assert parse_stats({"relayed": 1}) is None and parse_stats({"relayed": "yes"}) is None
    cell = {
        "cell": "s1r1",
        "verified": True,
        "peer": "12D3KooWabcdefgh",
        "step": 3,
        "tokens_per_s": 1.0,
        "heartbeat_age_s": 0.5,
        "session": 0,
        **stats_json(parse_stats({"relayed": True})),
    }
    assert cell["relayed"] is True and stats_json(None)["relayed"] is False
    assert status_table({"cells": [cell]})[0][0] == "s1r1 (relayed)"
    page = (Path(dashboard.__file__).parent / "page.html").read_text()
    assert '(c.relayed ? " · relayed" : "")' in page  # the cell's card says it
