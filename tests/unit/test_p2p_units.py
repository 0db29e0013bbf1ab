"""Membership tokens and peer records (pure parts of the p2p side)."""

from hivemind.p2p import PeerID

from comms.p2p.auth import Auth
from comms.p2p.peer_record import pick_record


def test_token_binds_key_context_and_peer():
    auth = Auth.of("secret", "fp1")
    t = auth.token("QmA", "[owner:a]")
    assert auth.valid("QmA", "[owner:a]", t)
    assert not auth.valid("QmB", "[owner:a]", t)  # copied to another PeerID
    assert not auth.valid("QmA", "[owner:b]", t)  # copied into a record signed by another key
    assert not Auth.of("other", "fp1").valid("QmA", "[owner:a]", t)  # another key
    assert not Auth.of("secret", "fp2").valid("QmA", "[owner:a]", t)  # another config
    assert not auth.valid("QmA", "[owner:a]", None) and not auth.valid("QmA", "[owner:a]", 5)
    assert Auth.of(None, "fp").key_check != Auth.of("k", "fp").key_check


A_ID = "QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
B_ID = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"


def test_a_name_resolves_to_its_newest_member_record_not_an_outsiders():
    auth = Auth.of("secret", "fp")

    def record(pid, signer, t, key_holder=True):
        token = (auth if key_holder else Auth.of("guess", "fp")).token(pid, signer)
        return f"{pid}{signer}", {"v": 1, "peer_id": pid, "maddrs": [], "t": t, "auth": token}

    def admits(r):
        return auth.valid(r.peer_id.to_base58(), r.signer, r.auth)

    old = record(A_ID, "[owner:a]", 5.0)
    new = record(B_ID, "[owner:b]", 10.0)  # the name's process restarted with a new identity
    outsider = record(B_ID, "[owner:x]", 99.0, key_holder=False)  # newer, without the key
    copied = (f"{B_ID}[owner:x]", {**new[1]})  # a member's token copied under another signer
    misfiled = (f"{B_ID}[owner:a]", {**old[1], "t": 50.0})  # A's record under a key naming B
    found = dict([old, new, outsider, copied, misfiled, ("junk", [1, 2])])
    picked = pick_record(found, admits)
    assert (picked.peer_id.to_base58(), picked.signer, picked.t) == (B_ID, "[owner:b]", 10.0)
    assert pick_record(dict([old]), admits).t == 5.0
    # the newest could not be reached (dead, or its publisher's clock runs ahead): the next one
    dead = PeerID.from_base58(B_ID)
    assert pick_record(found, admits, avoid=dead).peer_id.to_base58() == A_ID
    assert pick_record(dict([new]), admits, avoid=dead).peer_id == dead  # nothing else: still it
    alone = pick_record(dict([outsider]), admits)  # only an outsider: returned, and refused
    assert alone is not None and not admits(alone)
    assert pick_record({}, admits) is None
