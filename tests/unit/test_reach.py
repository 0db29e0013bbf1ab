"""Reachability's pure parts: what kind of address a multiaddr is, which announced addresses a
dial-back dials, what join tells the user about the verdict, p2pd start-up failures as cause and
fix, and a helper's answer checked before use."""

import pytest

from cli.reach import p2pd_failure, peer_id_of, reach_verdict, short_reason
from comms.addrs import address_class, dial_plan, observed_host
from comms.p2p.dht import permanent
from comms.p2p.dialback import checked_answer

ID = "12D3KooWLmVKHJP3ztkbN8zXcZfBDMfZ9Go9tJ2ZeFmGyZ3M6fr5"
HELPER = "12D3KooWQVCufsETVHgmVEnipuJXXjAB8gj2sM4jKKVi7Mq9iM5b"


@pytest.mark.parametrize(
    "maddr, kind",
    [
        ("/ip4/127.0.0.1/tcp/5", "loopback"),
        ("/ip6/::1/tcp/5", "loopback"),
        ("/ip4/192.168.1.5/tcp/5", "private"),
        ("/ip4/10.0.0.2/tcp/5/p2p/" + ID, "private"),
        ("/ip4/100.64.3.4/tcp/5", "private"),  # carrier-grade NAT
        ("/ip6/fd00::1/tcp/5", "private"),
        ("/ip4/8.8.8.8/tcp/31337", "public"),
        ("/ip6/2606:4700::1111/tcp/31337", "public"),
        ("/dns4/boot.example.org/tcp/31337", "dns"),
        (f"/ip4/8.8.8.8/tcp/1/p2p/{HELPER}/p2p-circuit/p2p/{ID}", "relay"),
        ("/ip6/::/tcp/5", "other"),  # the unspecified address: nothing to dial
        ("/ip4/224.0.0.1/tcp/5", "other"),  # multicast: a group, not a peer
        ("/ip6/ff02::1/tcp/5", "other"),
        ("/ip4/255.255.255.255/tcp/5", "other"),  # broadcast (Python calls it private)
        ("/ip4/240.0.0.1/tcp/5", "other"),  # reserved
        ("/unix/tmp/x.sock", "other"),
    ],
)
def test_address_class(maddr, kind):
    assert address_class(maddr) == kind


def test_observed_host_is_the_ip_of_a_direct_connection():
    assert observed_host("/ip4/81.2.69.142/tcp/40000") == "81.2.69.142"
    assert observed_host("/ip6/2001:db8:0::1/tcp/40000") == "2001:db8::1"
    assert observed_host(f"/ip4/8.8.8.8/tcp/1/p2p/{HELPER}/p2p-circuit") is None
    assert observed_host("/dns4/x.org/tcp/1") is None


def test_dial_plan_dials_only_the_askers_own_host():
    announced = [
        f"/ip4/81.2.69.142/tcp/31337/p2p/{ID}",  # where it connected from: dialed, bare
        "/ip4/198.51.100.7/tcp/80",  # someone else's machine: never dialed
        "/ip4/81.2.69.142/udp/31337/quic",  # not TCP
        "/dns4/victim.example.org/tcp/443",  # a name could point anywhere
        f"/ip4/8.8.8.8/tcp/1/p2p/{HELPER}/p2p-circuit/p2p/{ID}",
    ]
    dial, skipped = dial_plan(announced, "81.2.69.142")
    assert dial == ["/ip4/81.2.69.142/tcp/31337"]
    assert [m for m, _ in skipped] == announced[1:]
    assert "not the address this peer connects from (81.2.69.142)" in skipped[0][1]


def test_dial_plan_is_bounded_and_needs_an_observed_host():
    many = [f"/ip4/127.0.0.1/tcp/{1000 + k}" for k in range(10)]
    dial, skipped = dial_plan(many, "127.0.0.1", limit=4)
    assert dial == many[:4] and len(skipped) == 6
    assert dial_plan(many, None)[0] == []  # relayed asker: nothing is dialed


def test_peer_id_and_short_reason():
    assert peer_id_of(f"/ip4/1.2.3.4/tcp/5/p2p/{ID}") == ID
    assert peer_id_of("/ip4/1.2.3.4/tcp/5") is None
    why = (
        f"Connect failed. msg=failed to dial: failed to dial {ID}: all dials failed\n"
        "  * [/ip4/127.0.0.1/tcp/51401] dial tcp4 127.0.0.1:51401: connect: connection refused"
    )
    assert short_reason(why) == "dial tcp4 127.0.0.1:51401: connect: connection refused"
    assert short_reason("no answer within 6 s") == "no answer within 6 s"


def _answer(**kw):
    base = {
        "helper": HELPER,
        "ok": False,
        "via": None,
        "why": "",
        "observed": "81.2.69.142",
        "skipped": [],
        "refused": False,
    }
    return {**base, **kw}


def test_verdict_reachable_says_where():
    result = {
        "maddrs": ["/ip4/81.2.69.142/tcp/31337"],
        "answers": [_answer(ok=True, via="/ip4/81.2.69.142/tcp/31337")],
    }
    verdict, text = reach_verdict(result, [])
    assert verdict == "reachable" and "/ip4/81.2.69.142/tcp/31337" in text
    assert "private" not in text
    lan = {"maddrs": [], "answers": [_answer(ok=True, via="/ip4/192.168.1.5/tcp/4001")]}
    assert "only peers on that network" in reach_verdict(lan, [])[1]


