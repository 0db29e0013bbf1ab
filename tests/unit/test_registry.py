"""Claims, owners, free cells, sessions and run records: the pure parts of the DHT registry."""

from fakes import FakeDirectory

from comms.p2p.auth import Auth
from mesh.runtime.registry import (
    CellRecord,
    Registry,
    SessionRecord,
    cell_value,
    free_cells,
    owners,
    parse_cell,
    parse_run,
    parse_session,
    session_value,
)


def rec(cell, peer, since, inc=1, auth=None, signer=""):
    return CellRecord(cell, peer, inc, since, 0, 10, 5.0, since, auth, signer)


def test_cell_record_round_trip_and_type_checks():
    r = rec("s0r1", "Qm1", 12.5, inc=7, auth="ab")
    assert parse_cell(cell_value(r)) == r
    assert "signer" not in cell_value(r)  # it comes from the subkey, which the DHT signs
    bad = cell_value(r)
    for key, value in [("step", "10"), ("cell", 3), ("v", 2), ("inc", True)]:
        assert parse_cell({**bad, key: value}) is None, key
    assert parse_cell([1, 2]) is None
    assert parse_cell({k: v for k, v in bad.items() if k != "since"}) is None


def test_earliest_claim_owns_a_cell_ties_to_the_smaller_peer():
    claims = [rec("s0r0", "B", 2.0), rec("s0r0", "A", 3.0), rec("s1r0", "Z", 5.0)]
    assert owners(claims)["s0r0"].peer == "B"
    assert owners([rec("s0r0", "B", 2.0), rec("s0r0", "A", 2.0)])["s0r0"].peer == "A"
    assert free_cells(["s0r0", "s1r0", "s0r1"], owners(claims)) == ["s0r1"]


def test_session_and_run_records_are_type_checked():
    s = SessionRecord(1795000000000, 64, 100, {"s0r0": 5, "s1r0": 6})
    assert parse_session(session_value(s)) == s
    assert parse_session({**session_value(s), "members": {"s0r0": "5"}}) is None
    assert parse_session({**session_value(s), "epoch": 1.5}) is None
    assert parse_run({"v": 1, "fingerprint": "f", "toml": "x", "key_check": 3}) is None


def test_claims_without_the_run_token_are_ignored_and_counted():
    d = FakeDirectory()
    auth = Auth.of("secret", "fp")
    reg = Registry(d, auth, 1.0)
    reg.beat(rec("s0r0", "good", 1.0, auth=reg.token("good")))
    signer = d.owner_marker
    other = Registry(d.joined("[owner:x]"), auth, 1.0)
    other.beat(rec("s1r0", "outsider", 0.5, auth=Auth.of(None, "fp").token("outsider", signer)))
    other.beat(rec("s1r0", "copycat", 0.4, auth=reg.token("good")))  # a token for another peer
    other.beat(rec("s1r1", "good", 0.3, auth=reg.token("good")))  # good's token, other signer
    misfiled = cell_value(rec("s1r1", "good", 0.2, auth=reg.token("good")))
    d.data[reg.space + "cells.r1"]["s1r1/bad[owner:test]"] = misfiled  # names another peer
    good = rec("s0r0", "good", 1.0, auth=reg.token("good"), signer=signer)
    assert reg.owners([0, 1]) == {"s0r0": good}
    assert reg.rejected == 4
    reg.release("s0r0", "good")
    assert reg.owners([0, 1]) == {}


def test_an_unanswering_dht_is_unknown_not_empty():
    d = FakeDirectory()
    reg = Registry(d, None, 1.0)
    reg.beat(rec("s0r0", "p", 1.0))
    d.answer = False
    assert reg.cells([0]) is None and reg.owners([0]) is None
    assert reg.run() is None and reg.session(0, "s0r0") is None


def test_a_replicas_session_is_the_one_its_leader_cells_owner_signed():
    d = FakeDirectory("[owner:lead]")
    lead = Registry(d, None, 1.0)
    lead.beat(rec("s0r0", "L", 1.0))
    s = SessionRecord(5, 0, 10, {"s0r0": 1})
    assert lead.put_session(0, s) and lead.session(0, "s0r0") == s
    outsider = Registry(d.joined("[owner:x]"), None, 1.0)
    stop = SessionRecord(9, 0, 0, {}, True)
    assert outsider.put_session(0, stop)  # under its own signed subkey: stored, never read
    assert not outsider.d.dht_store("session.r0", "leader[owner:lead]", session_value(stop), 60)
    assert outsider.session(0, "s0r0") == s
    assert lead.session(0, "s0r1") is None  # no live owner of that leader cell: no session


def test_claims_are_filed_per_replica_and_read_only_where_asked():
    """A replica's cells read their own replica's key, not every claim of the grid (one key
    read by all 32 peers was what broke `bench scale`); a claim filed under another replica's
    key is rejected; a reader without the grid probes replica by replica."""
    d = FakeDirectory()
    reg = Registry(d, None, 1.0)
    for cell in ["s0r0", "s1r0", "s0r1", "s0r2"]:
        reg.beat(rec(cell, f"p-{cell}", 1.0))
    assert sorted(d.data) == ["cells.r0", "cells.r1", "cells.r2"]
    assert sorted(reg.owners([0])) == ["s0r0", "s1r0"] and d.reads == {"cells.r0": 1}
    assert sorted(reg.owners([1, 2])) == ["s0r1", "s0r2"]
    d.data["cells.r1"]["s1r0/x[owner:test]"] = cell_value(rec("s1r0", "x", 0.5))
    assert reg.owners([1])["s0r1"].peer == "p-s0r1" and "s1r0" not in reg.owners([1])
    assert reg.rejected == 2  # once per read
    assert sorted(reg.probe_owners()) == ["s0r0", "s0r1", "s0r2", "s1r0"]
    d.answer = False
    assert reg.probe_owners() is None and reg.owners([0, 1]) is None