def test_verdict_unreachable_gives_both_fixes_with_the_observed_address():
    result = {
        "maddrs": ["/ip4/81.2.69.142/tcp/31337"],
        "answers": [_answer(why="no answer within 6 s")],
    }
    verdict, text = reach_verdict(result, ["/ip4/81.2.69.142/tcp/31337"])
    assert verdict == "unreachable"
    assert "could not dial this one: no answer within 6 s" in text
    assert "No cell was claimed" in text
    assert "--announce-maddrs /ip4/81.2.69.142/tcp/31337" in text  # its public IP and its port
    assert "--client-mode" in text and "--skip-reach-check" in text


def test_verdict_behind_nat_names_the_address_seen():
    # a NAT: the peer announces its LAN address, the helper sees its router's public address
    lan = "/ip4/192.168.1.5/tcp/40000"
    result = {"maddrs": [lan], "answers": [_answer(why="no address to dial", skipped=[[lan, "x"]])]}
    verdict, text = reach_verdict(result, [])
    assert verdict == "unreachable"
    assert "/ip4/192.168.1.5/tcp/40000" in text and "connects from, 81.2.69.142" in text
    assert "--announce-maddrs /ip4/81.2.69.142/tcp/PORT" in text
    private = {"maddrs": [], "answers": [_answer(why="no answer", observed="10.0.0.9")]}
    assert "YOUR_PUBLIC_IP" in reach_verdict(private, [])[1]  # a LAN helper's view is no help


def test_verdict_unknown_when_nobody_could_check():
    assert reach_verdict({"maddrs": [], "answers": []}, [])[0] == "unknown"
    busy = {"maddrs": [], "answers": [_answer(why="busy", refused=True)]}
    verdict, text = reach_verdict(busy, [])
    assert verdict == "unknown" and "busy" in text


@pytest.mark.parametrize(
    "error, says",
    [
        # hivemind's texts, as reproduced on this machine
        (
            "Daemon failed to start: 2026/12/01 04:19:26 failed to listen on any addresses: "
            "[listen tcp4 127.0.0.1:33757: bind: address already in use]",
            "port 33757 on 127.0.0.1 is taken",
        ),
        (
            "Daemon failed to start: 2026/12/01 04:19:26 failed to listen on any addresses: "
            "[listen tcp4 10.99.99.99:0: bind: cannot assign requested address]",
            "10.99.99.99 in --host-maddrs is not an address of this machine",
        ),
        (
            'Daemon failed to start: 2026/12/01 04:19:36 failed to parse multiaddr "garbage": '
            "must begin with /",
            'a multiaddr in --host-maddrs is malformed ("garbage"',
        ),
        (
            "Daemon failed to start: 2026/12/01 04:19:26 failed to listen on any addresses: "
            "[no transport for protocol]",
            "a transport p2pd cannot listen on",
        ),
        (
            "Please specify an explicit port in announce_maddrs: port 0 is not supported",
            "--announce-maddrs needs the port others dial",
        ),
        (
            "Daemon failed to start: 2026/12/01 04:19:47 listen unix /tmp/hivemind-p2pd-A.sock: "
            "bind: permission denied",
            "make /tmp writable",
        ),
        (
            "The directory `/nonexistent/dir` for saving the identity does not exist",
            "--identity: the directory /nonexistent/dir does not exist",
        ),
        (
            "p2pd binary not found at /x/p2pd. This may indicate a failed installation.",
            "reinstall hivemind",
        ),
        ("Daemon failed to start in 15.0 seconds", "did not start within 15.0 s"),
        ("Daemon failed to start: 2026/12/01 04:19:47 something new", "start: something new"),
    ],
)
def test_p2pd_failures_have_cause_and_fix(error, says):
    text = p2pd_failure(RuntimeError(error))
    assert text is not None and text.startswith("the libp2p daemon (p2pd) could not start: ")
    assert says in text


def test_not_start_failures_are_left_to_the_caller():
    bootstrap = "Daemon failed to start: 2026/12/01 failed to connect to bootstrap peers"
    assert p2pd_failure(bootstrap) is None  # open_scout says which --initial-peers failed
    assert p2pd_failure(KeyError("x")) is None


def test_permanent_start_failures_are_not_retried():
    assert permanent(RuntimeError("[listen tcp4 127.0.0.1:1: bind: address already in use]"))
    assert permanent(ValueError("Please specify an explicit port in announce_maddrs"))
    assert not permanent(RuntimeError("Daemon failed to start: failed to connect to bootstrap"))


def test_a_helpers_answer_is_checked_before_use():
    good = {"v": 1, "ok": True, "via": "/ip4/1.2.3.4/tcp/5", "why": "", "observed": "1.2.3.4"}
    assert checked_answer(good)["ok"] is True
    for bad in (
        None,
        [],
        {**good, "v": 2},
        {**good, "ok": "yes"},
        {**good, "via": 5},
        {**good, "skipped": [["a"]]},
        {**good, "why": None},
    ):
        assert checked_answer(bad) is None
    long = checked_answer({**good, "why": "x" * 10_000})
    assert len(long["why"]) == 300
